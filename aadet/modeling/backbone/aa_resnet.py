"""AA-ResNet: Detectron2's ResNet with Attention Augmented 3x3 convolutions.

Paper: Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019, Section 4.2:
"We modify all ResNets by augmenting the 3x3 convolutions [...] in each residual block of the
last 3 stages [...] and down-sample only during the first stage", each augmented convolution
followed by batch norm (Section 3.3).

The network is Detectron2's ResNet (:func:`~aadet.modeling.backbone.resnet_stages.build_resnet`,
the stage loop of ``build_resnet_backbone``) with other block classes in the augmented stages
(``MODEL.AA.STAGES``), their layers' options read by
:func:`~aadet.modeling.attention_layers.aa_layer_kwargs`:

* :class:`AABottleneckBlock` (R-50/101/152): Detectron2's ``BottleneckBlock`` whose 3x3
  ``conv2`` is an :class:`AugmentedConv2dNorm` (same stride, dilation and groups): the shared
  attention bottleneck block (:class:`~.resnet_stages.AttentionBottleneckBlock`) with this layer.
* :class:`AABasicBlock` (R-18/34): Detectron2's ``BasicBlock`` whose *first* 3x3 conv
  (``conv1``, the one carrying the stride) is augmented. The paper applies "our augmented
  convolution once per residual block" (Section 3.3) and, for the two-3x3 blocks of
  Wide-ResNet, augments "the first convolution of all residual blocks" (Section 4.1); AA-ResNet-34
  (Section 4.2) uses kappa = nu = 0.25 (set ``MODEL.AA.KAPPA/NU``).

Every other key (stem, depth, widths, groups, strides, dilation, FREEZE_AT, OUT_FEATURES, NORM)
means what it means for Detectron2's ResNet. Registered as ``build_aa_resnet_backbone`` (also
callable with plain arguments) and ``build_retinanet_aa_resnet_fpn_backbone``.
"""
import math
from typing import Any, Callable, Dict, Sequence

import fvcore.nn.weight_init as weight_init
from detectron2.config import configurable
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN
from detectron2.modeling.backbone.resnet import BasicBlock, ResNet
from torch import nn

from ...config import config_error
from ...layers.augmented_conv import AugmentedConv2d
from ...layers.functional.checks import Interval, argument_error, check_in
from ..attention_layers import aa_layer_kwargs
from .fpn import build_retinanet_fpn
from .resnet_stages import (
    AttentionBottleneckBlock,
    ResNetStage,
    basic_stem,
    build_resnet,
    check_stage_names,
    resnet_from_config,
)

__all__ = [
    "AugmentedConv2dNorm",
    "AABottleneckBlock",
    "AABasicBlock",
    "build_aa_resnet_backbone",
    "build_retinanet_aa_resnet_fpn_backbone",
]


class AugmentedConv2dNorm(AugmentedConv2d):
    """:class:`AugmentedConv2d` followed by ``norm``: drop-in for Detectron2's ``Conv2d(norm=)``.

    Keeps the attribute name ``norm`` (so ``FrozenBatchNorm2d.convert_frozen_batchnorm`` and
    checkpoints see ``<conv>.norm`` as for Detectron2's convs). Shapes as
    :class:`AugmentedConv2d`: ``[B, Fin, H, W] -> [B, Fout, Ho, Wo]``.
    """

    def __init__(self, *args, norm=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm = norm

    def forward(self, x):
        x = super().forward(x)
        if self.norm is not None:
            x = self.norm(x)
        return x


def augmented_conv_for_conv(
    conv: nn.Conv2d, conv_init: Callable[[nn.Conv2d], None], **aa_kwargs
) -> AugmentedConv2dNorm:
    """An :class:`AugmentedConv2dNorm` standing in for Detectron2's ``Conv2d`` ``conv``: the same
    channels, kernel size, stride, dilation, groups and bias, ``conv.norm`` moved over.
    ``conv_init`` (Detectron2's ``c2_msra_fill`` in the blocks) initialises its conv, qkv and
    output convs; the relative tables keep their normal(0, (dk/Nh) ** -0.5) init.

    Args:
        aa_kwargs: the other :class:`AugmentedConv2d` options (``kappa``, ``nu``, ``num_heads``,
            ``positional_encoding``, ``attention_downsample``, ``max_size``, ``clip_distances``,
            ``min_dk_per_head``, ``impl``; the layer's defaults for those not given).
    """
    layer = AugmentedConv2dNorm(
        conv.in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size[0],
        stride=conv.stride[0],
        dilation=conv.dilation[0],
        groups=conv.groups,
        bias=conv.bias is not None,
        norm=conv.norm,
        **aa_kwargs,
    )
    for c in (layer.conv, layer.qkv, layer.proj):
        conv_init(c)
    return layer


class AABottleneckBlock(AttentionBottleneckBlock):
    """Detectron2's ``BottleneckBlock`` with its 3x3 ``conv2`` attention augmented
    (:func:`augmented_conv_for_conv`): the shared attention bottleneck block, whose layer here
    keeps the convolution's groups, dilation and ``stride_in_1x1`` placement.

    ``attention`` (in addition to ``BottleneckBlock``'s arguments): the options of
    :func:`augmented_conv_for_conv`.
    """

    attention_layer = staticmethod(augmented_conv_for_conv)
    keeps_conv_geometry = True


class AABasicBlock(BasicBlock):
    """Detectron2's ``BasicBlock`` (R-18/34) with its first 3x3 conv (``conv1``) augmented.

    One augmented convolution per residual block, the first one, as the paper does for the
    two-3x3 blocks of Wide-ResNet. ``aa_kwargs`` as :class:`AABottleneckBlock`.
    """

    def __init__(self, in_channels, out_channels, *, stride=1, norm="BN", **aa_kwargs):
        super().__init__(in_channels, out_channels, stride=stride, norm=norm)
        self.conv1 = augmented_conv_for_conv(self.conv1, weight_init.c2_msra_fill, **aa_kwargs)


def stage_max_size(max_input_size: int, stage_stride: int, downsample: bool) -> int:
    """The attention-map side of the largest allowed input at a stage of output stride
    ``stage_stride``: ``ceil(max_input_size / stage_stride)``, halved again (rounded up) where the
    attention is downsampled (e.g. 224 -> 28 / 14 / 7 at res3 / res4 / res5, 14 at a downsampled
    res3)."""
    max_size = math.ceil(max_input_size / stage_stride)
    return math.ceil(max_size / 2) if downsample else max_size


def _aa_resnet_from_config(cfg, input_shape: ShapeSpec) -> Dict[str, Any]:
    """``MODEL.AA.*`` and ``MODEL.RESNETS.*`` -> :func:`build_aa_resnet_backbone`'s arguments,
    checking the keys this builder owns (stage names, ``MAX_INPUT_SIZE``)."""
    aa = cfg.MODEL.AA
    stages = check_stage_names("MODEL.AA.STAGES", aa.STAGES)
    downsample = check_stage_names("MODEL.AA.DOWNSAMPLE_STAGES", aa.DOWNSAMPLE_STAGES)
    check_in(aa.MAX_INPUT_SIZE, Interval(0.0), "MODEL.AA.MAX_INPUT_SIZE", config_error)
    return dict(
        stem=basic_stem(cfg, input_shape),
        aa_stages=stages,
        downsample_stages=downsample,
        max_input_size=aa.MAX_INPUT_SIZE,
        attention=aa_layer_kwargs(cfg),
        **resnet_from_config(cfg),
    )


@BACKBONE_REGISTRY.register()
@configurable(from_config=_aa_resnet_from_config)
def build_aa_resnet_backbone(
    *,
    stem,
    aa_stages: Sequence[str],
    downsample_stages: Sequence[str],
    max_input_size: int,
    attention: Dict[str, Any],
    **resnet,
) -> ResNet:
    """AA-ResNet: Detectron2's ResNet with AA blocks in ``aa_stages``.

    Called as a backbone builder, ``(cfg, input_shape)``, its arguments come from the config
    (``MODEL.AA.STAGES``, ``DOWNSAMPLE_STAGES``, ``MAX_INPUT_SIZE``, the layer keys, and
    Detectron2's ``MODEL.RESNETS.*``).

    Args:
        stem: the stem module (Detectron2's ``BasicStem`` from the config).
        aa_stages: stages whose blocks are augmented.
        downsample_stages: stages whose attention runs on a 3x3/2 average-pooled input.
        max_input_size: the largest input side the relative tables cover (each stage's
            ``max_size``: :func:`stage_max_size`).
        attention: the other :class:`AugmentedConv2d` options (``kappa``, ``nu``, ``num_heads``,
            ``positional_encoding``, ``clip_distances``, ``min_dk_per_head``, ``impl``).
        resnet: :func:`~.resnet_stages.build_resnet`'s other arguments.

    Returns:
        ResNet: Detectron2's :class:`ResNet` (same stem, stages, freezing and outputs).

    Raises:
        ConfigValueError: naming the key, for ResNet settings Detectron2 does not build (see
            :func:`~.resnet_stages.build_resnet`).
    """
    aa_stages, downsample_stages = tuple(aa_stages), tuple(downsample_stages)
    # the plain-argument path's checks (from the config, _aa_resnet_from_config named the keys)
    check_stage_names("aa_stages", aa_stages, argument_error)
    check_stage_names("downsample_stages", downsample_stages, argument_error)
    check_in(max_input_size, Interval(0.0), "max_input_size", argument_error)

    def block_for_stage(stage: ResNetStage):
        if stage.name not in aa_stages:
            return None
        block = AABasicBlock if stage.bottleneck_channels == 0 else AABottleneckBlock
        downsample = stage.name in downsample_stages
        return block, dict(
            attention,
            attention_downsample=downsample,
            max_size=stage_max_size(max_input_size, stage.stride, downsample),
        )

    return build_resnet(
        stem, block_for_stage=block_for_stage, attention_stages=aa_stages,
        builder="build_aa_resnet_backbone", **resnet,
    )


@BACKBONE_REGISTRY.register()
def build_retinanet_aa_resnet_fpn_backbone(cfg, input_shape: ShapeSpec) -> FPN:
    """RetinaNet FPN (:func:`~.fpn.build_retinanet_fpn`) over :func:`build_aa_resnet_backbone`."""
    return build_retinanet_fpn(cfg, build_aa_resnet_backbone(cfg, input_shape))
