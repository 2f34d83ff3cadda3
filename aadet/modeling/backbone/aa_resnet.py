"""AA-ResNet: Detectron2's ResNet with Attention Augmented 3x3 convolutions.

Paper: Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019, Section 4.2:
"We modify all ResNets by augmenting the 3x3 convolutions [...] in each residual block of the
last 3 stages [...] and down-sample only during the first stage", each augmented convolution
followed by batch norm (Section 3.3).

The network is Detectron2's ResNet (:func:`~aadet.modeling.backbone.resnet_stages.build_resnet`,
the stage loop of ``build_resnet_backbone``) with other block classes in the augmented stages
(``MODEL.AA.STAGES``), their layers configured by
:func:`~aadet.modeling.attention_layers.aa_layer_kwargs`:

* :class:`AABottleneckBlock` (R-50/101/152): Detectron2's ``BottleneckBlock`` whose 3x3
  ``conv2`` is an :class:`AugmentedConv2dNorm` (same stride, dilation and groups).
* :class:`AABasicBlock` (R-18/34): Detectron2's ``BasicBlock`` whose *first* 3x3 conv
  (``conv1``, the one carrying the stride) is augmented. The paper applies "our augmented
  convolution once per residual block" (Section 3.3) and, for the two-3x3 blocks of
  Wide-ResNet, augments "the first convolution of all residual blocks" (Section 4.1); AA-ResNet-34
  (Section 4.2) uses kappa = nu = 0.25 (set ``MODEL.AA.KAPPA/NU``).

Every other key (stem, depth, widths, groups, strides, dilation, FREEZE_AT, OUT_FEATURES, NORM)
means what it means for Detectron2's ResNet. Registered as ``build_aa_resnet_backbone`` and
``build_retinanet_aa_resnet_fpn_backbone``.
"""
import fvcore.nn.weight_init as weight_init
from detectron2.layers import ShapeSpec, get_norm
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN
from detectron2.modeling.backbone.resnet import BasicBlock, BasicStem, BottleneckBlock, ResNet

from ...config import check_aa_config
from ...layers.augmented_conv import AugmentedConv2d
from ..attention_layers import aa_layer_kwargs
from .fpn import build_retinanet_fpn
from .resnet_stages import ResNetStage, build_resnet

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
    ``min_dk_per_head``; see :func:`~aadet.modeling.attention_layers.aa_layer_kwargs`).
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


@BACKBONE_REGISTRY.register()
def build_aa_resnet_backbone(cfg, input_shape: ShapeSpec) -> ResNet:
    """AA-ResNet from config: Detectron2's ResNet with AA blocks in ``MODEL.AA.STAGES``.

    Returns:
        ResNet: Detectron2's :class:`ResNet` (same stem, stages, freezing and outputs).

    Raises:
        ConfigValueError: naming the key, for ``MODEL.AA.*`` out of range and ResNet settings
            Detectron2 does not build (see :func:`~.resnet_stages.build_resnet`).
    """
    check_aa_config(cfg)
    aa_stages = tuple(cfg.MODEL.AA.STAGES)
    stem = BasicStem(
        in_channels=input_shape.channels,
        out_channels=cfg.MODEL.RESNETS.STEM_OUT_CHANNELS,
        norm=cfg.MODEL.RESNETS.NORM,
    )

    def block_for_stage(stage: ResNetStage):
        if stage.name not in aa_stages:
            return None
        block = AABasicBlock if stage.bottleneck_channels == 0 else AABottleneckBlock
        return block, aa_layer_kwargs(cfg, stage.name, stage.stride)

    return build_resnet(
        cfg, stem, block_for_stage=block_for_stage, attention_stages=aa_stages,
        builder="build_aa_resnet_backbone",
    )


@BACKBONE_REGISTRY.register()
def build_retinanet_aa_resnet_fpn_backbone(cfg, input_shape: ShapeSpec) -> FPN:
    """RetinaNet FPN (:func:`~.fpn.build_retinanet_fpn`) over :func:`build_aa_resnet_backbone`."""
    return build_retinanet_fpn(cfg, build_aa_resnet_backbone(cfg, input_shape))
