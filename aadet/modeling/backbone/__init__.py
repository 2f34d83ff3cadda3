from detectron2.modeling.backbone import build_resnet_backbone

from .aa_resnet import build_aa_resnet_backbone  # noqa: F401
from .fpn import FPN_SPATIAL_LAYER_REGISTRY, build_fpn, register_fpn_builders  # noqa: F401
from .sasa_resnet import build_sasa_resnet_backbone  # noqa: F401

# The convolutional baseline: Detectron2's ResNet under our FPN builders (P6/P7 source, levels).
register_fpn_builders("conv_resnet", build_resnet_backbone)
