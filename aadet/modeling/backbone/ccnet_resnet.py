"""CCNet's ResNet: Detectron2's ResNet with one recurrent criss-cross attention module (RCCA).

Paper: Huang et al., "CCNet: Criss-Cross Attention for Semantic Segmentation", ICCV 2019 / TPAMI
2020. For COCO the paper adds its module to the backbone as the non-local network adds its block:
one module before the last block of res4. Here :class:`CrissCrossBlock` (a
:class:`~aadet.layers.RecurrentCrissCrossAttention` with as many output channels as input ones,
as a block of the stage) stands before the last block of ``MODEL.CCNET.STAGE``; every other block
is Detectron2's, the stem its conv stem. The module's convs take the ResNet's norm
(``MODEL.RESNETS.NORM``). Registered as ``build_ccnet_resnet_backbone`` (bottom-up; also callable
with plain arguments) and ``build_retinanet_ccnet_resnet_fpn_backbone``.

The module is a block of the stage's ``nn.Sequential``: in ``res4`` of a ResNet-50 (6 blocks) the
module is ``res4.5`` and the last block ``res4.6``; ``MODEL.BACKBONE.FREEZE_AT`` freezes it with
its stage.

Config keys: ``MODEL.CCNET.*`` (``STAGE``, ``RECURRENCE``, ``NUM_HEADS``, ``REDUCTION``,
``INTER_CHANNELS``, ``IMPL``), Detectron2's ``MODEL.RESNETS.*`` and ``MODEL.BACKBONE.FREEZE_AT``
(:func:`~.resnet_stages.resnet_from_config`).
"""
from typing import Any, Dict, Optional

import torch
from detectron2.config import configurable
from detectron2.layers import CNNBlockBase, ShapeSpec
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN
from detectron2.modeling.backbone.resnet import ResNet
from torch import nn

from ...config import config_error
from ...layers.criss_cross import RecurrentCrissCrossAttention, check_criss_cross_heads
from ...layers.functional.checks import argument_error, check_int, check_one_of
from .fpn import build_retinanet_fpn
from .resnet_stages import STAGE_NAMES, basic_stem, build_resnet, resnet_from_config

__all__ = [
    "CrissCrossBlock",
    "insert_criss_cross",
    "criss_cross_options",
    "build_ccnet_resnet_backbone",
    "build_retinanet_ccnet_resnet_fpn_backbone",
]


class CrissCrossBlock(CNNBlockBase):
    """CCNet's RCCA module as a block of a ResNet stage: ``[B, C, H, W]`` -> ``[B, C, H, W]``,
    stride 1 (``freeze()`` from ``CNNBlockBase``).

    Args:
        channels: ``C``, the stage's channels.
        norm: the norm of the module's convs (a Detectron2 norm name, e.g. the ResNet's).
        criss_cross: :class:`~aadet.layers.RecurrentCrissCrossAttention`'s options
            (``inter_channels``, ``recurrence``, ``num_heads``, ``reduction``, ``impl``).
    """

    def __init__(self, channels: int, *, norm, **criss_cross):
        super().__init__(channels, channels, 1)
        self.rcca = RecurrentCrissCrossAttention(channels, channels, norm=norm, **criss_cross)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rcca(x)


def insert_criss_cross(resnet: ResNet, stage: str, *, norm, freeze_at: int = 0, **criss_cross) -> CrissCrossBlock:
    """Put a :class:`CrissCrossBlock` before the last block of ``resnet``'s ``stage`` (its blocks'
    width), in place, and return it. ``freeze_at``: the ResNet's (``MODEL.BACKBONE.FREEZE_AT``):
    the stages up to it are frozen again, the new block with them."""
    check_one_of(stage, tuple(resnet.stage_names), "stage")
    index = resnet.stage_names.index(stage)
    blocks = list(resnet.stages[index].children())
    block = CrissCrossBlock(blocks[-1].in_channels, norm=norm, **criss_cross)
    sequential = nn.Sequential(*blocks[:-1], block, blocks[-1])
    setattr(resnet, stage, sequential)  # replaces the registered submodule of the same name
    resnet.stages[index] = sequential
    resnet.freeze(freeze_at)
    return block


def criss_cross_options(cfg) -> Dict[str, Any]:
    """``MODEL.CCNET.*`` -> :class:`~aadet.layers.RecurrentCrissCrossAttention`'s options, with the
    stage's width checked against ``NUM_HEADS``, ``REDUCTION`` and ``INTER_CHANNELS``, naming them."""
    cc, r = cfg.MODEL.CCNET, cfg.MODEL.RESNETS
    check_one_of(cc.STAGE, STAGE_NAMES, "MODEL.CCNET.STAGE", config_error)
    channels = r.RES2_OUT_CHANNELS * 2 ** STAGE_NAMES.index(cc.STAGE)
    check_int(cc.INTER_CHANNELS, "MODEL.CCNET.INTER_CHANNELS", 0, config_error, " (0 = the stage's channels // 4)")
    inter = cc.INTER_CHANNELS or channels // 4
    if inter < 1:
        raise config_error("MODEL.CCNET.INTER_CHANNELS", f"an integer >= 1 ({cc.STAGE} has {channels} channels, "
                           "// 4 = 0)", cc.INTER_CHANNELS)
    check_criss_cross_heads(cc.NUM_HEADS, cc.REDUCTION, inter, f"the channels the module attends in {cc.STAGE}",
                            names=("MODEL.CCNET.NUM_HEADS", "MODEL.CCNET.REDUCTION"), error=config_error)
    return dict(inter_channels=cc.INTER_CHANNELS or None, recurrence=cc.RECURRENCE, num_heads=cc.NUM_HEADS,
                reduction=cc.REDUCTION, impl=cc.IMPL)


def _ccnet_resnet_from_config(cfg, input_shape: ShapeSpec) -> Dict[str, Any]:
    return dict(stem=basic_stem(cfg, input_shape), ccnet_stage=cfg.MODEL.CCNET.STAGE,
                criss_cross=criss_cross_options(cfg), **resnet_from_config(cfg))


@BACKBONE_REGISTRY.register()
@configurable(from_config=_ccnet_resnet_from_config)
def build_ccnet_resnet_backbone(
    *, stem, ccnet_stage: str = "res4", criss_cross: Optional[Dict[str, Any]] = None, **resnet
) -> ResNet:
    """Detectron2's ResNet (:func:`~.resnet_stages.build_resnet`) with a :class:`CrissCrossBlock`
    before the last block of ``ccnet_stage`` (see the module docstring for the keys).

    Args:
        stem: the stem module (Detectron2's ``BasicStem`` from the config).
        ccnet_stage: the stage, one of ``res2`` .. ``res5`` (paper: ``res4``).
        criss_cross: :class:`~aadet.layers.RecurrentCrissCrossAttention`'s options (its defaults
            for those not given); its norm is the ResNet's ``norm``.
        resnet: :func:`~.resnet_stages.build_resnet`'s other arguments.
    """
    check_one_of(ccnet_stage, STAGE_NAMES, "ccnet_stage", argument_error)
    resnet_model = build_resnet(stem, builder="build_ccnet_resnet_backbone", **resnet)
    insert_criss_cross(resnet_model, ccnet_stage, norm=resnet["norm"], freeze_at=resnet["freeze_at"],
                       **(criss_cross or {}))
    return resnet_model


@BACKBONE_REGISTRY.register()
def build_retinanet_ccnet_resnet_fpn_backbone(cfg, input_shape: ShapeSpec) -> FPN:
    """RetinaNet FPN (:func:`~.fpn.build_retinanet_fpn`) over :func:`build_ccnet_resnet_backbone`."""
    return build_retinanet_fpn(cfg, build_ccnet_resnet_backbone(cfg, input_shape))
