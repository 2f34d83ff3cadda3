"""HaloNet-style ResNet: Detectron2's ResNet with blocked local self-attention as the spatial layer.

Paper: Vaswani et al., "Scaling Local Self-Attention for Parameter Efficient Visual Backbones"
(HaloNet), CVPR 2021. Every bottleneck block of the chosen stages keeps its 1x1
convolutions and its shortcut; the 3x3 spatial convolution becomes a
:class:`~aadet.layers.HaloSelfAttention2d` (``b = 8``, ``h = 3``, 8 heads, relative positions),
followed by the block's norm. A strided block downsamples by attention (queries on the strided
grid, keys and values at full resolution with the halo), HaloNet's "attention downsampling",
where SASA's blocks pool. The stem is ResNet's conv stem, as HaloNet's.

The stages are Detectron2's (:func:`~aadet.modeling.backbone.resnet_stages.build_resnet`, the one
stage builder) with :class:`HaloBottleneckBlock` in ``MODEL.HALO.STAGES``: the SASA-ResNet with
another attention layer in the same block class, at the same placement. Registered as
``build_halo_resnet_backbone`` (bottom-up; also callable with plain arguments) and
``build_retinanet_halo_resnet_fpn_backbone``.

Config keys: ``MODEL.HALO.*`` (``STAGES`` and the layer keys read by
:func:`~aadet.modeling.attention_layers.halo_layer_kwargs`: ``BLOCK_SIZE``, ``HALO_SIZE``,
``NUM_HEADS``, ``POSITIONAL_ENCODING``, ``IMPL``), Detectron2's ``MODEL.RESNETS.*`` and
``MODEL.BACKBONE.FREEZE_AT`` (:func:`~.resnet_stages.resnet_from_config`).
"""
from typing import Any, Dict, Sequence

from detectron2.config import configurable
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN
from detectron2.modeling.backbone.resnet import ResNet

from ...config import config_error, layer_defaults
from ...layers.functional.checks import check_num_heads
from ...layers.halo_attention import HaloSelfAttention2d
from ..attention_layers import halo_attention_for_conv, halo_layer_kwargs
from .fpn import build_retinanet_fpn
from .resnet_stages import (
    BASIC_DEPTHS,
    RESNET_BLOCKS_PER_STAGE,
    AttentionBottleneckBlock,
    ResNetStage,
    basic_stem,
    build_resnet,
    check_stage_names,
    resnet_from_config,
)

__all__ = [
    "HALO_BLOCKS_PER_STAGE",
    "HaloBottleneckBlock",
    "build_halo_resnet_backbone",
    "build_retinanet_halo_resnet_fpn_backbone",
]

# Blocks per stage (res2..res5): the bottleneck depths of the shared table; halo blocks are
# bottlenecks.
HALO_BLOCKS_PER_STAGE = {
    depth: blocks for depth, blocks in RESNET_BLOCKS_PER_STAGE.items() if depth not in BASIC_DEPTHS
}


class HaloBottleneckBlock(AttentionBottleneckBlock):
    """The attention bottleneck block (:class:`~.resnet_stages.AttentionBottleneckBlock`) with
    HaloNet's blocked attention: ``conv2`` is a :class:`HaloSelfAttention2d` + norm
    (:func:`~aadet.modeling.attention_layers.halo_attention_for_conv`), the block's stride as
    attention downsampling.

    ``attention`` (in addition to ``BottleneckBlock``'s arguments): options of the attention
    layer (``block_size``, ``halo_size``, ``num_heads``, ``positional_encoding``, ``impl``), the
    layer's defaults for those not given.
    """

    attention_layer = staticmethod(halo_attention_for_conv)


def _check_attention_stage(stage: ResNetStage, attention_stages, attention: Dict[str, Any]):
    """Settings an attention stage cannot take (the conv stages may), named by their keys."""
    name, width = stage.name, stage.bottleneck_channels
    where = f"when {name} uses attention (MODEL.HALO.STAGES={tuple(attention_stages)})"
    if stage.num_groups != 1:
        raise config_error("MODEL.RESNETS.NUM_GROUPS", f"1 {where}", stage.num_groups)
    if stage.dilation != 1:
        raise config_error("MODEL.RESNETS.RES5_DILATION", f"1 {where}", stage.dilation)
    options = {**layer_defaults(HaloSelfAttention2d), **attention}
    if options["block_size"] % stage.first_stride:
        raise config_error(
            "MODEL.HALO.BLOCK_SIZE",
            f"a multiple of {stage.first_stride} {where}: {name} downsamples by {stage.first_stride} in its "
            "attention, each block holding BLOCK_SIZE / stride queries a side",
            options["block_size"],
        )
    check_num_heads(
        options["num_heads"],
        width,
        min_per_head=2 if options["positional_encoding"] == "relative" else 1,
        name="MODEL.HALO.NUM_HEADS",
        channels_name=f"the {name} bottleneck width {width} (MODEL.RESNETS.WIDTH_PER_GROUP * 2^stage)",
        per_head_reason=f"for relative positions in {name}, bottleneck width {width}",
        error=config_error,
    )


def _halo_resnet_from_config(cfg, input_shape: ShapeSpec) -> Dict[str, Any]:
    """``MODEL.HALO.*`` and ``MODEL.RESNETS.*`` -> :func:`build_halo_resnet_backbone`'s
    arguments, checking the key this builder owns (the stage names)."""
    return dict(
        stem=basic_stem(cfg, input_shape),
        attention_stages=check_stage_names("MODEL.HALO.STAGES", cfg.MODEL.HALO.STAGES),
        attention=halo_layer_kwargs(cfg),
        **resnet_from_config(cfg),
    )


@BACKBONE_REGISTRY.register()
@configurable(from_config=_halo_resnet_from_config)
def build_halo_resnet_backbone(
    *, stem, attention_stages: Sequence[str], attention: Dict[str, Any], **resnet
) -> ResNet:
    """HaloNet-style ResNet-{26, 38, 50, 101, 152} (see the module docstring for the keys).

    Stages in ``attention_stages`` use :class:`HaloBottleneckBlock`, the others Detectron2's
    ``BottleneckBlock`` (or ``DeformBottleneckBlock`` where ``deform_on_per_stage``).

    Args:
        stem: the stem module (Detectron2's ``BasicStem`` from the config).
        attention_stages: stages whose spatial convolutions are HaloNet attention.
        attention: :class:`~aadet.layers.HaloSelfAttention2d` options (``block_size``,
            ``halo_size``, ``num_heads``, ``positional_encoding``, ``impl``; the layer's
            defaults for those not given).
        resnet: :func:`~.resnet_stages.build_resnet`'s other arguments.

    Raises:
        ConfigValueError: naming the key, for settings an attention stage cannot take.
    """
    attention_stages = tuple(attention_stages)

    def block_for_stage(stage: ResNetStage):
        if stage.name not in attention_stages:
            return None
        _check_attention_stage(stage, attention_stages, attention)
        return HaloBottleneckBlock, attention

    return build_resnet(
        stem,
        block_for_stage=block_for_stage,
        blocks_per_stage=HALO_BLOCKS_PER_STAGE,
        attention_stages=attention_stages,
        builder="build_halo_resnet_backbone",
        **resnet,
    )


@BACKBONE_REGISTRY.register()
def build_retinanet_halo_resnet_fpn_backbone(cfg, input_shape: ShapeSpec) -> FPN:
    """RetinaNet FPN (:func:`~.fpn.build_retinanet_fpn`) over :func:`build_halo_resnet_backbone`."""
    return build_retinanet_fpn(cfg, build_halo_resnet_backbone(cfg, input_shape))
