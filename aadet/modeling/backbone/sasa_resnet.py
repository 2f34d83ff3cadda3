"""SASA-ResNet: Detectron2's ResNet with local self-attention as the spatial layer.

Paper: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019,
Section 3.1 and 4.1. Every bottleneck block of the chosen stages keeps its 1x1 convolutions and
its shortcut; only the 3x3 spatial convolution becomes a :class:`LocalSelfAttention2d` (``k = 7``,
8 heads, relative positions), followed by the block's norm. A strided block puts its stride in
the attention's 2x2 average pooling. Depth scaling removes layers from every group: ResNet-26 and
ResNet-38 remove 2 and 1 blocks per stage from ResNet-50's ``[3, 4, 6, 3]``. The stem is the
ResNet conv stem or the spatially-aware attention stem (Section 3.2).

Registered as ``build_sasa_resnet_backbone`` (bottom-up), and, through
:func:`~aadet.modeling.backbone.fpn.register_fpn_builders`, ``build_sasa_resnet_fpn_backbone``
and ``build_retinanet_sasa_resnet_fpn_backbone``.

Config keys: ``MODEL.SASA.*`` (``STAGES``, ``KERNEL_SIZE``, ``NUM_HEADS``,
``POSITIONAL_ENCODING``, ``BLOCK_SIZE``, ``IMPL``, ``STEM``, ``STEM_*``) and Detectron2's
``MODEL.RESNETS.*`` (``DEPTH``, ``NORM``, ``OUT_FEATURES``, ``STEM_OUT_CHANNELS``,
``RES2_OUT_CHANNELS``, ``WIDTH_PER_GROUP``, ``NUM_GROUPS``, ``STRIDE_IN_1X1``,
``RES5_DILATION``, ``DEFORM_ON_PER_STAGE``) and ``MODEL.BACKBONE.FREEZE_AT``.
"""
import fvcore.nn.weight_init as weight_init
from detectron2.layers import ShapeSpec, get_norm
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.resnet import (
    BasicStem,
    BottleneckBlock,
    DeformBottleneckBlock,
    ResNet,
)

from ...config import ConfigValueError
from ...layers.attention_stem import SpatiallyAwareAttentionStem
from ...layers.local_attention import LocalSelfAttention2d
from .fpn import register_fpn_builders

__all__ = ["SASABottleneckBlock", "SASA_BLOCKS_PER_STAGE", "build_sasa_resnet_backbone"]

# Blocks per stage (res2..res5). 26/38: ResNet-50 minus 2/1 blocks per stage (paper Sec. 4.1).
SASA_BLOCKS_PER_STAGE = {
    26: [1, 2, 4, 1],
    38: [2, 3, 5, 2],
    50: [3, 4, 6, 3],
    101: [3, 4, 23, 3],
}


class SASABottleneckBlock(BottleneckBlock):
    """Detectron2's ``BottleneckBlock`` whose 3x3 ``conv2`` is local self-attention + norm.

    ``conv1`` (1x1) -> ReLU -> ``conv2`` = :class:`LocalSelfAttention2d` (stride in its average
    pooling) + norm -> ReLU -> ``conv3`` (1x1), plus the shortcut: Detectron2's forward,
    unchanged. The stride is always in the attention layer (``stride_in_1x1`` is ignored: a
    strided 1x1 would throw away 3/4 of the pixels before the attention could look at them).
    The value projection is initialised like the convolution it replaces (``c2_msra_fill``).

    Args (in addition to ``BottleneckBlock``'s):
        kernel_size, num_heads, positional_encoding, block_size, impl: of the attention layer.
    """

    def __init__(
        self,
        in_channels,
        out_channels,
        *,
        bottleneck_channels,
        stride=1,
        num_groups=1,
        norm="BN",
        stride_in_1x1=False,
        dilation=1,
        kernel_size=7,
        num_heads=8,
        positional_encoding="relative",
        block_size=8,
        impl="auto",
    ):
        if num_groups != 1:
            raise ValueError(
                f"Attention blocks need num_groups=1 (MODEL.RESNETS.NUM_GROUPS); got {num_groups}"
            )
        if dilation != 1:
            raise ValueError(
                f"Attention blocks need dilation=1 (MODEL.RESNETS.RES5_DILATION); got {dilation}"
            )
        super().__init__(
            in_channels,
            out_channels,
            bottleneck_channels=bottleneck_channels,
            stride=stride,
            num_groups=1,
            norm=norm,
            stride_in_1x1=False,
            dilation=1,
        )
        # conv1 was built with stride 1 (stride_in_1x1=False); replace the 3x3 conv2.
        self.conv2 = LocalSelfAttention2d(
            bottleneck_channels,
            bottleneck_channels,
            kernel_size=kernel_size,
            num_heads=num_heads,
            stride=stride,
            positional_encoding=positional_encoding,
            block_size=block_size,
            impl=impl,
            norm=get_norm(norm, bottleneck_channels),
        )
        weight_init.c2_msra_fill(self.conv2.value)


def _sasa_options(cfg):
    sa = cfg.MODEL.SASA
    return dict(
        kernel_size=sa.KERNEL_SIZE,
        num_heads=sa.NUM_HEADS,
        positional_encoding=sa.POSITIONAL_ENCODING,
        block_size=sa.BLOCK_SIZE,
        impl=sa.IMPL,
    )


def _build_stem(cfg, input_shape: ShapeSpec):
    norm = cfg.MODEL.RESNETS.NORM
    out_channels = cfg.MODEL.RESNETS.STEM_OUT_CHANNELS
    sa = cfg.MODEL.SASA
    if sa.STEM == "conv":
        return BasicStem(in_channels=input_shape.channels, out_channels=out_channels, norm=norm)
    if sa.STEM != "attention":
        raise ConfigValueError(f"Config key MODEL.SASA.STEM must be 'conv' or 'attention'; got {sa.STEM!r}.")
    if out_channels % sa.STEM_NUM_HEADS != 0:
        raise ConfigValueError(
            f"Config key MODEL.SASA.STEM_NUM_HEADS must divide MODEL.RESNETS.STEM_OUT_CHANNELS="
            f"{out_channels}; got {sa.STEM_NUM_HEADS!r}."
        )
    return SpatiallyAwareAttentionStem(
        input_shape.channels,
        out_channels,
        block_size=sa.STEM_BLOCK_SIZE,
        num_heads=sa.STEM_NUM_HEADS,
        num_mixtures=sa.STEM_MIXTURES,
        # The stem has relative logits or none; "sine2d" (a trunk ablation) keeps them relative.
        positional_encoding="none" if sa.POSITIONAL_ENCODING == "none" else "relative",
        norm=(lambda c: get_norm(norm, c)) if norm else "",
    )


@BACKBONE_REGISTRY.register()
def build_sasa_resnet_backbone(cfg, input_shape: ShapeSpec):
    """SASA-ResNet-{26, 38, 50, 101} from ``cfg`` (see the module docstring for the keys).

    Stages in ``MODEL.SASA.STAGES`` use :class:`SASABottleneckBlock`, the others Detectron2's
    ``BottleneckBlock`` (or ``DeformBottleneckBlock`` where ``DEFORM_ON_PER_STAGE``), so the
    paper's Table 3 mixtures are configs. Raises ``ConfigValueError`` naming the key for
    settings an attention stage cannot take.
    """
    r = cfg.MODEL.RESNETS
    sa = cfg.MODEL.SASA
    depth = r.DEPTH
    if depth not in SASA_BLOCKS_PER_STAGE:
        raise ConfigValueError(
            f"Config key MODEL.RESNETS.DEPTH must be one of {tuple(SASA_BLOCKS_PER_STAGE)} for "
            f"build_sasa_resnet_backbone; got {depth!r}."
        )
    bad = [s for s in sa.STAGES if s not in ("res2", "res3", "res4", "res5")]
    if bad:
        raise ConfigValueError(
            f"Config key MODEL.SASA.STAGES must be a subset of ('res2', 'res3', 'res4', 'res5'); "
            f"got {tuple(sa.STAGES)!r}."
        )
    stem = _build_stem(cfg, input_shape)

    num_groups = r.NUM_GROUPS
    bottleneck_channels = num_groups * r.WIDTH_PER_GROUP
    in_channels = r.STEM_OUT_CHANNELS
    out_channels = r.RES2_OUT_CHANNELS
    attn = _sasa_options(cfg)
    stages = []
    for idx, num_blocks in enumerate(SASA_BLOCKS_PER_STAGE[depth]):
        name = f"res{idx + 2}"
        dilation = r.RES5_DILATION if name == "res5" else 1
        first_stride = 1 if idx == 0 or (name == "res5" and dilation == 2) else 2
        kwargs = dict(
            num_blocks=num_blocks,
            stride_per_block=[first_stride] + [1] * (num_blocks - 1),
            in_channels=in_channels,
            out_channels=out_channels,
            bottleneck_channels=bottleneck_channels,
            norm=r.NORM,
            dilation=dilation,
            num_groups=num_groups,
            stride_in_1x1=r.STRIDE_IN_1X1,
        )
        if name in sa.STAGES:
            if num_groups != 1:
                raise ConfigValueError(
                    f"Config key MODEL.RESNETS.NUM_GROUPS must be 1 when {name} uses attention "
                    f"(MODEL.SASA.STAGES={tuple(sa.STAGES)}); got {num_groups!r}."
                )
            if dilation != 1:
                raise ConfigValueError(
                    "Config key MODEL.RESNETS.RES5_DILATION must be 1 when res5 uses attention; "
                    f"got {dilation!r}."
                )
            if r.DEFORM_ON_PER_STAGE[idx]:
                raise ConfigValueError(
                    f"Config key MODEL.RESNETS.DEFORM_ON_PER_STAGE must be False for {name}, "
                    f"which uses attention; got {tuple(r.DEFORM_ON_PER_STAGE)!r}."
                )
            if bottleneck_channels % sa.NUM_HEADS != 0:
                raise ConfigValueError(
                    f"Config key MODEL.SASA.NUM_HEADS must divide the {name} bottleneck width "
                    f"{bottleneck_channels} (MODEL.RESNETS.WIDTH_PER_GROUP * 2^stage); got "
                    f"{sa.NUM_HEADS!r}."
                )
            if sa.POSITIONAL_ENCODING == "relative" and bottleneck_channels // sa.NUM_HEADS < 2:
                raise ConfigValueError(
                    f"Config key MODEL.SASA.NUM_HEADS must leave >= 2 channels per head for "
                    f"relative positions in {name} (bottleneck width {bottleneck_channels}); "
                    f"got {sa.NUM_HEADS!r}."
                )
            kwargs.update(block_class=SASABottleneckBlock, **attn)
        elif r.DEFORM_ON_PER_STAGE[idx]:
            kwargs.update(
                block_class=DeformBottleneckBlock,
                deform_modulated=r.DEFORM_MODULATED,
                deform_num_groups=r.DEFORM_NUM_GROUPS,
            )
        else:
            kwargs.update(block_class=BottleneckBlock)
        stages.append(ResNet.make_stage(**kwargs))
        in_channels = out_channels
        out_channels *= 2
        bottleneck_channels *= 2
    return ResNet(stem, stages, out_features=r.OUT_FEATURES, freeze_at=cfg.MODEL.BACKBONE.FREEZE_AT)


register_fpn_builders("sasa_resnet", build_sasa_resnet_backbone)
