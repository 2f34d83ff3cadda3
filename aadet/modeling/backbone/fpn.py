"""RetinaNet's FPN over any bottom-up network (conv ResNet, AA-ResNet, SASA-ResNet).

:func:`build_retinanet_fpn` builds Detectron2's ``FPN`` with RetinaNet's P6/P7 (stride-2 3x3
convs), taken from ``res5`` or ``p5`` (``MODEL.FPN.P6P7_SOURCE``; the AA paper's RetinaNet uses
P5), built only when ``MODEL.RETINANET.IN_FEATURES`` asks for them. ``MODEL.FPN.SPATIAL_LAYER``
then picks what makes the FPN's 3x3 outputs and P6/P7, through ``FPN_SPATIAL_LAYER_REGISTRY``
(defined in :mod:`aadet.config`, whose check accepts exactly its names; re-exported here):
"conv" (:func:`keep_conv_spatial_layers`) or "attention" (SASA's attentional FPN,
:func:`~aadet.modeling.backbone.attention_fpn.attention_spatial_layers`).

Registered backbone builders (one per bottom-up network, each a plain ``def`` next to its
bottom-up builder): ``build_retinanet_conv_resnet_fpn_backbone`` (here: Detectron2's ResNet),
``build_retinanet_aa_resnet_fpn_backbone``, ``build_retinanet_sasa_resnet_fpn_backbone``.
"""
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN, LastLevelP6P7
from detectron2.modeling.backbone.resnet import BasicStem

from ...config import FPN_SPATIAL_LAYER_REGISTRY
from .resnet_stages import build_resnet

__all__ = [
    "FPN_SPATIAL_LAYER_REGISTRY",
    "build_retinanet_fpn",
    "keep_conv_spatial_layers",
    "build_retinanet_conv_resnet_fpn_backbone",
]


@FPN_SPATIAL_LAYER_REGISTRY.register("conv")
def keep_conv_spatial_layers(fpn: FPN, cfg) -> FPN:
    """``MODEL.FPN.SPATIAL_LAYER = "conv"``: keep Detectron2's 3x3 output convs and P6/P7 convs."""
    return fpn


def build_retinanet_fpn(cfg, bottom_up) -> FPN:
    """RetinaNet's FPN over ``bottom_up`` (P6/P7 convs if asked for), spatial layers converted by
    the ``MODEL.FPN.SPATIAL_LAYER`` entry of ``FPN_SPATIAL_LAYER_REGISTRY``."""
    out_channels = cfg.MODEL.FPN.OUT_CHANNELS
    if not any(f in ("p6", "p7") for f in cfg.MODEL.RETINANET.IN_FEATURES):
        top_block = None
    elif cfg.MODEL.FPN.P6P7_SOURCE == "p5":
        top_block = LastLevelP6P7(out_channels, out_channels, in_feature="p5")
    else:
        in_channels = bottom_up.output_shape()["res5"].channels
        top_block = LastLevelP6P7(in_channels, out_channels, in_feature="res5")
    fpn = FPN(
        bottom_up=bottom_up,
        in_features=cfg.MODEL.FPN.IN_FEATURES,
        out_channels=out_channels,
        norm=cfg.MODEL.FPN.NORM,
        top_block=top_block,
        fuse_type=cfg.MODEL.FPN.FUSE_TYPE,
    )
    return FPN_SPATIAL_LAYER_REGISTRY.get(cfg.MODEL.FPN.SPATIAL_LAYER)(fpn, cfg)


@BACKBONE_REGISTRY.register()
def build_retinanet_conv_resnet_fpn_backbone(cfg, input_shape: ShapeSpec) -> FPN:
    """The convolutional baseline: RetinaNet FPN over Detectron2's ResNet.

    :func:`~.resnet_stages.build_resnet` with Detectron2's blocks and stem: the same network as
    Detectron2's ``build_resnet_backbone`` at its depths (``tests/modeling/test_resnet_stages.py``), and
    also the SASA paper's conv ResNet-26/38 baselines.
    """
    r = cfg.MODEL.RESNETS
    stem = BasicStem(in_channels=input_shape.channels, out_channels=r.STEM_OUT_CHANNELS, norm=r.NORM)
    resnet = build_resnet(
        cfg, stem, block_for_stage=lambda stage: None,
        builder="build_retinanet_conv_resnet_fpn_backbone",
    )
    return build_retinanet_fpn(cfg, resnet)
