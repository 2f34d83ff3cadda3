"""Bottom-up networks (AA-ResNet, SASA-ResNet, HaloNet-ResNet on one shared ResNet stage builder,
CCNet's ResNet with one RCCA module) and RetinaNet's FPN over them, each registered in
Detectron2's ``BACKBONE_REGISTRY``; the registry
of the FPN's spatial layers (``FPN_SPATIAL_LAYER_REGISTRY``) lives beside the FPN (:mod:`.fpn`)."""
from .fpn import (  # noqa: F401
    FPN_SPATIAL_LAYER_REGISTRY,
    build_retinanet_conv_resnet_fpn_backbone,
    build_retinanet_fpn,
    spatial_layer_options,
)
from .attention_fpn import convert_fpn_to_attention  # noqa: F401
from .resnet_stages import ResNetStage, build_resnet  # noqa: F401
from .aa_resnet import build_aa_resnet_backbone, build_retinanet_aa_resnet_fpn_backbone  # noqa: F401
from .sasa_resnet import build_retinanet_sasa_resnet_fpn_backbone, build_sasa_resnet_backbone  # noqa: F401
from .halo_resnet import build_halo_resnet_backbone, build_retinanet_halo_resnet_fpn_backbone  # noqa: F401
from .ccnet_resnet import build_ccnet_resnet_backbone, build_retinanet_ccnet_resnet_fpn_backbone  # noqa: F401
