"""Utilities: readable drawings of detections and ground truth (:mod:`aadet.utils.visualizer`), and
looking through DDP wrappers (:func:`~aadet.utils.modules.unwrap_model`)."""

from .visualizer import draw_instances, enlarge_factor, side_by_side  # noqa: F401
from .modules import unwrap_model  # noqa: F401
