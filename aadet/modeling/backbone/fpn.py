"""RetinaNet's FPN over any bottom-up network (conv ResNet, AA-ResNet, SASA-ResNet), and the
registry of the layers that make its spatial outputs.

:func:`build_retinanet_fpn` builds Detectron2's ``FPN`` with RetinaNet's P6/P7 (stride-2 3x3
convs), taken from ``res5`` or ``p5`` (``MODEL.FPN.P6P7_SOURCE``; the AA paper's RetinaNet uses
P5), built only when ``MODEL.RETINANET.IN_FEATURES`` asks for them. ``MODEL.FPN.SPATIAL_LAYER``
then picks what makes the FPN's 3x3 outputs and P6/P7, a name in
:data:`FPN_SPATIAL_LAYER_REGISTRY`: "conv" (:func:`keep_conv_spatial_layers`) or "attention"
(SASA's attentional FPN, :func:`~aadet.modeling.backbone.attention_fpn.convert_fpn_to_attention`).

Registered backbone builders (one per bottom-up network, each a plain ``def`` next to its
bottom-up builder): ``build_retinanet_conv_resnet_fpn_backbone`` (here: Detectron2's ResNet),
``build_retinanet_aa_resnet_fpn_backbone``, ``build_retinanet_sasa_resnet_fpn_backbone``.
"""
import functools
from typing import Any, Callable, Dict, Optional, Sequence

from detectron2.config import configurable
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone import BACKBONE_REGISTRY, Backbone
from detectron2.modeling.backbone.fpn import FPN, LastLevelP6P7

from ...config import config_error
from ...layers.functional.checks import check_one_of
from ...utils.d2compat import NamedRegistry
from .resnet_stages import basic_stem, build_resnet

__all__ = [
    "FPN_SPATIAL_LAYER_REGISTRY",
    "P6P7_SOURCES",
    "build_fpn_spatial_layers",
    "build_retinanet_fpn",
    "keep_conv_spatial_layers",
    "build_retinanet_conv_resnet_fpn_backbone",
]

#: ``MODEL.FPN.P6P7_SOURCE``: the feature P6 is computed from.
P6P7_SOURCES = ("res5", "p5")

FPN_SPATIAL_LAYER_REGISTRY = NamedRegistry("FPN_SPATIAL_LAYER")  # MODEL.FPN.SPATIAL_LAYER
FPN_SPATIAL_LAYER_REGISTRY.__doc__ = """
Converters ``fn(cfg, fpn: FPN) -> FPN`` that replace the spatial layers of a built FPN (its 3x3
output convs and the P6/P7 convs), registered with ``register("<MODEL.FPN.SPATIAL_LAYER value>")``
(here and in attention_fpn.py; ``@configurable`` functions, so each also takes plain arguments).
:func:`build_fpn_spatial_layers` accepts exactly the registered names.
"""


@FPN_SPATIAL_LAYER_REGISTRY.register("conv")
def keep_conv_spatial_layers(cfg, fpn: FPN) -> FPN:
    """``MODEL.FPN.SPATIAL_LAYER = "conv"``: keep Detectron2's 3x3 output convs and P6/P7 convs."""
    return fpn


def build_fpn_spatial_layers(cfg, fpn: FPN) -> FPN:
    """Convert ``fpn`` by the ``MODEL.FPN.SPATIAL_LAYER`` entry of :data:`FPN_SPATIAL_LAYER_REGISTRY`.

    Raises:
        ConfigValueError: for a name not registered (the message lists the registered ones).
    """
    name = cfg.MODEL.FPN.SPATIAL_LAYER
    check_one_of(
        name, sorted(n for n, _ in FPN_SPATIAL_LAYER_REGISTRY), "MODEL.FPN.SPATIAL_LAYER",
        config_error, " (names in FPN_SPATIAL_LAYER_REGISTRY)",
    )
    return FPN_SPATIAL_LAYER_REGISTRY.get(name)(cfg, fpn)


def _retinanet_fpn_from_config(cfg, bottom_up: Backbone) -> Dict[str, Any]:
    """``MODEL.FPN.*`` and ``MODEL.RETINANET.IN_FEATURES`` -> :func:`build_retinanet_fpn`'s
    arguments."""
    f = cfg.MODEL.FPN
    check_one_of(f.P6P7_SOURCE, P6P7_SOURCES, "MODEL.FPN.P6P7_SOURCE", config_error)
    p6p7 = any(name in ("p6", "p7") for name in cfg.MODEL.RETINANET.IN_FEATURES)
    return dict(
        bottom_up=bottom_up,
        in_features=f.IN_FEATURES,
        out_channels=f.OUT_CHANNELS,
        norm=f.NORM,
        fuse_type=f.FUSE_TYPE,
        p6p7_source=f.P6P7_SOURCE if p6p7 else None,
        spatial_layers=functools.partial(build_fpn_spatial_layers, cfg),
    )


@configurable(from_config=_retinanet_fpn_from_config)
def build_retinanet_fpn(
    bottom_up: Backbone,
    *,
    in_features: Sequence[str],
    out_channels: int,
    norm,
    fuse_type: str,
    p6p7_source: Optional[str] = None,
    spatial_layers: Optional[Callable[[FPN], FPN]] = None,
) -> FPN:
    """RetinaNet's FPN over ``bottom_up``: Detectron2's ``FPN`` (``in_features``,
    ``out_channels``, ``norm``, ``fuse_type`` as there), with P6/P7 computed from
    ``p6p7_source`` (one of :data:`P6P7_SOURCES`; None: no P6/P7), then ``spatial_layers(fpn)``
    (None: keep the convs; from the config, :func:`build_fpn_spatial_layers`).
    """
    if p6p7_source is None:
        top_block = None
    elif p6p7_source == "p5":
        top_block = LastLevelP6P7(out_channels, out_channels, in_feature="p5")
    else:
        in_channels = bottom_up.output_shape()[p6p7_source].channels
        top_block = LastLevelP6P7(in_channels, out_channels, in_feature=p6p7_source)
    fpn = FPN(
        bottom_up=bottom_up,
        in_features=in_features,
        out_channels=out_channels,
        norm=norm,
        top_block=top_block,
        fuse_type=fuse_type,
    )
    return fpn if spatial_layers is None else spatial_layers(fpn)


@BACKBONE_REGISTRY.register()
def build_retinanet_conv_resnet_fpn_backbone(cfg, input_shape: ShapeSpec) -> FPN:
    """The convolutional baseline: RetinaNet FPN over Detectron2's ResNet.

    :func:`~.resnet_stages.build_resnet` with Detectron2's blocks and stem: the same network as
    Detectron2's ``build_resnet_backbone`` at its depths (``tests/modeling/test_resnet_stages.py``), and
    also the SASA paper's conv ResNet-26/38 baselines.
    """
    resnet = build_resnet(
        cfg, stem=basic_stem(cfg, input_shape), builder="build_retinanet_conv_resnet_fpn_backbone"
    )
    return build_retinanet_fpn(cfg, resnet)
