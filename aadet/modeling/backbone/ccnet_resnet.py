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

The block is residual by default (``MODEL.CCNET.RESIDUAL``, :class:`CrissCrossBlock`): it starts
as the identity, as the non-local block does.

Config keys: ``MODEL.CCNET.*`` (``STAGE``, ``RESIDUAL``, ``RECURRENCE``, ``NUM_HEADS``,
``REDUCTION``, ``INTER_CHANNELS``, ``BOTTLENECK_KERNEL_SIZE``, ``IMPL``), Detectron2's
``MODEL.RESNETS.*`` and
``MODEL.BACKBONE.FREEZE_AT`` (:func:`~.resnet_stages.resnet_from_config`).
"""
from typing import Any, Dict, Optional

import torch
from detectron2.config import configurable
from detectron2.layers import CNNBlockBase, ShapeSpec
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN
from detectron2.modeling.backbone.resnet import ResNet
from torch import nn

from ...config import config_error, layer_defaults
from ...layers.criss_cross import RecurrentCrissCrossAttention, check_criss_cross_heads, rcca_inter_channels
from ...layers.functional.checks import argument_error, check_bool, check_one_of
from .fpn import build_retinanet_fpn
from .resnet_stages import STAGE_NAMES, basic_stem, build_resnet, resnet_from_config

__all__ = [
    "CrissCrossBlock",
    "check_criss_cross_stage",
    "insert_criss_cross",
    "criss_cross_options",
    "build_ccnet_resnet_backbone",
    "build_retinanet_ccnet_resnet_fpn_backbone",
]


class CrissCrossBlock(CNNBlockBase):
    """CCNet's RCCA module as a block of a ResNet stage: ``[B, C, H, W]`` -> ``[B, C, H, W]``,
    stride 1 (``freeze()`` from ``CNNBlockBase``).

    ``residual=True``: ``relu(x + rcca(x))``, a residual block as the ResNet's: the module's
    bottleneck ends at its norm (no ReLU before the sum: ``bottleneck_relu=False``), whose scale
    is zeroed (the conv's weight where it has no norm), so that the block starts as the identity
    on the stage's non-negative features, as the non-local network inserts its block into a
    ResNet (Wang et al. 2018, Sec. 4.1: the last BN of ``W_z`` zero-initialised).
    ``residual=False``: ``rcca(x)``, the module's output replacing the features, as in CCNet's
    segmentation head.

    Args:
        channels: ``C``, the stage's channels.
        norm: the norm of the module's convs (a Detectron2 norm name, e.g. the ResNet's).
        residual: as above.
        criss_cross: :class:`~aadet.layers.RecurrentCrissCrossAttention`'s options
            (``inter_channels``, ``recurrence``, ``num_heads``, ``reduction``,
            ``bottleneck_kernel_size``, ``impl``).
    """

    def __init__(self, channels: int, *, norm, residual: bool = True, **criss_cross):
        super().__init__(channels, channels, 1)
        check_bool(residual, "residual")
        self.residual = residual
        self.rcca = RecurrentCrissCrossAttention(channels, channels, norm=norm, bottleneck_relu=not residual,
                                                 **criss_cross)
        if residual:
            last = getattr(self.rcca.bottleneck, "norm", None)
            if last is None or getattr(last, "weight", None) is None:
                last = self.rcca.bottleneck.conv
            nn.init.zeros_(last.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rcca(x)
        return torch.relu(x + out) if self.residual else out

    def extra_repr(self) -> str:
        return f"residual={self.residual}"


def check_criss_cross_stage(channels: int, stage: str, criss_cross: Dict[str, Any]) -> None:
    """``MODEL.CCNET.*`` against the width ``channels`` of the ``stage`` the module stands in,
    named by their keys: ``INTER_CHANNELS`` (0: ``channels // 4``) >= 1, and ``NUM_HEADS`` and
    ``REDUCTION`` fitting the width the module attends in (the layer's rules,
    :func:`~aadet.layers.criss_cross.rcca_inter_channels` and ``check_criss_cross_heads``).
    ``criss_cross``: the module's options, the layer's defaults for those not given."""
    options = {**layer_defaults(RecurrentCrissCrossAttention), **criss_cross}
    inter = rcca_inter_channels(channels, options["inter_channels"] or 0, name="MODEL.CCNET.INTER_CHANNELS",
                                default=0, error=config_error)
    check_criss_cross_heads(options["num_heads"], options["reduction"], inter,
                            f"the channels the module attends in {stage} ({channels} channels)",
                            names=("MODEL.CCNET.NUM_HEADS", "MODEL.CCNET.REDUCTION"), error=config_error)


def insert_criss_cross(
    resnet: ResNet, stage: str, *, norm, freeze_at: int = 0, residual: bool = True, **criss_cross
) -> CrissCrossBlock:
    """Put a :class:`CrissCrossBlock` before the last block of ``resnet``'s ``stage`` (its blocks'
    width), in place, and return it. ``freeze_at``: the ResNet's (``MODEL.BACKBONE.FREEZE_AT``):
    the stages up to it are frozen again, the new block with them.

    Raises:
        ConfigValueError: naming the ``MODEL.CCNET.*`` key, for options the stage's width cannot
            take (:func:`check_criss_cross_stage`).
    """
    check_one_of(stage, tuple(resnet.stage_names), "stage")
    index = resnet.stage_names.index(stage)
    blocks = list(resnet.stages[index].children())
    channels = blocks[-1].in_channels
    check_criss_cross_stage(channels, stage, criss_cross)
    block = CrissCrossBlock(channels, norm=norm, residual=residual, **criss_cross)
    sequential = nn.Sequential(*blocks[:-1], block, blocks[-1])
    setattr(resnet, stage, sequential)  # replaces the registered submodule of the same name
    resnet.stages[index] = sequential
    resnet.freeze(freeze_at)
    return block


def criss_cross_options(cfg) -> Dict[str, Any]:
    """``MODEL.CCNET.*`` -> :class:`CrissCrossBlock`'s options (``residual`` and
    :class:`~aadet.layers.RecurrentCrissCrossAttention`'s; ``INTER_CHANNELS`` 0 -> ``None``). The
    keys' own ranges were checked when the config loaded (``aadet.config.check_ccnet_config``),
    their fit to the stage's width when the module is built (:func:`check_criss_cross_stage`)."""
    cc = cfg.MODEL.CCNET
    return dict(residual=cc.RESIDUAL, inter_channels=cc.INTER_CHANNELS or None, recurrence=cc.RECURRENCE,
                num_heads=cc.NUM_HEADS, reduction=cc.REDUCTION, bottleneck_kernel_size=cc.BOTTLENECK_KERNEL_SIZE,
                impl=cc.IMPL)


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
        criss_cross: :class:`CrissCrossBlock`'s options (``residual``, and
            :class:`~aadet.layers.RecurrentCrissCrossAttention`'s, its defaults for those not
            given); its norm is the ResNet's ``norm``.
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
