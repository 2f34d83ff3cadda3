"""The ResNet that AA-ResNet, SASA-ResNet and HaloNet-ResNet share: Detectron2's stages, a block
class per stage, and the bottleneck block whose 3x3 convolution is an attention layer.

:func:`build_resnet` is Detectron2's ``build_resnet_backbone`` stage loop (same widths, strides,
dilation, groups, ``STRIDE_IN_1X1``, deformable stages, ``FREEZE_AT``, ``OUT_FEATURES``) with two
points of variation: the stem, and a ``block_for_stage(stage)`` callback that returns the block
class of one stage and its extra keyword arguments, or ``None`` for Detectron2's own block. With
``block_for_stage`` always ``None`` the result equals ``build_resnet_backbone``'s
(``tests/modeling/test_resnet_stages.py`` compares them). ``zero_init_residual``
(``MODEL.RESNETS.ZERO_INIT_RESIDUAL``, aadet's key, off by default) zeroes the last norm's scale
of every block.

It takes plain arguments; :func:`resnet_from_config` is the one place that reads
``MODEL.RESNETS.*`` and ``MODEL.BACKBONE.FREEZE_AT`` for it (``build_resnet(cfg, stem=...)``
calls it, Detectron2's ``@configurable``).

:class:`AttentionBottleneckBlock` is the one attention bottleneck block of the AA-ResNet, the
SASA-ResNet and the HaloNet-ResNet: Detectron2's ``BottleneckBlock`` whose ``conv2`` is the layer
its ``attention_layer`` builds; each backbone's block class names that layer.
:func:`build_attention_resnet` is the SASA and HaloNet builders' common body (their attention
blocks in the chosen stages, the bottleneck depths, the settings an attention stage cannot take),
:func:`attention_resnet_from_config` their common config mapping, and :func:`check_stage_names`
the one check of stage names, for config keys and plain arguments alike.
"""
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import fvcore.nn.weight_init as weight_init
import torch
from detectron2.config import configurable
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone.resnet import (
    BasicBlock,
    BasicStem,
    BottleneckBlock,
    CNNBlockBase,
    DeformBottleneckBlock,
    ResNet,
)
from torch import nn

from ...config import config_error, layer_defaults
from ...layers.functional.checks import ErrorFactory, argument_error, check_num_heads, check_subset
from ...layers.local_attention_base import min_head_channels

__all__ = [
    "AttentionBottleneckBlock",
    "BASIC_DEPTHS",
    "BOTTLENECK_BLOCKS_PER_STAGE",
    "RESNET_BLOCKS_PER_STAGE",
    "STAGE_NAMES",
    "ResNetStage",
    "basic_stem",
    "attention_resnet_from_config",
    "build_attention_resnet",
    "build_resnet",
    "check_stage_names",
    "resnet_from_config",
]

STAGE_NAMES = ("res2", "res3", "res4", "res5")  # the stages a key or argument may name

# Blocks per stage res2..res5: Detectron2's depths (build_resnet_backbone) plus the SASA paper's
# ResNet-26 and ResNet-38 (Sec. 4.1: ResNet-50's [3, 4, 6, 3] minus 2 / 1 blocks per stage), which
# the paper trains both as conv baselines and with attention.
RESNET_BLOCKS_PER_STAGE = {
    18: (2, 2, 2, 2),
    26: (1, 2, 4, 1),
    34: (3, 4, 6, 3),
    38: (2, 3, 5, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}
BASIC_DEPTHS = (18, 34)  # BasicBlock (two 3x3) networks; the others use bottlenecks
# The bottleneck depths of the table: those of the SASA and HaloNet ResNets, whose attention
# blocks are bottlenecks.
BOTTLENECK_BLOCKS_PER_STAGE = {
    depth: blocks for depth, blocks in RESNET_BLOCKS_PER_STAGE.items() if depth not in BASIC_DEPTHS
}


@dataclass(frozen=True)
class ResNetStage:
    """What a block-choosing callback knows about one stage.

    ``stride`` is the output stride of the stage (4, 8, 16, 32; 16 for a dilated res5),
    ``first_stride`` the stride of its first block (1 for res2 and a dilated res5, else 2);
    ``bottleneck_channels`` is 0 for BasicBlock networks.
    """

    name: str  # "res2" .. "res5"
    index: int  # 0 .. 3
    stride: int
    first_stride: int
    in_channels: int
    out_channels: int
    bottleneck_channels: int
    num_groups: int
    dilation: int
    deform: bool  # MODEL.RESNETS.DEFORM_ON_PER_STAGE of this stage


BlockChoice = Optional[Tuple[type, Dict]]


class AttentionBottleneckBlock(BottleneckBlock):
    """Detectron2's ``BottleneckBlock`` whose 3x3 ``conv2`` is a spatial attention layer + norm.

    ``conv1`` (1x1) -> ReLU -> ``conv2`` = ``attention_layer(conv, c2_msra_fill, **attention)``
    of the 3x3 convolution it replaces (its stride, bias and norm; the layer's projections
    initialised with that convolution's ``c2_msra_fill``) -> ReLU -> ``conv3`` (1x1), plus the
    shortcut: Detectron2's forward, unchanged. A local attention layer takes the block's stride
    (``stride_in_1x1`` is ignored: a strided 1x1 would throw away 3/4 of the pixels before the
    attention could look at them) and needs ``num_groups = dilation = 1``; a layer that
    :attr:`keeps_conv_geometry` (the augmented convolution) takes them as the convolution did.

    A subclass names its layer in :attr:`attention_layer`:
    :class:`~aadet.modeling.backbone.sasa_resnet.SASABottleneckBlock` (SASA's local attention,
    stride by pooling), :class:`~aadet.modeling.backbone.halo_resnet.HaloBottleneckBlock`
    (HaloNet's blocked attention, stride by attention downsampling) and
    :class:`~aadet.modeling.backbone.aa_resnet.AABottleneckBlock` (the attention augmented
    convolution, which also sets :attr:`keeps_conv_geometry`).

    ``attention`` (in addition to ``BottleneckBlock``'s arguments): options of the attention
    layer, the layer's defaults for those not given.
    """

    #: ``(conv, conv_init, **attention) -> nn.Module``: the layer standing where the 3x3
    #: ``conv`` stood (e.g. :func:`~aadet.modeling.attention_layers.local_attention_for_conv`).
    attention_layer: Callable[..., nn.Module]
    #: Whether the layer keeps the convolution's groups, dilation and stride placement
    #: (``stride_in_1x1``), as an augmented convolution does; False: a local attention layer.
    keeps_conv_geometry: bool = False

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
        **attention,
    ):
        if not self.keeps_conv_geometry:
            name = type(self).__name__
            if num_groups != 1:
                raise ValueError(f"{name} needs num_groups=1; got {num_groups}")
            if dilation != 1:
                raise ValueError(f"{name} needs dilation=1; got {dilation}")
            stride_in_1x1 = False  # conv1 has stride 1, conv2 (the attention) the block's stride
        super().__init__(
            in_channels,
            out_channels,
            bottleneck_channels=bottleneck_channels,
            stride=stride,
            num_groups=num_groups,
            norm=norm,
            stride_in_1x1=stride_in_1x1,
            dilation=dilation,
        )
        self.conv2 = self.attention_layer(self.conv2, weight_init.c2_msra_fill, **attention)


def check_stage_names(
    name: str, stages: Sequence[str], error: ErrorFactory = config_error
) -> Tuple[str, ...]:
    """``stages`` as a tuple of :data:`STAGE_NAMES`: the one check of stage names, of a config key
    (``error=config_error``, the default) or of a builder's argument (``argument_error``), each
    named ``name`` in the error."""
    check_subset(tuple(stages), STAGE_NAMES, name, error)
    return tuple(stages)


def _check_attention_stage(stage: ResNetStage, section: str, where: str, options: Dict) -> None:
    """Settings a stage of local attention blocks cannot take (the conv stages may), named by their
    keys: ``MODEL.RESNETS.NUM_GROUPS`` and ``RES5_DILATION`` 1, and ``<section>.NUM_HEADS`` heads
    that split the stage's bottleneck width with at least :func:`min_head_channels` channels each
    (``options``: the layer's, its defaults filled in)."""
    name, width = stage.name, stage.bottleneck_channels
    if stage.num_groups != 1:
        raise config_error("MODEL.RESNETS.NUM_GROUPS", f"1 {where}", stage.num_groups)
    if stage.dilation != 1:
        raise config_error("MODEL.RESNETS.RES5_DILATION", f"1 {where}", stage.dilation)
    check_num_heads(
        options["num_heads"],
        width,
        min_per_head=min_head_channels(options["positional_encoding"]),
        name=f"{section}.NUM_HEADS",
        channels_name=f"the {name} bottleneck width {width} (MODEL.RESNETS.WIDTH_PER_GROUP * 2^stage)",
        per_head_reason=f"for relative positions in {name}, bottleneck width {width}",
        error=config_error,
    )


def attention_resnet_from_config(cfg, section: str, stem: CNNBlockBase, attention: Dict) -> Dict:
    """The arguments of a builder over :func:`build_attention_resnet` from the config: ``stem``,
    the stages of ``<section>.STAGES`` (checked, naming the key), the layer options
    ``attention`` and :func:`resnet_from_config`'s. ``section``: e.g. ``"MODEL.HALO"``."""
    node = cfg
    for name in section.split("."):
        node = node[name]
    return dict(
        stem=stem,
        attention_stages=check_stage_names(f"{section}.STAGES", node.STAGES),
        attention=attention,
        **resnet_from_config(cfg),
    )


def basic_stem(cfg, input_shape: ShapeSpec) -> BasicStem:
    """Detectron2's conv stem (7x7/2 conv, 3x3/2 max pool) from ``MODEL.RESNETS``."""
    r = cfg.MODEL.RESNETS
    return BasicStem(in_channels=input_shape.channels, out_channels=r.STEM_OUT_CHANNELS, norm=r.NORM)


def resnet_from_config(cfg) -> Dict:
    """``MODEL.RESNETS.*`` and ``MODEL.BACKBONE.FREEZE_AT`` -> :func:`build_resnet`'s arguments
    (all but the stem and the block choice)."""
    r = cfg.MODEL.RESNETS
    return dict(
        depth=r.DEPTH,
        norm=r.NORM,
        res2_out_channels=r.RES2_OUT_CHANNELS,
        width_per_group=r.WIDTH_PER_GROUP,
        num_groups=r.NUM_GROUPS,
        stride_in_1x1=r.STRIDE_IN_1X1,
        res5_dilation=r.RES5_DILATION,
        deform_on_per_stage=tuple(r.DEFORM_ON_PER_STAGE),
        deform_modulated=r.DEFORM_MODULATED,
        deform_num_groups=r.DEFORM_NUM_GROUPS,
        zero_init_residual=r.ZERO_INIT_RESIDUAL,
        out_features=r.OUT_FEATURES,
        freeze_at=cfg.MODEL.BACKBONE.FREEZE_AT,
    )


@configurable(from_config=resnet_from_config)
def build_resnet(
    stem: CNNBlockBase,
    *,
    depth: int,
    norm,
    res2_out_channels: int,
    width_per_group: int,
    num_groups: int,
    stride_in_1x1: bool,
    res5_dilation: int,
    deform_on_per_stage: Sequence[bool],
    deform_modulated: bool,
    deform_num_groups: int,
    zero_init_residual: bool,
    out_features: Sequence[str],
    freeze_at: int,
    block_for_stage: Callable[[ResNetStage], BlockChoice] = lambda stage: None,
    blocks_per_stage: Dict[int, Sequence[int]] = RESNET_BLOCKS_PER_STAGE,
    attention_stages: Sequence[str] = (),
    builder: str = "build_resnet",
) -> ResNet:
    """Detectron2's ResNet over ``stem``, each stage's block class chosen by ``block_for_stage``.

    Args:
        stem: the stem module (with ``stride`` and ``out_channels``, as ``BasicStem``).
        depth, norm, ..., freeze_at: Detectron2's ``MODEL.RESNETS.*`` of the same names and
            ``MODEL.BACKBONE.FREEZE_AT`` (:func:`resnet_from_config`); ``zero_init_residual``:
            zero the scale of the last norm of every block (:func:`_zero_init_residual`).
        block_for_stage: ``stage -> (block_class, extra_kwargs)`` or ``None`` (Detectron2's
            ``BasicBlock`` / ``BottleneckBlock`` / ``DeformBottleneckBlock``). Blocks get
            Detectron2's arguments (``in_channels``, ``out_channels``, ``stride``, ``norm``, and
            for bottlenecks ``bottleneck_channels``, ``num_groups``, ``stride_in_1x1``,
            ``dilation``) plus the extra ones.
        blocks_per_stage: ``depth -> blocks in res2..res5``.
        attention_stages: stages whose blocks have attention (they cannot be deformable).
        builder: the calling builder's name, for error messages.

    Raises:
        ConfigValueError: naming the ``MODEL.RESNETS`` key, for a depth not in
            ``blocks_per_stage``, deformable attention stages, and Detectron2's R18/R34
            restrictions.
    """
    if depth not in blocks_per_stage:
        raise config_error(
            "MODEL.RESNETS.DEPTH", f"one of {sorted(blocks_per_stage)} for {builder}", depth
        )
    deform = tuple(deform_on_per_stage)
    if any(d and name in attention_stages for name, d in zip(STAGE_NAMES, deform)):
        raise config_error(
            "MODEL.RESNETS.DEFORM_ON_PER_STAGE",
            f"all False in the attention stages {tuple(attention_stages)}",
            deform,
        )
    if res5_dilation not in (1, 2):
        raise config_error("MODEL.RESNETS.RES5_DILATION", "1 or 2", res5_dilation)
    basic = depth in BASIC_DEPTHS
    if basic:
        for key, value, allowed in (
            ("RES2_OUT_CHANNELS", res2_out_channels, 64),
            ("RES5_DILATION", res5_dilation, 1),
            ("NUM_GROUPS", num_groups, 1),
        ):
            if value != allowed:
                raise config_error(f"MODEL.RESNETS.{key}", f"{allowed} for R18/R34", value)

    in_channels = stem.out_channels
    out_channels = res2_out_channels
    bottleneck_channels = num_groups * width_per_group
    current_stride = stem.stride
    stages = []
    for idx, (name, num_blocks) in enumerate(zip(STAGE_NAMES, blocks_per_stage[depth])):
        # res5_dilation is used this way as a convention in R-FCN & Deformable Conv paper
        dilation = res5_dilation if name == "res5" else 1
        first_stride = 1 if idx == 0 or dilation == 2 else 2
        current_stride *= first_stride
        stage = ResNetStage(
            name=name,
            index=idx,
            stride=current_stride,
            first_stride=first_stride,
            in_channels=in_channels,
            out_channels=out_channels,
            bottleneck_channels=0 if basic else bottleneck_channels,
            num_groups=num_groups,
            dilation=dilation,
            deform=bool(deform[idx]),
        )
        if basic:
            own_block = BasicBlock, {}
        elif stage.deform:
            own_block = DeformBottleneckBlock, dict(
                deform_modulated=deform_modulated, deform_num_groups=deform_num_groups
            )
        else:
            own_block = BottleneckBlock, {}
        block_class, extra = block_for_stage(stage) or own_block
        kwargs = dict(
            block_class=block_class,
            num_blocks=num_blocks,
            stride_per_block=[first_stride] + [1] * (num_blocks - 1),
            in_channels=in_channels,
            out_channels=out_channels,
            norm=norm,
        )
        if not basic:
            kwargs.update(
                bottleneck_channels=bottleneck_channels,
                num_groups=num_groups,
                stride_in_1x1=stride_in_1x1,
                dilation=dilation,
            )
        stages.append(ResNet.make_stage(**kwargs, **extra))
        in_channels = out_channels
        out_channels *= 2
        bottleneck_channels *= 2
    if zero_init_residual:
        for block in (b for stage in stages for b in stage):
            _zero_init_residual(block, builder)
    return ResNet(stem, stages, out_features=out_features, freeze_at=freeze_at)


def build_attention_resnet(
    stem: CNNBlockBase,
    *,
    attention_stages: Sequence[str],
    attention: Dict,
    block_class: type,
    layer_class: type,
    section: str,
    builder: str,
    check_stage: Optional[Callable[[ResNetStage, str, Dict], None]] = None,
    **resnet,
) -> ResNet:
    """:func:`build_resnet` at the bottleneck depths with ``block_class`` (an
    :class:`AttentionBottleneckBlock`) and its layer options ``attention`` in the stages named in
    ``attention_stages``, Detectron2's blocks in the others: the body of the SASA and HaloNet
    builders.

    Args:
        layer_class: the attention layer of ``block_class``, whose defaults stand for the
            options ``attention`` does not give.
        section: the backbone's config section (``"MODEL.SASA"``, ``"MODEL.HALO"``), which names
            the keys in the errors.
        builder: the calling builder's name, for error messages.
        check_stage: ``(stage, where, options)``, the layer's own rules for an attention stage,
            called after the shared ones (``where``: "when <stage> uses attention (...)", for
            its messages; ``options``: ``attention`` with the layer's defaults).
        resnet: :func:`build_resnet`'s other arguments.

    Raises:
        ValueError: naming the argument, for ``attention_stages`` not in :data:`STAGE_NAMES`
            (from the config, the builder's ``from_config`` named the key).
        ConfigValueError: naming the key, for settings an attention stage cannot take:
            ``MODEL.RESNETS.NUM_GROUPS`` and ``RES5_DILATION`` other than 1, ``<section>.NUM_HEADS``
            not splitting the stage's bottleneck width, and those of ``check_stage``.
    """
    attention_stages = check_stage_names("attention_stages", attention_stages, argument_error)
    options = {**layer_defaults(layer_class), **attention}

    def block_for_stage(stage: ResNetStage) -> BlockChoice:
        if stage.name not in attention_stages:
            return None
        where = f"when {stage.name} uses attention ({section}.STAGES={attention_stages})"
        _check_attention_stage(stage, section, where, options)
        if check_stage is not None:
            check_stage(stage, where, options)
        return block_class, attention

    return build_resnet(
        stem,
        block_for_stage=block_for_stage,
        blocks_per_stage=BOTTLENECK_BLOCKS_PER_STAGE,
        attention_stages=attention_stages,
        builder=builder,
        **resnet,
    )


def _zero_init_residual(block: CNNBlockBase, builder: str = "build_resnet") -> None:
    """Zero the scale of the last norm of ``block``'s residual branch (``conv3`` of a bottleneck,
    ``conv2`` of a basic block; attention blocks keep those names), so the block starts as the
    identity, or as its projection shortcut (Goyal et al. 2017, Sec. 5.1; the TF-TPU ResNet of
    the papers' codebase does it with ``init_zero`` on the last batch norm of each block).

    Raises:
        ConfigValueError: when that conv has no norm with a scale (``MODEL.RESNETS.NORM`` "").
    """
    last = block.conv3 if hasattr(block, "conv3") else block.conv2
    weight = getattr(getattr(last, "norm", None), "weight", None)
    if not isinstance(weight, torch.nn.Parameter):
        raise config_error(
            "MODEL.RESNETS.ZERO_INIT_RESIDUAL",
            f"False unless MODEL.RESNETS.NORM has a learned scale ({builder})",
            True,
        )
    torch.nn.init.zeros_(weight)
