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

from ...config import config_error
from ...layers.halo_attention import HaloSelfAttention2d
from ..attention_layers import halo_attention_for_conv, halo_layer_kwargs
from .fpn import build_retinanet_fpn
from .resnet_stages import (
    AttentionBottleneckBlock,
    ResNetStage,
    attention_resnet_from_config,
    basic_stem,
    build_attention_resnet,
)

__all__ = [
    "HaloBottleneckBlock",
    "build_halo_resnet_backbone",
    "build_retinanet_halo_resnet_fpn_backbone",
]


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


def _check_block_size(stage: ResNetStage, where: str, options: Dict[str, Any]) -> None:
    """HaloNet's own rule for an attention stage: a block size that the stage's stride divides."""
    if options["block_size"] % stage.first_stride:
        raise config_error(
            "MODEL.HALO.BLOCK_SIZE",
            f"a multiple of {stage.first_stride} {where}: {stage.name} downsamples by "
            f"{stage.first_stride} in its attention, each block holding BLOCK_SIZE / stride queries "
            "a side",
            options["block_size"],
        )


def _halo_resnet_from_config(cfg, input_shape: ShapeSpec) -> Dict[str, Any]:
    """``MODEL.HALO.*`` and ``MODEL.RESNETS.*`` -> :func:`build_halo_resnet_backbone`'s
    arguments, checking the key this builder owns (the stage names)."""
    stem = basic_stem(cfg, input_shape)
    return attention_resnet_from_config(cfg, "MODEL.HALO", stem, halo_layer_kwargs(cfg))


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
        ValueError: naming the argument, for ``attention_stages`` not in ``res2`` .. ``res5``
            (from the config, a ConfigValueError naming ``MODEL.HALO.STAGES``).
    """
    return build_attention_resnet(
        stem,
        attention_stages=attention_stages,
        attention=attention,
        block_class=HaloBottleneckBlock,
        layer_class=HaloSelfAttention2d,
        section="MODEL.HALO",
        builder="build_halo_resnet_backbone",
        check_stage=_check_block_size,
        **resnet,
    )


@BACKBONE_REGISTRY.register()
def build_retinanet_halo_resnet_fpn_backbone(cfg, input_shape: ShapeSpec) -> FPN:
    """RetinaNet FPN (:func:`~.fpn.build_retinanet_fpn`) over :func:`build_halo_resnet_backbone`."""
    return build_retinanet_fpn(cfg, build_halo_resnet_backbone(cfg, input_shape))
