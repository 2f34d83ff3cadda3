from .retinanet import RETINANET_HEAD_REGISTRY, AADetRetinaNet, NonFiniteLossError  # noqa: F401
