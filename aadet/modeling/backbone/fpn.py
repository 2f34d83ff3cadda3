"""FPN builders shared by every bottom-up network (conv ResNet, AA-ResNet, SASA-ResNet).

For each bottom-up builder ``build_<name>_backbone`` registered in ``BACKBONE_REGISTRY``,
:func:`register_fpn_builders` registers two more, the way Detectron2 names its own:

* ``build_<name>_fpn_backbone``: FPN P2-P6 (P6 by max pooling), as Detectron2's R-CNN FPN;
* ``build_retinanet_<name>_fpn_backbone``: FPN with RetinaNet's P6/P7 (stride-2 3x3 convs),
  taken from ``res5`` or ``p5`` (``MODEL.FPN.P6P7_SOURCE``; the AA paper's RetinaNet uses P5).
  P6/P7 are only built when ``MODEL.RETINANET.IN_FEATURES`` asks for them.

``MODEL.FPN.SPATIAL_LAYER`` picks what makes the FPN's 3x3 outputs and P6/P7: "conv", or
"attention" (SASA's attentional FPN), through ``FPN_SPATIAL_LAYER_REGISTRY``.
"""
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone import BACKBONE_REGISTRY
from detectron2.modeling.backbone.fpn import FPN, LastLevelMaxPool, LastLevelP6P7
from detectron2.utils.registry import Registry

__all__ = ["FPN_SPATIAL_LAYER_REGISTRY", "build_fpn", "register_fpn_builders"]

FPN_SPATIAL_LAYER_REGISTRY = Registry("FPN_SPATIAL_LAYER")
FPN_SPATIAL_LAYER_REGISTRY.__doc__ = """
Converters ``fn(fpn: FPN, cfg) -> FPN`` (registered under their function's name) that replace the spatial layers of a built FPN
(its 3x3 output convs and the P6/P7 convs). Selected by ``MODEL.FPN.SPATIAL_LAYER``.
"""


@FPN_SPATIAL_LAYER_REGISTRY.register()
def conv(fpn, cfg):
    """Keep Detectron2's 3x3 output convs and P6/P7 convs."""
    return fpn


def build_fpn(cfg, bottom_up, retinanet: bool):
    """Build an FPN over ``bottom_up``; ``retinanet`` selects P6/P7 convs over P6 pooling."""
    out_channels = cfg.MODEL.FPN.OUT_CHANNELS
    if retinanet:
        wants_p67 = any(f in ("p6", "p7") for f in cfg.MODEL.RETINANET.IN_FEATURES)
        if not wants_p67:
            top_block = None
        elif cfg.MODEL.FPN.P6P7_SOURCE == "p5":
            top_block = LastLevelP6P7(out_channels, out_channels, in_feature="p5")
        else:
            in_ch = bottom_up.output_shape()["res5"].channels
            top_block = LastLevelP6P7(in_ch, out_channels, in_feature="res5")
    else:
        top_block = LastLevelMaxPool()
    fpn = FPN(
        bottom_up=bottom_up,
        in_features=cfg.MODEL.FPN.IN_FEATURES,
        out_channels=out_channels,
        norm=cfg.MODEL.FPN.NORM,
        top_block=top_block,
        fuse_type=cfg.MODEL.FPN.FUSE_TYPE,
    )
    return FPN_SPATIAL_LAYER_REGISTRY.get(cfg.MODEL.FPN.SPATIAL_LAYER)(fpn, cfg)


def register_fpn_builders(name: str, bottom_up_builder):
    """Register ``build_<name>_fpn_backbone`` and ``build_retinanet_<name>_fpn_backbone``."""

    def fpn_builder(cfg, input_shape: ShapeSpec):
        return build_fpn(cfg, bottom_up_builder(cfg, input_shape), retinanet=False)

    def retinanet_builder(cfg, input_shape: ShapeSpec):
        return build_fpn(cfg, bottom_up_builder(cfg, input_shape), retinanet=True)

    for fn, fn_name in ((fpn_builder, f"build_{name}_fpn_backbone"),
                        (retinanet_builder, f"build_retinanet_{name}_fpn_backbone")):
        fn.__name__ = fn.__qualname__ = fn_name
        fn.__doc__ = f"{'RetinaNet ' if 'retinanet' in fn_name else ''}FPN over ``{bottom_up_builder.__name__}``."
        BACKBONE_REGISTRY.register(fn)
    return fpn_builder, retinanet_builder
