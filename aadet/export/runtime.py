"""Running an exported detector, and comparing its detections with the PyTorch model's."""
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch
from detectron2.data import transforms as T
from detectron2.modeling.postprocessing import detector_postprocess
from detectron2.structures import Boxes, Instances

from .tracing import OUTPUT_NAMES

__all__ = ["DetectionMatch", "ExportedDetector", "match_detections"]


class ExportedDetector:
    """A ``model.onnx`` (onnxruntime, CPU) or ``model.ts`` (``torch.jit.load``) written by
    :func:`~aadet.export.export_model`, used like the :class:`~aadet.engine.Predictor`.

    Call with a ``[H, W, 3]`` uint8 image in the exported channel order (``INPUT.FORMAT``);
    returns ``{"instances": Instances}`` in original-image coordinates: the Predictor's resize
    before the graph, Detectron2's ``detector_postprocess`` rescale after it. :meth:`run` takes
    the model input itself (``[3, H, W]`` float32) and returns the graph's detections.
    """

    def __init__(self, path: str):
        meta_path = path + ".json"
        if not os.path.isfile(path):
            raise FileNotFoundError(f"exported model not found: {path}")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(
                f"{meta_path} (written by tools/export_model.py next to the model) not found: "
                "it records the input size and format the model was exported for"
            )
        with open(meta_path) as f:
            self.meta = json.load(f)
        self.format = self.meta["format"]
        self.input_shape = tuple(self.meta["input"]["shape"])  # (3, H, W)
        self.input_format = self.meta["input"]["channels"]
        resize = self.meta["test_resize"]
        self.aug = T.ResizeShortestEdge([resize["min_size"]] * 2, resize["max_size"])
        if self.format == "onnx":
            try:
                import onnxruntime as ort
            except ImportError as e:
                raise ImportError(
                    "running ONNX models needs onnxruntime: pip install -e '.[export]'"
                ) from e
            self._session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            names = tuple(o.name for o in self._session.get_outputs())
            if names != OUTPUT_NAMES:
                raise ValueError(f"{path}: outputs {names}, expected {OUTPUT_NAMES}")
        elif self.format == "torchscript":
            self._module = torch.jit.load(path, map_location="cpu").eval()
        else:
            raise ValueError(f"{meta_path}: unknown format {self.format!r}")

    def run(self, image: torch.Tensor) -> Instances:
        """``[3, H, W]`` float32 model input (the export's ``H x W``) -> detections in its pixels."""
        shape = tuple(image.shape)
        if len(shape) != 3 or shape[0] != 3:
            raise ValueError(f"image must be [3, H, W]; got {list(shape)}")
        if shape != self.input_shape:
            raise ValueError(
                f"this {self.format} model was exported for inputs of shape {list(self.input_shape)} "
                f"(after the test-time resize); got {list(shape)}. Export again for this size: "
                f"tools/export_model.py --input-size {shape[1]} {shape[2]}"
            )
        image = image.detach().to("cpu", torch.float32)
        if self.format == "onnx":
            outs = [torch.from_numpy(o) for o in self._session.run(None, {"image": image.numpy()})]
        else:
            with torch.no_grad():
                outs = list(self._module(image))
        boxes, classes, scores, _ = outs
        return Instances(
            tuple(shape[1:]), pred_boxes=Boxes(boxes), pred_classes=classes, scores=scores
        )

    def __call__(self, image: np.ndarray) -> dict:
        height, width = image.shape[:2]
        resized = self.aug.get_transform(image).apply_image(image)
        tensor = torch.as_tensor(np.ascontiguousarray(resized.transpose(2, 0, 1)).astype("float32"))
        return {"instances": detector_postprocess(self.run(tensor), height, width)}


@dataclass
class DetectionMatch:
    """Result of :func:`match_detections` (``ok``: every detection matched, or borderline)."""

    num_ref: int
    num_other: int
    matched: int
    max_box_diff: float  # px, over matched pairs
    max_score_diff: float
    unmatched_ref: List[float] = field(default_factory=list)  # scores of unmatched detections
    unmatched_other: List[float] = field(default_factory=list)
    ok: bool = True


def match_detections(
    ref: Instances,
    other: Instances,
    *,
    box_tol: float = 1e-2,
    score_tol: float = 1e-4,
    score_thresh: Optional[float] = None,
    max_dets: Optional[int] = None,
) -> DetectionMatch:
    """Pair the detections of two runs of one model (eager vs exported) one to one.

    A pair has the same class, scores within ``score_tol`` and every box coordinate within
    ``box_tol`` pixels (greedy, highest reference score first, closest box). Detections left
    unpaired are acceptable only where rounding may legitimately flip them: a score within
    ``score_tol`` of the score threshold, or, when a run returned ``max_dets`` detections, of its
    lowest kept score (the top-k cut). Anything else makes ``ok`` False.
    """
    rb, rs, rc = (ref.pred_boxes.tensor.double(), ref.scores.double(), ref.pred_classes)
    ob, os_, oc = (other.pred_boxes.tensor.double(), other.scores.double(), other.pred_classes)
    used = torch.zeros(len(os_), dtype=torch.bool)
    box_diffs, score_diffs, unmatched_ref = [], [], []
    for i in torch.argsort(rs, descending=True).tolist():
        bd = (ob - rb[i]).abs().amax(dim=1) if len(ob) else ob.new_zeros(0)
        sd = (os_ - rs[i]).abs()
        ok = (~used) & (oc == rc[i]) & (sd <= score_tol) & (bd <= box_tol)
        if not ok.any():
            unmatched_ref.append(float(rs[i]))
            continue
        j = int(torch.where(ok, bd, torch.full_like(bd, float("inf"))).argmin())
        used[j] = True
        box_diffs.append(float(bd[j]))
        score_diffs.append(float(sd[j]))
    unmatched_other = [float(s) for s in os_[~used]]

    def borderline(score, scores):
        near_thresh = score_thresh is not None and score <= score_thresh + score_tol
        near_cut = max_dets is not None and len(scores) >= max_dets and score <= float(
            scores.min()
        ) + score_tol
        return near_thresh or near_cut

    ok = all(borderline(s, rs) for s in unmatched_ref) and all(
        borderline(s, os_) for s in unmatched_other
    )
    return DetectionMatch(
        num_ref=len(rs),
        num_other=len(os_),
        matched=len(box_diffs),
        max_box_diff=max(box_diffs, default=0.0),
        max_score_diff=max(score_diffs, default=0.0),
        unmatched_ref=unmatched_ref,
        unmatched_other=unmatched_other,
        ok=ok,
    )
