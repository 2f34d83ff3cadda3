from detectron2.modeling.backbone import build_resnet_backbone

from .fpn import FPN_SPATIAL_LAYER_REGISTRY, build_fpn, register_fpn_builders

# The convolutional baseline: Detectron2's ResNet under our FPN builders (P6/P7 source, levels).
register_fpn_builders("conv_resnet", build_resnet_backbone)
