"""RetinaNet whose head comes from a registry (``MODEL.RETINANET.HEAD_NAME``).

Detectron2's ``RetinaNet.from_config`` hard-codes ``RetinaNetHead``; SASA's all-attention model
needs an attentional head, so :class:`AADetRetinaNet` builds the head named by the config from
``RETINANET_HEAD_REGISTRY`` and is otherwise Detectron2's RetinaNet unchanged. It also checks the
losses: a NaN or infinite loss stops training with the iteration and the loss's name.
"""
import math

import torch
from detectron2.modeling import META_ARCH_REGISTRY
from detectron2.modeling.meta_arch.retinanet import RetinaNet, RetinaNetHead
from detectron2.utils.events import get_event_storage
from detectron2.utils.registry import Registry

__all__ = ["RETINANET_HEAD_REGISTRY", "AADetRetinaNet", "build_retinanet_head", "NonFiniteLossError"]

RETINANET_HEAD_REGISTRY = Registry("RETINANET_HEAD")
RETINANET_HEAD_REGISTRY.__doc__ = """
RetinaNet heads, called as ``cls(cfg, feature_shapes)`` (``@configurable`` classes), returning
per-level ``(logits, bbox_reg)`` lists like Detectron2's ``RetinaNetHead``.
"""
RETINANET_HEAD_REGISTRY.register(RetinaNetHead)


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite."""


def build_retinanet_head(cfg, feature_shapes):
    return RETINANET_HEAD_REGISTRY.get(cfg.MODEL.RETINANET.HEAD_NAME)(cfg, feature_shapes)


@META_ARCH_REGISTRY.register()
class AADetRetinaNet(RetinaNet):
    """Detectron2's RetinaNet with a registry-selected head and a finite-loss check."""

    def __init__(self, *, stop_on_nonfinite_loss: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.stop_on_nonfinite_loss = stop_on_nonfinite_loss

    @classmethod
    def from_config(cls, cfg):
        ret = super().from_config(cfg)
        shapes = ret["backbone"].output_shape()
        ret["head"] = build_retinanet_head(cfg, [shapes[f] for f in cfg.MODEL.RETINANET.IN_FEATURES])
        ret["stop_on_nonfinite_loss"] = cfg.SOLVER.STOP_ON_NONFINITE_LOSS
        return ret

    def forward_training(self, images, features, predictions, gt_instances):
        losses = super().forward_training(images, features, predictions, gt_instances)
        if self.stop_on_nonfinite_loss:
            bad = {k: float(v) for k, v in losses.items() if not torch.isfinite(v).all()}
            if bad:
                try:
                    it = get_event_storage().iter
                except AssertionError:  # called outside a trainer
                    it = "unknown"
                raise NonFiniteLossError(
                    f"Non-finite loss at iteration {it}: "
                    + ", ".join(f"{k}={'nan' if math.isnan(v) else v}" for k, v in bad.items())
                    + ". Lower SOLVER.BASE_LR, lengthen SOLVER.WARMUP_ITERS, or check the data "
                    "(tools/check_dataset.py). Set SOLVER.STOP_ON_NONFINITE_LOSS=False to go on."
                )
        return losses
