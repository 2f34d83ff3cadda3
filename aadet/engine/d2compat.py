"""The only place aadet touches Detectron2 internals (names without a public equivalent).

Everything else in aadet uses Detectron2's public API. Each wrapper below names the internal it
relies on; ``tests/test_d2compat.py`` fails loudly (naming the internal) if a Detectron2 version
changes one of them.

Checked against (same names, same meaning):

* Detectron2 v0.6 (tag ``v0.6``, Nov 2021), the README's oldest supported version;
* the installed offline snapshot ``sal-detectron2==0.7.2`` (2024);
* upstream ``main`` at commit 02b5c4e (June 2026).

Internals used:

* ``DefaultTrainer._trainer`` (the ``SimpleTrainer``/``AMPTrainer`` running the loop; all three
  versions) and, to restart its data stream, ``SimpleTrainer.reset_data_loader(builder)`` (public
  since June 2022, in 0.7.2 and main); on v0.6, which lacks it, ``data_loader`` and
  ``_data_loader_iter`` are replaced directly (that version's eager iterator attribute).
* ``detectron2.engine.defaults.create_ddp_model``, looked up as a module global by
  ``DefaultTrainer.__init__`` (all three versions): patched while the trainer is built so that CPU
  models get DDP without ``device_ids`` (PyTorch rejects ``device_ids`` for CPU modules and
  Detectron2 always passes ``[local_rank]``).
* ``DenseDetector._ema_update(name, value, initial_value, momentum)`` (all three versions),
  through which ``RetinaNet.losses`` updates its ``"loss_normalizer"``:
  :class:`EMAUpdateHook` turns it into a public, overridable ``ema_update``.
"""
import contextlib

from detectron2.engine import DefaultTrainer, defaults

__all__ = ["inner_trainer", "restart_data_loader", "ddp_without_device_ids_on_cpu", "EMAUpdateHook"]


def inner_trainer(trainer: DefaultTrainer):
    """The ``SimpleTrainer`` (or ``AMPTrainer``) that runs ``trainer``'s loop
    (``DefaultTrainer._trainer``)."""
    return trainer._trainer


def restart_data_loader(trainer: DefaultTrainer, build_loader) -> None:
    """Make ``trainer``'s next iteration read from ``build_loader()`` (a new data loader)."""
    loop = inner_trainer(trainer)
    if hasattr(loop, "reset_data_loader"):  # Detectron2 after v0.6 (public method)
        loop.reset_data_loader(build_loader)
    else:  # v0.6: SimpleTrainer builds its iterator eagerly in __init__
        loop.data_loader = build_loader()
        loop._data_loader_iter = iter(loop.data_loader)


@contextlib.contextmanager
def ddp_without_device_ids_on_cpu():
    """While active (around ``DefaultTrainer.__init__``), Detectron2's ``create_ddp_model``
    wraps CPU models in DDP without ``device_ids``; CUDA models are wrapped as before."""
    original = defaults.create_ddp_model

    def create_ddp_model(model, **kwargs):
        if next(model.parameters()).device.type == "cpu":
            kwargs.setdefault("device_ids", None)
        return original(model, **kwargs)

    defaults.create_ddp_model = create_ddp_model
    try:
        yield
    finally:
        defaults.create_ddp_model = original


class EMAUpdateHook:
    """Mixin for a Detectron2 ``DenseDetector`` subclass (listed before it in the bases):
    ``ema_update(name, value, initial_value, momentum) -> float`` is called for every EMA the
    detector keeps (RetinaNet: ``"loss_normalizer"``); override it, and call
    ``super().ema_update(...)`` for Detectron2's behaviour."""

    def ema_update(self, name: str, value: float, initial_value: float, momentum: float = 0.9) -> float:
        return super()._ema_update(name, value, initial_value, momentum)

    def _ema_update(self, name, value, initial_value, momentum=0.9):
        return self.ema_update(name, value, initial_value, momentum)
