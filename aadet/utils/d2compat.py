"""The only place aadet touches Detectron2 and fvcore internals (names without a public equivalent).

Everything else in aadet uses the public API of both. Each wrapper below names the internal it
relies on; ``tests/utils/test_d2compat.py`` has a test per internal that fails, naming it, if a
Detectron2 or fvcore version changes it. The module sits on the utils floor so that every floor
that needs an internal (``aadet.config``, ``aadet.modeling``, ``aadet.engine``) imports it from here.

Checked against (same names, same meaning):

* Detectron2 v0.6 (tag ``v0.6``, Nov 2021), the README's oldest supported version;
* the installed offline snapshot ``sal-detectron2==0.7.2`` (2024), with fvcore 0.1.5;
* upstream ``main`` at commit 02b5c4e (June 2026).

Internals used:

* ``DefaultTrainer._trainer`` (the ``SimpleTrainer``/``AMPTrainer`` running the loop; all three
  versions) and, to restart its data stream, ``SimpleTrainer.reset_data_loader(builder)`` (public
  since June 2022, in 0.7.2 and main); on v0.6, which lacks it, ``data_loader`` and
  ``_data_loader_iter`` are replaced directly (that version's eager iterator attribute):
  :func:`inner_trainer`, :func:`restart_data_loader` (:func:`restart_loop_data_loader` for a
  loop run without a ``DefaultTrainer``, as the LazyConfig trainer does).
* ``detectron2.engine.defaults.create_ddp_model``, looked up as a module global by
  ``DefaultTrainer.__init__`` (all three versions): patched while the trainer is built so that CPU
  models get DDP without ``device_ids`` (PyTorch rejects ``device_ids`` for CPU modules and
  Detectron2 always passes ``[local_rank]``): :func:`ddp_without_device_ids_on_cpu`,
  :func:`cpu_safe_ddp_model`.
* ``DefaultTrainer._last_eval_results``: what ``DefaultTrainer.train()`` returns and checks
  ``TEST.EXPECTED_RESULTS`` against, set by the evaluation of its own ``build_hooks`` (all three
  versions); a trainer that evaluates otherwise sets it with :func:`set_train_results`.
* ``DenseDetector._ema_update(name, value, initial_value, momentum)`` (all three versions),
  through which ``RetinaNet.losses`` updates its ``"loss_normalizer"``: :class:`EMAUpdateHook`
  turns it into a public, overridable ``ema_update``.
* ``DenseDetector._decode_multi_level_predictions(anchors, pred_scores, pred_deltas,
  score_thresh, topk_candidates, image_size)`` (all three versions): the per-image decoding
  (score threshold, top-k per level, boxes) of ``RetinaNet.inference_single_image`` before its
  NMS: :func:`decode_multi_level_predictions`.
* fvcore ``Checkpointer._load_model(checkpoint)``, which ``Checkpointer.load`` calls to put
  ``checkpoint["model"]`` into the model (``DetectionCheckpointer`` converts Caffe2 / pycls
  weights there first): :class:`LoadModelHook` turns it into a public ``load_model_state``.
* fvcore ``Registry._do_register(name, obj)``, the only way to file an object under a name other
  than its own: :class:`NamedRegistry`.
* ``detectron2.solver.build.maybe_add_gradient_clipping(cfg, optimizer)`` (all three versions):
  ``SOLVER.CLIP_GRADIENTS`` for any optimizer; not exported by ``detectron2.solver``, re-exported
  here.
* ``detectron2.utils.comm._LOCAL_PROCESS_GROUP`` (all three versions): the per-machine process
  group behind ``comm.get_local_rank()`` / ``get_local_size()``. Processes started without
  Detectron2's ``launch()`` (torchrun, SLURM) must create it: ``comm.create_local_process_group``
  (0.7.2 and main) does; v0.6's ``launch()`` set the internal itself, and so does the v0.6 branch
  of :func:`create_local_process_group`. :func:`release_local_process_group` drops Detectron2's
  reference (and the cache of ``create_local_process_group``) when the run ends.
"""
import contextlib

from detectron2.engine import DefaultTrainer, defaults
from detectron2.solver.build import maybe_add_gradient_clipping
from detectron2.utils.registry import Registry

__all__ = [
    "inner_trainer",
    "restart_data_loader",
    "restart_loop_data_loader",
    "cpu_safe_ddp_model",
    "ddp_without_device_ids_on_cpu",
    "set_train_results",
    "EMAUpdateHook",
    "decode_multi_level_predictions",
    "LoadModelHook",
    "NamedRegistry",
    "maybe_add_gradient_clipping",
    "create_local_process_group",
    "release_local_process_group",
]


# ----------------------------------------------------------------------------- DefaultTrainer
def inner_trainer(trainer: DefaultTrainer):
    """The ``SimpleTrainer`` (or ``AMPTrainer``) that runs ``trainer``'s loop
    (``DefaultTrainer._trainer``)."""
    return trainer._trainer


def restart_data_loader(trainer: DefaultTrainer, build_loader) -> None:
    """Make ``trainer``'s next iteration read from ``build_loader()`` (a new data loader)."""
    restart_loop_data_loader(inner_trainer(trainer), build_loader)


def restart_loop_data_loader(loop, build_loader) -> None:
    """Make the next iteration of ``loop`` (a ``SimpleTrainer`` or ``AMPTrainer``) read from
    ``build_loader()``."""
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


def cpu_safe_ddp_model(model, **kwargs):
    """Detectron2's ``create_ddp_model(model, **kwargs)`` (a plain model when not distributed),
    CPU models wrapped without ``device_ids`` (:func:`ddp_without_device_ids_on_cpu`)."""
    with ddp_without_device_ids_on_cpu():
        return defaults.create_ddp_model(model, **kwargs)


def set_train_results(trainer: DefaultTrainer, results) -> None:
    """Make ``trainer.train()`` return ``results`` (and check ``TEST.EXPECTED_RESULTS`` against
    them): ``DefaultTrainer._last_eval_results``, which only its own evaluation hook sets."""
    trainer._last_eval_results = results


# ----------------------------------------------------------------------------- DenseDetector
class EMAUpdateHook:
    """Mixin for a Detectron2 ``DenseDetector`` subclass (listed before it in the bases):
    ``ema_update(name, value, initial_value, momentum) -> float`` is called for every EMA the
    detector keeps (RetinaNet: ``"loss_normalizer"``); override it, and call
    ``super().ema_update(...)`` for Detectron2's behaviour."""

    def ema_update(self, name: str, value: float, initial_value: float, momentum: float = 0.9) -> float:
        return super()._ema_update(name, value, initial_value, momentum)

    def _ema_update(self, name, value, initial_value, momentum=0.9):
        return self.ema_update(name, value, initial_value, momentum)


def decode_multi_level_predictions(
    detector, anchors, pred_scores, pred_deltas, score_thresh: float, topk_candidates: int, image_size
):
    """One image's candidate detections of a ``DenseDetector`` before NMS
    (``DenseDetector._decode_multi_level_predictions``): per level, the scores above
    ``score_thresh``, at most ``topk_candidates`` of them, their anchors decoded into boxes.

    Args:
        anchors: ``List[Boxes]``, one per level; ``pred_scores`` ``[R_l, K]`` (after the
            sigmoid) and ``pred_deltas`` ``[R_l, 4]`` per level, of this image.
        image_size: ``(H, W)``.

    Returns:
        ``Instances`` with ``pred_boxes``, ``scores``, ``pred_classes``.
    """
    return detector._decode_multi_level_predictions(
        anchors, pred_scores, pred_deltas, score_thresh, topk_candidates, image_size
    )


# ----------------------------------------------------------------------------- fvcore
class LoadModelHook:
    """Mixin for an fvcore ``Checkpointer`` subclass (listed before it in the bases):
    ``load_model_state(checkpoint)`` is what ``Checkpointer.load`` calls to load
    ``checkpoint["model"]`` into the model; it returns the incompatible keys
    (``incorrect_shapes``, ``missing_keys``, ``unexpected_keys``). Override it, and call
    ``super().load_model_state(checkpoint)`` for the base checkpointer's behaviour."""

    def load_model_state(self, checkpoint):
        return super()._load_model(checkpoint)

    def _load_model(self, checkpoint):
        return self.load_model_state(checkpoint)


class NamedRegistry(Registry):
    """Detectron2's (fvcore's) ``Registry`` whose ``register("name")`` files an object under a
    given name (a config value), so the object itself can have a descriptive name;
    ``register()`` / ``register(obj)`` file it under its own name, as the base class does."""

    def register(self, obj=None):
        if isinstance(obj, str):
            name = obj

            def deco(func_or_class):
                self._do_register(name, func_or_class)
                return func_or_class

            return deco
        return super().register(obj)


# ----------------------------------------------------------------------------- comm
def create_local_process_group(num_workers_per_machine: int) -> None:
    """Create Detectron2's per-machine process group after ``torch.distributed`` is initialized
    (ranks ``m * num_workers_per_machine ... (m + 1) * num_workers_per_machine - 1`` are machine
    ``m``). Every process must call it (``new_group`` is collective)."""
    from detectron2.utils import comm

    if hasattr(comm, "create_local_process_group"):  # after v0.6
        comm.create_local_process_group(num_workers_per_machine)
        return
    import torch.distributed as dist  # v0.6: what its launch() did

    world, rank = comm.get_world_size(), comm.get_rank()
    if world % num_workers_per_machine:
        raise ValueError(
            f"world size {world} is not a multiple of {num_workers_per_machine} workers per machine"
        )
    assert comm._LOCAL_PROCESS_GROUP is None, "the local process group exists already"
    for m in range(world // num_workers_per_machine):
        ranks = list(range(m * num_workers_per_machine, (m + 1) * num_workers_per_machine))
        group = dist.new_group(ranks)
        if m == rank // num_workers_per_machine:
            comm._LOCAL_PROCESS_GROUP = group


def release_local_process_group() -> None:
    """Drop Detectron2's reference to the per-machine group (before ``destroy_process_group``), so
    that nothing keeps it alive into interpreter shutdown, and clear the cache of
    ``comm.create_local_process_group`` so that a later run in this process can create it again."""
    from detectron2.utils import comm

    comm._LOCAL_PROCESS_GROUP = None
    cache_clear = getattr(getattr(comm, "create_local_process_group", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
