from .retinanet import RETINANET_HEAD_REGISTRY, AADetRetinaNet, build_retinanet_head  # noqa: F401
