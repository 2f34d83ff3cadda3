"""RetinaNet whose head comes from a registry (``MODEL.RETINANET.HEAD_NAME``).

Detectron2's ``RetinaNet.from_config`` hard-codes ``RetinaNetHead``; SASA's all-attention model
needs an attentional head, so :class:`AADetRetinaNet` builds the head named by the config from
``RETINANET_HEAD_REGISTRY`` and is otherwise Detectron2's RetinaNet unchanged.
"""
from detectron2.modeling import META_ARCH_REGISTRY
from detectron2.modeling.meta_arch.retinanet import RetinaNet, RetinaNetHead
from detectron2.utils.registry import Registry

__all__ = ["RETINANET_HEAD_REGISTRY", "AADetRetinaNet", "build_retinanet_head"]

RETINANET_HEAD_REGISTRY = Registry("RETINANET_HEAD")
RETINANET_HEAD_REGISTRY.__doc__ = """
RetinaNet heads, called as ``cls(cfg, feature_shapes)`` (``@configurable`` classes), returning
per-level ``(logits, bbox_reg)`` lists like Detectron2's ``RetinaNetHead``.
"""
RETINANET_HEAD_REGISTRY.register(RetinaNetHead)


def build_retinanet_head(cfg, feature_shapes):
    """The head named by ``MODEL.RETINANET.HEAD_NAME``, for the given input feature shapes."""
    return RETINANET_HEAD_REGISTRY.get(cfg.MODEL.RETINANET.HEAD_NAME)(cfg, feature_shapes)


@META_ARCH_REGISTRY.register()
class AADetRetinaNet(RetinaNet):
    """Detectron2's RetinaNet with the head chosen by ``MODEL.RETINANET.HEAD_NAME``."""

    @classmethod
    def from_config(cls, cfg):
        ret = super().from_config(cfg)  # builds Detectron2's head, replaced below if another is named
        if cfg.MODEL.RETINANET.HEAD_NAME != "RetinaNetHead":
            shapes = ret["backbone"].output_shape()
            ret["head"] = build_retinanet_head(
                cfg, [shapes[f] for f in cfg.MODEL.RETINANET.IN_FEATURES]
            )
        return ret
