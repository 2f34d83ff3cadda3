"""Checkpoints that are written atomically and loaded strictly.

Detectron2's checkpointer writes ``model_XXXX.pth`` in place and only *warns* when a checkpoint's
keys or shapes do not match the model (keeping random weights for them). For days-long runs and for
evaluation that is not good enough:

* :class:`AADetCheckpointer` writes each file to a temporary name in the same folder, flushes and
  fsyncs it, and renames it into place (``os.replace`` is atomic), then updates ``last_checkpoint``
  the same way: a crash at any moment leaves the previous complete checkpoint as "last".
* With ``strict=True`` a checkpoint whose parameters do not match the model (missing, unexpected or
  differently shaped keys) raises :class:`CheckpointMismatchError` listing every mismatch.
* With ``ema_weights=True`` (inference with ``MODEL_EMA.ENABLED``) the model gets the checkpoint's
  moving-average weights (``checkpoint["model_ema"]``, :class:`aadet.engine.ema.ModelEMA`) instead
  of ``checkpoint["model"]``; a checkpoint without them is an error.
"""
import os
import tempfile

import torch
from detectron2.checkpoint import DetectionCheckpointer

from ..utils.d2compat import LoadModelHook

__all__ = ["AADetCheckpointer", "CheckpointMismatchError", "atomic_torch_save"]


class CheckpointMismatchError(RuntimeError):
    """The checkpoint's parameters do not match the model built from the config."""


def _atomic_write(path: str, write_fn, mode: str = "wb"):
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_torch_save(obj, path: str):
    """``torch.save`` that never leaves a partial file at ``path``."""
    _atomic_write(path, lambda f: torch.save(obj, f))


class AADetCheckpointer(LoadModelHook, DetectionCheckpointer):
    """DetectionCheckpointer with atomic saves and an optional strict load (see module doc)."""

    def __init__(
        self, model, save_dir: str = "", *, strict: bool = False, ema_weights: bool = False, **kwargs
    ):
        super().__init__(model, save_dir, **kwargs)
        self.strict = strict
        self.ema_weights = ema_weights

    def _is_local(self) -> bool:
        return bool(self.save_dir) and "://" not in self.save_dir

    def save(self, name: str, **kwargs) -> None:
        if not self._is_local():
            return super().save(name, **kwargs)
        if not self.save_dir or not self.save_to_disk:
            return
        data = {"model": self.model.state_dict()}
        for key, obj in self.checkpointables.items():
            data[key] = obj.state_dict()
        data.update(kwargs)
        basename = f"{name}.pth"
        save_file = os.path.join(self.save_dir, basename)
        self.logger.info(f"Saving checkpoint to {save_file}")
        atomic_torch_save(data, save_file)
        self.tag_last_checkpoint(basename)

    def tag_last_checkpoint(self, last_filename_basename: str) -> None:
        if not self._is_local():
            return super().tag_last_checkpoint(last_filename_basename)
        path = os.path.join(self.save_dir, "last_checkpoint")
        _atomic_write(path, lambda f: f.write(last_filename_basename), mode="w")

    def load_model_state(self, checkpoint):
        if self.ema_weights:
            if "model_ema" not in checkpoint:
                raise CheckpointMismatchError(
                    "MODEL_EMA.ENABLED is True but the checkpoint has no moving-average weights "
                    "(it was trained without MODEL_EMA.ENABLED); set MODEL_EMA.ENABLED False to use "
                    "its trained weights."
                )
            ema_state = checkpoint["model_ema"]["state"]
            checkpoint = {k: v for k, v in checkpoint.items() if k != "model_ema"}
            checkpoint["model"] = dict(ema_state)
        incompatible = super().load_model_state(checkpoint)
        if self.strict and incompatible is not None:
            problems = [
                f"  shape mismatch: {k}: checkpoint {tuple(a)} vs model {tuple(b)}"
                for k, a, b in incompatible.incorrect_shapes
            ]
            problems += [f"  missing in checkpoint: {k}" for k in incompatible.missing_keys]
            problems += [f"  not in model: {k}" for k in incompatible.unexpected_keys]
            if problems:
                raise CheckpointMismatchError(
                    f"The checkpoint does not match the model built from the config "
                    f"({len(problems)} problems):\n" + "\n".join(problems[:50])
                    + ("\n  ..." if len(problems) > 50 else "")
                    + "\nCheck --config-file / MODEL.* against the checkpoint. To start training "
                    "from partially matching weights on purpose, pass --allow-mismatched-weights."
                )
        return incompatible
