"""SASA-ResNet: Detectron2's ResNet with local self-attention as the spatial layer.

Paper: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019,
Section 3.1 and 4.1. Every bottleneck block of the chosen stages keeps its 1x1 convolutions and
its shortcut; only the 3x3 spatial convolution becomes a :class:`LocalSelfAttention2d` (``k = 7``,
8 heads, relative positions), followed by the block's norm. A strided block puts its stride in
the attention's 2x2 average pooling. Depth scaling removes layers from every group: ResNet-26 and
ResNet-38 remove 2 and 1 blocks per stage from ResNet-50's ``[3, 4, 6, 3]``. The stem is the
ResNet conv stem or the spatially-aware attention stem (Section 3.2).

The stages are Detectron2's (:func:`~aadet.modeling.backbone.resnet_stages.build_resnet`) with
:class:`SASABottleneckBlock` (the shared attention bottleneck block with SASA's layer) in
``MODEL.SASA.STAGES``. Registered as ``build_sasa_resnet_backbone`` (bottom-up; also callable
with plain arguments) and ``build_retinanet_sasa_resnet_fpn_backbone``.

Config keys: ``MODEL.SASA.*`` (``STAGES``, ``STEM``, ``STEM_*``, and the layer keys read by
:func:`~aadet.modeling.attention_layers.sasa_layer_kwargs`) and Detectron2's
``MODEL.RESNETS.*`` (``DEPTH``, ``NORM``, ``OUT_FEATURES``, ``STEM_OUT_CHANNELS``,
``RES2_OUT_CHANNELS``, ``WIDTH_PER_GROUP``, ``NUM_GROUPS``, ``STRIDE_IN_1X1``,
``RES5_DILATION``, ``DEFORM_ON_PER_STAGE``) and ``MODEL.BACKBONE.FREEZE_AT``.
"""
from typing import Any, Dict, Sequence

from detectron2.config import configurable
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN
from detectron2.modeling.backbone.resnet import ResNet

from ...config import config_error
from ...layers.attention_stem import SpatiallyAwareAttentionStem
from ...layers.local_attention import LocalSelfAttention2d
from ...layers.functional.checks import check_one_of
from ..attention_layers import local_attention_for_conv, sasa_layer_kwargs
from .fpn import build_retinanet_fpn
from .resnet_stages import (
    AttentionBottleneckBlock,
    attention_resnet_from_config,
    basic_stem,
    build_attention_resnet,
)

__all__ = [
    "SASABottleneckBlock",
    "SASA_STEMS",
    "build_sasa_resnet_backbone",
    "build_retinanet_sasa_resnet_fpn_backbone",
]

#: ``MODEL.SASA.STEM``: ResNet's conv stem, or the spatially-aware attention stem.
SASA_STEMS = ("conv", "attention")


class SASABottleneckBlock(AttentionBottleneckBlock):
    """The attention bottleneck block (:class:`~.resnet_stages.AttentionBottleneckBlock`) with
    SASA's local self-attention: ``conv2`` is a :class:`LocalSelfAttention2d` + norm
    (:func:`~aadet.modeling.attention_layers.local_attention_for_conv`), its stride in the
    attention's average pooling.

    ``attention`` (in addition to ``BottleneckBlock``'s arguments): options of the attention
    layer (``kernel_size``, ``num_heads``, ``positional_encoding``, ``block_size``, ``impl``, ...;
    see :func:`~aadet.modeling.attention_layers.sasa_layer_kwargs`), the layer's defaults for
    those not given.
    """

    attention_layer = staticmethod(local_attention_for_conv)


def _build_stem(cfg, input_shape: ShapeSpec):
    """``MODEL.SASA.STEM``: ResNet's conv stem, or the spatially-aware attention stem."""
    sa = cfg.MODEL.SASA
    check_one_of(sa.STEM, SASA_STEMS, "MODEL.SASA.STEM", config_error)
    if sa.STEM == "conv":
        return basic_stem(cfg, input_shape)
    norm = cfg.MODEL.RESNETS.NORM
    out_channels = cfg.MODEL.RESNETS.STEM_OUT_CHANNELS
    if out_channels % sa.STEM_NUM_HEADS != 0:
        raise config_error(
            "MODEL.SASA.STEM_NUM_HEADS",
            f"a divisor of MODEL.RESNETS.STEM_OUT_CHANNELS={out_channels}",
            sa.STEM_NUM_HEADS,
        )
    return SpatiallyAwareAttentionStem(
        input_shape.channels,
        out_channels,
        block_size=sa.STEM_BLOCK_SIZE,
        num_heads=sa.STEM_NUM_HEADS,
        num_mixtures=sa.STEM_MIXTURES,
        # The stem has relative logits or none; "sine2d" (a trunk ablation) keeps them relative.
        positional_encoding="none" if sa.POSITIONAL_ENCODING == "none" else "relative",
        norm=norm,  # a name of Detectron2's get_norm, or "" (none)
        impl=sa.STEM_IMPL,
    )


def _sasa_resnet_from_config(cfg, input_shape: ShapeSpec) -> Dict[str, Any]:
    """``MODEL.SASA.*`` and ``MODEL.RESNETS.*`` -> :func:`build_sasa_resnet_backbone`'s
    arguments, checking the keys this builder owns (stage names, the stem)."""
    stem = _build_stem(cfg, input_shape)
    return attention_resnet_from_config(cfg, "MODEL.SASA", stem, sasa_layer_kwargs(cfg))


@BACKBONE_REGISTRY.register()
@configurable(from_config=_sasa_resnet_from_config)
def build_sasa_resnet_backbone(
    *, stem, attention_stages: Sequence[str], attention: Dict[str, Any], **resnet
) -> ResNet:
    """SASA-ResNet-{26, 38, 50, 101} (see the module docstring for the keys).

    Stages in ``attention_stages`` use :class:`SASABottleneckBlock`, the others Detectron2's
    ``BottleneckBlock`` (or ``DeformBottleneckBlock`` where ``deform_on_per_stage``), so the
    paper's Table 3 mixtures are configs.

    Args:
        stem: the stem module (``MODEL.SASA.STEM``: Detectron2's ``BasicStem`` or
            :class:`~aadet.layers.SpatiallyAwareAttentionStem`).
        attention_stages: stages whose spatial convolutions are local attention.
        attention: :class:`~aadet.layers.LocalSelfAttention2d` options (``kernel_size``,
            ``num_heads``, ``positional_encoding``, ``block_size``, ``impl``,
            ``recompute_attention``; the layer's defaults for those not given).
        resnet: :func:`~.resnet_stages.build_resnet`'s other arguments.

    Raises:
        ConfigValueError: naming the key, for settings an attention stage cannot take.
        ValueError: naming the argument, for ``attention_stages`` not in ``res2`` .. ``res5``
            (from the config, a ConfigValueError naming ``MODEL.SASA.STAGES``).
    """
    return build_attention_resnet(
        stem,
        attention_stages=attention_stages,
        attention=attention,
        block_class=SASABottleneckBlock,
        layer_class=LocalSelfAttention2d,
        section="MODEL.SASA",
        builder="build_sasa_resnet_backbone",
        **resnet,
    )


@BACKBONE_REGISTRY.register()
def build_retinanet_sasa_resnet_fpn_backbone(cfg, input_shape: ShapeSpec) -> FPN:
    """RetinaNet FPN (:func:`~.fpn.build_retinanet_fpn`) over :func:`build_sasa_resnet_backbone`."""
    return build_retinanet_fpn(cfg, build_sasa_resnet_backbone(cfg, input_shape))
