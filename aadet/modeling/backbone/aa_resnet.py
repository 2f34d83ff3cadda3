"""AA-ResNet: Detectron2's ResNet with Attention Augmented 3x3 convolutions.

Paper: Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019, Section 4.2:
"We modify all ResNets by augmenting the 3x3 convolutions [...] in each residual block of the
last 3 stages [...] and down-sample only during the first stage", each augmented convolution
followed by batch norm (Section 3.3).

The network is Detectron2's ``build_resnet_backbone`` with other block classes in the augmented
stages (``MODEL.AA.STAGES``):

* :class:`AABottleneckBlock` (R-50/101/152): Detectron2's ``BottleneckBlock`` whose 3x3
  ``conv2`` is an :class:`AugmentedConv2dNorm` (same stride, dilation and groups).
* :class:`AABasicBlock` (R-18/34): Detectron2's ``BasicBlock`` whose *first* 3x3 conv
  (``conv1``, the one carrying the stride) is augmented. The paper applies "our augmented
  convolution once per residual block" (Section 3.3) and, for the two-3x3 blocks of
  Wide-ResNet, augments "the first convolution of all residual blocks" (Section 4.1); AA-ResNet-34
  (Section 4.2) uses kappa = nu = 0.25 (set ``MODEL.AA.KAPPA/NU``).

Every other key (stem, depth, widths, groups, strides, FREEZE_AT, OUT_FEATURES, NORM) means what
it means for Detectron2's ResNet. Registered as ``build_aa_resnet_backbone`` plus the FPN
builders ``build_aa_resnet_fpn_backbone`` / ``build_retinanet_aa_resnet_fpn_backbone``.
"""
import math

import fvcore.nn.weight_init as weight_init
from detectron2.layers import ShapeSpec, get_norm
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.resnet import BasicBlock, BasicStem, BottleneckBlock, ResNet

from aadet.layers.augmented_conv import AugmentedConv2d

from .fpn import register_fpn_builders

__all__ = [
    "AugmentedConv2dNorm",
    "AABottleneckBlock",
    "AABasicBlock",
    "aa_layer_kwargs",
    "build_aa_resnet_backbone",
]

_STAGES = ("res2", "res3", "res4", "res5")


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
    ``min_dk_per_head``, ``impl``, ``query_chunk``).
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


def aa_layer_kwargs(cfg, stage: str, stage_stride: int) -> dict:
    """:class:`AugmentedConv2d` arguments of the blocks of ``stage`` (output stride given).

    ``max_size = ceil(MODEL.AA.MAX_INPUT_SIZE / stage_stride)``, halved again (rounded up) in
    ``MODEL.AA.DOWNSAMPLE_STAGES``: the attention-map side of the largest allowed input (e.g.
    224 -> 28 / 14 / 7 at res3 / res4 / res5, 14 at a downsampled res3).
    """
    aa = cfg.MODEL.AA
    downsample = stage in aa.DOWNSAMPLE_STAGES
    max_size = math.ceil(aa.MAX_INPUT_SIZE / stage_stride)
    if downsample:
        max_size = math.ceil(max_size / 2)
    return dict(
        kappa=float(aa.KAPPA),
        nu=float(aa.NU),
        num_heads=aa.NUM_HEADS,
        positional_encoding=aa.POSITIONAL_ENCODING,
        attention_downsample=downsample,
        max_size=max_size,
        clip_distances=bool(aa.CLIP_DISTANCES),
        min_dk_per_head=aa.MIN_DK_PER_HEAD,
        query_chunk=aa.QUERY_CHUNK,
    )


def _config_error(key, allowed, given):
    return ValueError(
        f"build_aa_resnet_backbone: config key {key} must be {allowed}; got {given!r}"
    )


@BACKBONE_REGISTRY.register()
def build_aa_resnet_backbone(cfg, input_shape: ShapeSpec):
    """AA-ResNet from config: ``build_resnet_backbone`` with AA blocks in ``MODEL.AA.STAGES``.

    Returns:
        ResNet: Detectron2's :class:`ResNet` (same stem, stages, freezing and outputs).
    """
    norm = cfg.MODEL.RESNETS.NORM
    stem = BasicStem(
        in_channels=input_shape.channels,
        out_channels=cfg.MODEL.RESNETS.STEM_OUT_CHANNELS,
        norm=norm,
    )

    # fmt: off
    freeze_at           = cfg.MODEL.BACKBONE.FREEZE_AT
    out_features        = cfg.MODEL.RESNETS.OUT_FEATURES
    depth               = cfg.MODEL.RESNETS.DEPTH
    num_groups          = cfg.MODEL.RESNETS.NUM_GROUPS
    width_per_group     = cfg.MODEL.RESNETS.WIDTH_PER_GROUP
    bottleneck_channels = num_groups * width_per_group
    in_channels         = cfg.MODEL.RESNETS.STEM_OUT_CHANNELS
    out_channels        = cfg.MODEL.RESNETS.RES2_OUT_CHANNELS
    stride_in_1x1       = cfg.MODEL.RESNETS.STRIDE_IN_1X1
    res5_dilation       = cfg.MODEL.RESNETS.RES5_DILATION
    deform_on_per_stage = cfg.MODEL.RESNETS.DEFORM_ON_PER_STAGE
    aa_stages           = tuple(cfg.MODEL.AA.STAGES)
    # fmt: on

    num_blocks = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3], 101: [3, 4, 23, 3],
                  152: [3, 8, 36, 3]}
    if depth not in num_blocks:
        raise _config_error("MODEL.RESNETS.DEPTH", f"one of {sorted(num_blocks)}", depth)
    if any(deform_on_per_stage):
        raise _config_error(
            "MODEL.RESNETS.DEFORM_ON_PER_STAGE",
            "all False (no deformable convs in AA-ResNet)",
            tuple(deform_on_per_stage),
        )
    if res5_dilation not in (1, 2):
        raise _config_error("MODEL.RESNETS.RES5_DILATION", "1 or 2", res5_dilation)
    for key, given in (("MODEL.AA.STAGES", aa_stages),
                       ("MODEL.AA.DOWNSAMPLE_STAGES", tuple(cfg.MODEL.AA.DOWNSAMPLE_STAGES))):
        if any(s not in _STAGES for s in given):
            raise _config_error(key, f"a subset of {_STAGES}", given)
    if depth in (18, 34):
        if out_channels != 64:
            raise _config_error("MODEL.RESNETS.RES2_OUT_CHANNELS", "64 for R18/R34", out_channels)
        if res5_dilation != 1:
            raise _config_error("MODEL.RESNETS.RES5_DILATION", "1 for R18/R34", res5_dilation)
        if num_groups != 1:
            raise _config_error("MODEL.RESNETS.NUM_GROUPS", "1 for R18/R34", num_groups)

    stages = []
    current_stride = stem.stride
    for idx, stage_idx in enumerate(range(2, 6)):
        name = f"res{stage_idx}"
        # res5_dilation is used this way as a convention in R-FCN & Deformable Conv paper
        dilation = res5_dilation if stage_idx == 5 else 1
        first_stride = 1 if idx == 0 or (stage_idx == 5 and dilation == 2) else 2
        current_stride *= first_stride
        n = num_blocks[depth][idx]
        stage_kargs = {
            "num_blocks": n,
            "stride_per_block": [first_stride] + [1] * (n - 1),
            "in_channels": in_channels,
            "out_channels": out_channels,
            "norm": norm,
        }
        augmented = name in aa_stages
        if augmented:
            stage_kargs.update(aa_layer_kwargs(cfg, name, current_stride))
        if depth in (18, 34):
            stage_kargs["block_class"] = AABasicBlock if augmented else BasicBlock
        else:
            stage_kargs["bottleneck_channels"] = bottleneck_channels
            stage_kargs["stride_in_1x1"] = stride_in_1x1
            stage_kargs["dilation"] = dilation
            stage_kargs["num_groups"] = num_groups
            stage_kargs["block_class"] = AABottleneckBlock if augmented else BottleneckBlock
        stages.append(ResNet.make_stage(**stage_kargs))
        in_channels = out_channels
        out_channels *= 2
        bottleneck_channels *= 2
    return ResNet(stem, stages, out_features=out_features, freeze_at=freeze_at)


register_fpn_builders("aa_resnet", build_aa_resnet_backbone)
