"""Utilities: readable drawings of detections and ground truth (:mod:`aadet.utils.visualizer`),
looking through DDP wrappers (:func:`~aadet.utils.modules.unwrap_model`), the tools' image reading
(:mod:`aadet.utils.images`), and the one module that touches Detectron2 and fvcore internals
(:mod:`aadet.utils.d2compat`).

The utils floor sits under ``aadet.modeling``: nothing here imports from aadet above ``aadet.layers``.
"""

from .visualizer import draw_instances, enlarge_factor, side_by_side  # noqa: F401
from .modules import unwrap_model  # noqa: F401
