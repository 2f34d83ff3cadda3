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
  ``conv2`` is an :class:`AugmentedConv2dNorm` (same stride, dilation and groups).
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
from typing import Any, Dict, Sequence

import fvcore.nn.weight_init as weight_init
from detectron2.config import configurable
from detectron2.layers import ShapeSpec, get_norm
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN
from detectron2.modeling.backbone.resnet import BasicBlock, BottleneckBlock, ResNet

from ...config import config_error
from ...layers.augmented_conv import AugmentedConv2d
from ...layers.functional.checks import Interval, check_in
from ..attention_layers import aa_layer_kwargs
from .fpn import build_retinanet_fpn
from .resnet_stages import ResNetStage, basic_stem, build_resnet, check_stage_names, resnet_from_config

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


def _c2_msra_fill_augmented(layer: AugmentedConv2d):
    """Detectron2's conv init (``c2_msra_fill``) on the conv, qkv and output convs.

    The relative tables keep their normal(0, (dk/Nh) ** -0.5) init.
    """
    for conv in (layer.conv, layer.qkv, layer.proj):
        weight_init.c2_msra_fill(conv)


class AABottleneckBlock(BottleneckBlock):
    """Detectron2's ``BottleneckBlock`` with its 3x3 ``conv2`` attention augmented.

    ``aa_kwargs`` go to :class:`AugmentedConv2d` (``kappa``, ``nu``, ``num_heads``,
    ``positional_encoding``, ``attention_downsample``, ``max_size``, ``clip_distances``,
    ``min_dk_per_head``, ``impl``; the layer's defaults for those not given).
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
        **aa_kwargs,
    ):
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
        self.conv2 = AugmentedConv2dNorm(
            bottleneck_channels,
            bottleneck_channels,
            kernel_size=3,
            stride=1 if stride_in_1x1 else stride,
            dilation=dilation,
            groups=num_groups,
            bias=False,
            norm=get_norm(norm, bottleneck_channels),
            **aa_kwargs,
        )
        _c2_msra_fill_augmented(self.conv2)


class AABasicBlock(BasicBlock):
    """Detectron2's ``BasicBlock`` (R-18/34) with its first 3x3 conv (``conv1``) augmented.

    One augmented convolution per residual block, the first one, as the paper does for the
    two-3x3 blocks of Wide-ResNet. ``aa_kwargs`` as :class:`AABottleneckBlock`.
    """

    def __init__(self, in_channels, out_channels, *, stride=1, norm="BN", **aa_kwargs):
        super().__init__(in_channels, out_channels, stride=stride, norm=norm)
        self.conv1 = AugmentedConv2dNorm(
            in_channels,
            out_channels,
            kernel_size=3,
            stride=stride,
            bias=False,
            norm=get_norm(norm, out_channels),
            **aa_kwargs,
        )
        _c2_msra_fill_augmented(self.conv1)


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
