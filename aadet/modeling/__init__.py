from . import backbone, meta_arch  # noqa: F401
from . import attention_fpn, attention_head  # noqa: F401  (register the SASA FPN/head)
