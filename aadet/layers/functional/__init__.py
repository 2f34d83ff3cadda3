"""Pure tensor functions: the exact attention computations the layers are built on."""
from .logit_tables import MASK_VALUE, attention_with_logit_tables  # noqa: F401
