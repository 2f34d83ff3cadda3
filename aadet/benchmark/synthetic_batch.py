"""Random detection batches: the inputs of ``tools/benchmark.py`` and of the GPU check's short
trainings (``dev/gpu_check.py``), the same for every model and seed.

:func:`make_batch` draws plain tensors (a dict that ``torch.save`` stores for a worker process);
:func:`detectron2_inputs` turns them into a Detectron2 model's ``batched_inputs``.
"""
from typing import Dict, List

import torch
from detectron2.structures import Boxes, Instances

__all__ = ["BOXES_PER_IMAGE", "NUM_CLASS_IDS", "make_batch", "detectron2_inputs"]

BOXES_PER_IMAGE = 8
NUM_CLASS_IDS = 1000  # class ids are drawn in [0, 1000) and taken modulo each model's NUM_CLASSES


def make_batch(batch: int, height: int, width: int, seed: int) -> Dict:
    """``batch`` random BGR images ``[3, H, W]`` (float, 0-255) with ``BOXES_PER_IMAGE`` random
    boxes each (16 px to half the image side) and class ids in ``[0, NUM_CLASS_IDS)``.

    Returns:
        ``{"images": [[3, H, W]], "boxes": [[BOXES_PER_IMAGE, 4]] (XYXY), "classes":
        [[BOXES_PER_IMAGE]], "height": H, "width": W}``.
    """
    g = torch.Generator().manual_seed(seed)
    images, boxes, classes = [], [], []
    for _ in range(batch):
        images.append(torch.randint(0, 256, (3, height, width), generator=g).float())
        hi = max(17, min(height, width) // 2)
        wh = torch.randint(16, hi, (BOXES_PER_IMAGE, 2), generator=g).float()
        x0 = torch.rand(BOXES_PER_IMAGE, generator=g) * (width - wh[:, 0])
        y0 = torch.rand(BOXES_PER_IMAGE, generator=g) * (height - wh[:, 1])
        boxes.append(torch.stack([x0, y0, x0 + wh[:, 0], y0 + wh[:, 1]], dim=1))
        classes.append(torch.randint(0, NUM_CLASS_IDS, (BOXES_PER_IMAGE,), generator=g))
    return {"images": images, "boxes": boxes, "classes": classes, "height": height, "width": width}


def detectron2_inputs(data: Dict, num_classes: int, *, with_instances: bool = True, device=None) -> List[Dict]:
    """A Detectron2 model's ``batched_inputs`` from :func:`make_batch`'s ``data``: per image
    ``{"image", "height", "width"}`` and, ``with_instances``, ``"instances"`` (``gt_boxes``,
    ``gt_classes`` = class id modulo ``num_classes``). ``device``: where the tensors go (None:
    where they are; the model moves images itself)."""

    def put(t: torch.Tensor) -> torch.Tensor:
        return t if device is None else t.to(device)

    height, width = data["height"], data["width"]
    out = []
    for img, b, c in zip(data["images"], data["boxes"], data["classes"]):
        d = {"image": put(img), "height": height, "width": width}
        if with_instances:
            inst = Instances((height, width))
            inst.gt_boxes = Boxes(put(b.clone()))
            inst.gt_classes = put(c % num_classes)
            d["instances"] = inst
        out.append(d)
    return out
