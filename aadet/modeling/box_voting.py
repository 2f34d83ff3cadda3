"""Box voting: refine each detection kept by NMS with the boxes it suppressed.

Gidaris & Komodakis, "Object detection via a multi-region & semantic segmentation-aware CNN model"
(ICCV 2015), section 5; Detectron (Caffe2) ships it as ``TEST.BBOX_VOTE`` with the scoring method
``"ID"``: each box NMS keeps is replaced by the score-weighted mean of all candidate boxes of its
class (before NMS, the kept box included) whose IoU with it is at least ``VOTE_TH``; scores and
classes are unchanged. Where one tree (or object) gets several slightly different boxes, their mean
localizes it better than the single highest-scoring one. aadet's RetinaNet applies it when
``TEST.BBOX_VOTE.ENABLED`` (off by default: not part of the papers).
"""
import torch
from detectron2.layers import batched_nms
from detectron2.structures import Boxes, Instances, pairwise_iou

from ..config import config_error
from ..layers.functional.checks import Interval, argument_error, check_in

__all__ = [
    "VOTE_THRESH_RANGE",
    "bbox_vote_thresh",
    "box_voting",
    "check_vote_thresh",
    "nms_and_vote",
]

#: The IoU at or above which a candidate votes (``TEST.BBOX_VOTE.VOTE_TH``; 0 means off where
#: a model or TTA takes the threshold).
VOTE_THRESH_RANGE = Interval(0.0, 1.0, high_closed=True)


def check_vote_thresh(value, name: str, error=argument_error) -> None:
    """``value`` is 0 (voting off) or in :data:`VOTE_THRESH_RANGE`."""
    if value != 0 or isinstance(value, bool):
        check_in(value, VOTE_THRESH_RANGE, name, error, " (or 0: off)")


def bbox_vote_thresh(cfg) -> float:
    """The vote IoU threshold the config asks for: ``TEST.BBOX_VOTE.VOTE_TH`` when
    ``TEST.BBOX_VOTE.ENABLED``, else 0 (off).

    Raises:
        ConfigValueError: ``VOTE_TH`` outside :data:`VOTE_THRESH_RANGE`, enabled or not.
    """
    vote = cfg.TEST.BBOX_VOTE
    check_in(vote.VOTE_TH, VOTE_THRESH_RANGE, "TEST.BBOX_VOTE.VOTE_TH", config_error)
    return float(vote.VOTE_TH) if vote.ENABLED else 0.0


def box_voting(kept: Instances, candidates: Instances, vote_thresh: float) -> Instances:
    """Replace the boxes of ``kept`` by the score-weighted mean of their voters.

    Args:
        kept: ``K`` detections (``pred_boxes``, ``scores``, ``pred_classes``), each of which is
            also in ``candidates`` (e.g. ``candidates[keep]`` after NMS), so every box has at least
            itself as a voter.
        candidates: ``N`` detections of the same image before NMS.
        vote_thresh: IoU (:data:`VOTE_THRESH_RANGE`; not checked here: the model and TTA check
            theirs when built) at or above which a candidate of the same class votes.

    Returns:
        ``kept``, its ``pred_boxes [K, 4]`` replaced in place (``sum_j s_j b_j / sum_j s_j`` over
        voters ``j``; an empty box, which overlaps nothing, keeps its own); the other fields as
        they were. No branch depends on ``K`` or ``N``, so a traced graph works for any count.
    """
    iou = pairwise_iou(kept.pred_boxes, candidates.pred_boxes)  # [K, N]
    same_class = kept.pred_classes[:, None] == candidates.pred_classes[None, :]  # [K, N]
    boxes = candidates.pred_boxes.tensor  # [N, 4]
    weights = ((iou >= vote_thresh) & same_class).to(boxes.dtype)
    weights = weights * candidates.scores.to(boxes.dtype)[None, :]  # [K, N]
    total = weights.sum(dim=1, keepdim=True)  # [K, 1]
    # A box has IoU 0 with itself when it is empty (clipped to the image border): it keeps its box.
    voted = torch.where(
        total > 0, (weights @ boxes) / total.clamp_min(torch.finfo(total.dtype).tiny), kept.pred_boxes.tensor
    )  # [K, 4]
    kept.pred_boxes = Boxes(voted)
    return kept


def nms_and_vote(
    candidates: Instances, nms_thresh: float, max_detections: int, vote_thresh: float = 0.0
) -> Instances:
    """RetinaNet's last inference step: class-wise NMS, the ``max_detections`` highest-scoring
    survivors, then box voting with all ``candidates`` when ``vote_thresh`` is not 0.

    Args:
        candidates: ``N`` detections of one image (``pred_boxes``, ``scores``, ``pred_classes``).
        nms_thresh: IoU above which a lower-scoring box of the same class is suppressed.
        max_detections: how many of NMS's survivors to keep, best first.
        vote_thresh: 0 (off) or the IoU of :func:`box_voting`.

    Returns:
        ``K <= max_detections`` detections, ordered by score. With voting off this is exactly
        Detectron2's ``RetinaNet.inference_single_image`` after decoding.
    """
    keep = batched_nms(candidates.pred_boxes.tensor, candidates.scores, candidates.pred_classes, nms_thresh)
    kept = candidates[keep[:max_detections]]
    return box_voting(kept, candidates, vote_thresh) if vote_thresh else kept
