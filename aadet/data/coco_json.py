"""Writing COCO detection json: the one builder the demo preparation and the synthetic data share."""
from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = ["build_coco_dict"]


def build_coco_dict(
    images: Sequence[Tuple[str, int, int, np.ndarray]],
    categories: Sequence[dict],
    category_id: int = 1,
    info: Optional[dict] = None,
) -> dict:
    """A COCO detection dict from ``(file_name, width, height, boxes)`` per image.

    ``boxes`` is ``[K, 4]`` XYXY pixels; every box gets ``category_id``. Image and annotation ids
    start at 1 in the given order; ``bbox`` is ``[x, y, w, h]`` floats, ``area = w * h``,
    ``iscrowd = 0``.
    """
    coco_images, annotations = [], []
    for image_id, (file_name, width, height, boxes) in enumerate(images, start=1):
        coco_images.append(
            {"id": image_id, "file_name": file_name, "height": int(height), "width": int(width)}
        )
        for x0, y0, x1, y1 in np.asarray(boxes, dtype=np.float64).reshape(-1, 4).tolist():
            w, h = x1 - x0, y1 - y0
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": category_id,
                    "bbox": [x0, y0, w, h],
                    "area": w * h,
                    "iscrowd": 0,
                }
            )
    out = {
        "images": coco_images,
        "annotations": annotations,
        "categories": [dict(c) for c in categories],
    }
    if info is not None:
        out = {"info": dict(info), **out}
    return out
