from . import backbone, meta_arch  # noqa: F401
from . import attention_head  # noqa: F401  (registers the SASA head)
from .test_time_augmentation import RetinaNetWithTTA  # noqa: F401
