"""Test-time augmentation for RetinaNet: Detectron2's ``TEST.AUG`` keys, for one-stage detectors.

Detectron2 ships TTA for R-CNNs only (``GeneralizedRCNNWithTTA``). :class:`RetinaNetWithTTA`
follows it: the same augmented inputs (``DatasetMapperTTA``: each ``TEST.AUG.MIN_SIZES`` resize,
each with a horizontal flip when ``TEST.AUG.FLIP``), each run through the detector, its boxes
mapped back to the original image by the inverse of the input's transforms, and the union merged
by class-wise NMS (``MODEL.RETINANET.NMS_THRESH_TEST``) down to ``TEST.DETECTIONS_PER_IMAGE``,
the same post-processing one pass ends with (box voting too, over the union of the passes'
detections, when ``TEST.BBOX_VOTE.ENABLED``). Its ``forward`` takes and returns what the
detector's does in eval mode, so ``inference_on_dataset`` and evaluators need no change.
"""
from typing import Dict, List

import torch
from detectron2.modeling import DatasetMapperTTA
from detectron2.structures import Boxes, Instances
from torch import nn

from ..utils.modules import unwrap_model
from .box_voting import bbox_vote_thresh, nms_and_vote

__all__ = ["RetinaNetWithTTA"]


class RetinaNetWithTTA(nn.Module):
    """A RetinaNet (any one-stage detector returning ``{"instances": Instances}`` per image with
    ``pred_boxes``, ``scores`` and ``pred_classes``) with test-time augmentation."""

    def __init__(self, cfg, model: nn.Module, tta_mapper=None, batch_size: int = 3):
        """
        Args:
            cfg: the config; ``TEST.AUG.*``, ``MODEL.RETINANET.NMS_THRESH_TEST``,
                ``TEST.DETECTIONS_PER_IMAGE`` and ``TEST.BBOX_VOTE.*`` are read.
            model: the detector (a DDP wrapper is unwrapped).
            tta_mapper: dataset dict -> list of augmented dicts, each with ``"transforms"``
                (original -> augmented image); default ``DatasetMapperTTA(cfg)``.
            batch_size: augmented images per forward pass.
        """
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"RetinaNetWithTTA: batch_size must be >= 1, got {batch_size}")
        self.model = unwrap_model(model)
        self.tta_mapper = DatasetMapperTTA(cfg) if tta_mapper is None else tta_mapper
        self.batch_size = batch_size
        self.nms_thresh = cfg.MODEL.RETINANET.NMS_THRESH_TEST
        self.max_detections = cfg.TEST.DETECTIONS_PER_IMAGE
        self.vote_thresh = bbox_vote_thresh(cfg)

    def forward(self, batched_inputs: List[Dict]) -> List[Dict[str, Instances]]:
        """Same interface as the detector's eval-mode forward: one dict per image with
        ``"image"`` (C x H x W, possibly already resized) and ``"height"``/``"width"`` of the
        original image; returns ``[{"instances": Instances}]`` in original-image coordinates."""
        return [{"instances": self._inference_one(x)} for x in batched_inputs]

    def _inference_one(self, inp: Dict) -> Instances:
        augmented = self.tta_mapper(inp)
        parts = []
        for start in range(0, len(augmented), self.batch_size):
            chunk = augmented[start : start + self.batch_size]
            # height/width = the augmented image's: the detector returns boxes in its frame.
            outs = self.model(
                [
                    {"image": a["image"], "height": a["image"].shape[1], "width": a["image"].shape[2]}
                    for a in chunk
                ]
            )
            for a, out in zip(chunk, outs):
                r = out["instances"]
                boxes = r.pred_boxes.tensor.detach().cpu().numpy()
                back = a["transforms"].inverse().apply_box(boxes)
                parts.append(
                    (
                        torch.as_tensor(back, dtype=r.pred_boxes.tensor.dtype),
                        r.scores.cpu(),
                        r.pred_classes.cpu(),
                    )
                )
        return self._merge(parts, (inp["height"], inp["width"]))

    def _merge(self, parts, image_size) -> Instances:
        boxes = torch.cat([p[0] for p in parts])
        scores = torch.cat([p[1] for p in parts])
        classes = torch.cat([p[2] for p in parts])
        out_boxes = Boxes(boxes)
        out_boxes.clip(image_size)
        candidates = Instances(image_size, pred_boxes=out_boxes, scores=scores, pred_classes=classes)
        return nms_and_vote(candidates, self.nms_thresh, self.max_detections, self.vote_thresh)
