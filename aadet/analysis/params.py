"""Parameter counts of a detector, split into bottom-up network, FPN and head."""

from typing import Dict

from torch import nn

__all__ = ["count_parameters", "parameter_breakdown"]


def count_parameters(module: nn.Module) -> int:
    """Number of parameters (trainable or not; buffers such as BN statistics excluded)."""
    return sum(p.numel() for p in module.parameters())


def parameter_breakdown(model: nn.Module) -> Dict[str, int]:
    """``{"backbone", "fpn", "head", "other", "total"}`` parameters of a detector.

    ``backbone`` is the bottom-up network (``model.backbone.bottom_up``: the ResNet), ``fpn`` the
    rest of ``model.backbone`` (laterals, outputs, P6/P7), ``head`` ``model.head``, ``other``
    whatever the model holds elsewhere (0 for RetinaNet). A backbone without ``bottom_up`` (no
    FPN) counts entirely as ``backbone``.
    """
    total = count_parameters(model)
    backbone_all = count_parameters(model.backbone) if hasattr(model, "backbone") else 0
    bottom_up = getattr(getattr(model, "backbone", None), "bottom_up", None)
    backbone = count_parameters(bottom_up) if bottom_up is not None else backbone_all
    head = count_parameters(model.head) if hasattr(model, "head") else 0
    return {
        "backbone": backbone,
        "fpn": backbone_all - backbone,
        "head": head,
        "other": total - backbone_all - head,
        "total": total,
    }
