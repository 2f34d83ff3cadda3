"""Exponential moving average (EMA) of a model's weights, for evaluation.

Not part of either paper (they evaluate the trained weights), so off by default
(``MODEL_EMA.ENABLED``). Evaluating an average of the last part of training instead of the last
weights is common in detection codebases (d2go, YOLO-style trainers) and smooths out the last
steps' gradient noise; after a step LR decay that noise is already small. Training itself is
unchanged: the EMA only reads the weights after each optimizer step.

After update ``t`` (1, 2, ...) every floating-point entry ``w`` of the model's ``state_dict`` --
parameters and normalization buffers -- moves its average ``a`` by::

    d_t = min(DECAY, (1 + t) / (10 + t))        # TensorFlow's ExponentialMovingAverage(num_updates)
    a  <- d_t * a + (1 - d_t) * w

The warm-up term keeps the first averages close to the current weights (d_1 = 0.18, d_90 = 0.91)
instead of anchored at the initialization; with DECAY 0.998 it stops mattering after ~5000
updates. Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) are copied.
"""
import contextlib
from typing import Dict, Optional

import torch
from torch import nn

from ..config import config_error
from ..layers.functional.checks import Interval, check_in
from ..utils.modules import unwrap_model

__all__ = ["DECAY_RANGE", "ModelEMA", "ema_decay", "build_model_ema"]

#: The EMA decay (``MODEL_EMA.DECAY``): 0 keeps a copy of the last weights; 1 would never move.
DECAY_RANGE = Interval(0.0, 1.0, low_closed=True)


def build_model_ema(cfg, model: nn.Module) -> Optional["ModelEMA"]:
    """``ModelEMA(model, MODEL_EMA.DECAY)`` when ``MODEL_EMA.ENABLED``, else None.

    Raises:
        ConfigValueError: ``MODEL_EMA.DECAY`` outside :data:`DECAY_RANGE`, enabled or not.
    """
    ema = cfg.MODEL_EMA
    check_in(ema.DECAY, DECAY_RANGE, "MODEL_EMA.DECAY", config_error)
    return ModelEMA(model, ema.DECAY) if ema.ENABLED else None


def ema_decay(decay: float, updates: int) -> float:
    """The decay of update number ``updates`` (>= 1): ``min(decay, (1 + t) / (10 + t))``."""
    return min(decay, (1.0 + updates) / (10.0 + updates))


class ModelEMA:
    """The moving average of ``model``'s ``state_dict``; a Detectron2 checkpointable.

    Args:
        model: the trained model (DDP-wrapped or not); the average starts at its current weights,
            on their devices.
        decay: the EMA decay, in :data:`DECAY_RANGE`; 0 keeps a copy of the last weights.
    """

    def __init__(self, model: nn.Module, decay: float):
        check_in(decay, DECAY_RANGE, "ModelEMA: decay")
        self.decay = float(decay)
        self.reset(model)

    def reset(self, model: nn.Module) -> None:
        """Restart the average at ``model``'s current weights (update count 0)."""
        self.updates = 0
        self.state: Dict[str, torch.Tensor] = {
            k: v.detach().clone() for k, v in unwrap_model(model).state_dict().items()
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current weights into the average (call after each optimizer step)."""
        self.updates += 1
        d = ema_decay(self.decay, self.updates)
        current = unwrap_model(model).state_dict()
        if current.keys() != self.state.keys():
            raise RuntimeError("ModelEMA.update: the model's state_dict keys changed since the EMA was built")
        for k, avg in self.state.items():
            w = current[k].detach()
            if avg.is_floating_point():
                avg.lerp_(w.to(avg.dtype), 1.0 - d)
            else:
                avg.copy_(w)

    @contextlib.contextmanager
    def applied_to(self, model: nn.Module):
        """Within the block ``model`` holds the averaged weights; its own are restored after."""
        inner = unwrap_model(model)
        own = {k: v.detach().clone() for k, v in inner.state_dict().items()}
        inner.load_state_dict(self.state)
        try:
            yield model
        finally:
            inner.load_state_dict(own)

    # Detectron2 Checkpointer protocol: saved as checkpoint["model_ema"], restored on --resume.
    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "state": self.state}

    def load_state_dict(self, sd: dict) -> None:
        if sd["state"].keys() != self.state.keys():
            missing = sorted(self.state.keys() - sd["state"].keys())[:5]
            extra = sorted(sd["state"].keys() - self.state.keys())[:5]
            raise RuntimeError(
                f"ModelEMA: the checkpoint's EMA does not match the model (missing {missing}, "
                f"unexpected {extra})"
            )
        for k, v in sd["state"].items():
            self.state[k].copy_(v)
        self.updates = int(sd["updates"])
