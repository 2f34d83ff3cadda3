"""Utilities: readable drawings of detections and ground truth (:mod:`aadet.utils.visualizer`)."""

from .visualizer import draw_instances, enlarge_factor, side_by_side  # noqa: F401
