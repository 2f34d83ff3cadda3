"""aadet: self-attention (AA, SASA, HaloNet and CCNet) backbones, FPN and heads for Detectron2 detectors.

Importing ``aadet`` registers its backbones, heads and meta-architecture in Detectron2's
registries; :func:`add_aadet_config` adds its config keys.
"""
from .config import add_aadet_config, validate_aadet_config  # noqa: F401
from . import modeling  # noqa: F401  (registers backbones, heads, meta-archs)

__version__ = "0.1.0"
