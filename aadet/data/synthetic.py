"""A small synthetic COCO dataset like a user's own microscopy data: tiny objects in small tiles.

What new users bring: 128 px tiles cut from one microscopy image, a few dozen boxes of
3-38 px -- objects far smaller than COCO's, and often elongated (rods, not discs). This module makes
such a dataset from a seed, deterministically, so that the recipe derived by
:mod:`aadet.data.statistics` can be tested against the demo's guessed anchors without shipping data.

Each tile is textured noise (a blurred random field plus pixel noise, grey-green like a stained
slide) with ``objects_per_tile`` bright objects that do not overlap:

* ``"blob"``: a filled ellipse with a soft (anti-aliased) edge;
* ``"ring"``: an elliptical ring (a cell wall), bright edge and a dim inside.

The long side of each object is log-uniform in ``size_range`` and its aspect ratio h/w log-uniform
in ``[1/max_aspect, max_aspect]`` (the short side is clipped to at least ``size_range[0]``), so
the boxes are 3-38 px with elongated shapes in both orientations. A box is the ellipse's exact
axis-aligned extent, in continuous pixel coordinates. Then the tile is blurred slightly (the
optics) and noise is added.

::

    from aadet.data.synthetic import make_coco_tiles
    paths = make_coco_tiles("/tmp/cells")  # {"cells_train": (json, image_root), "cells_val": ...}
"""

import json
import math
import os
from typing import Dict, Tuple

import numpy as np
from PIL import Image, ImageFilter

from .coco_json import build_coco_dict

__all__ = ["render_tile", "make_coco_tiles", "CATEGORIES"]

CATEGORIES = [{"id": 1, "name": "cell", "supercategory": "cell"}]


def _texture(rng: np.random.RandomState, size: int) -> np.ndarray:
    """``[size, size, 3]`` float background in 0-255: a blurred random field plus fine noise."""
    coarse = rng.rand(size // 8 + 2, size // 8 + 2).astype(np.float32)
    field = np.asarray(
        Image.fromarray((coarse * 255).astype(np.uint8)).resize((size, size), Image.BICUBIC),
        dtype=np.float32,
    )
    base = 55.0 + 0.25 * field  # 55-120 grey level
    tint = np.array([0.85, 1.0, 0.9], np.float32)  # slightly green
    return base[:, :, None] * tint + rng.normal(0.0, 6.0, (size, size, 3)).astype(np.float32)


def _ellipse_mask(size: int, cx: float, cy: float, rx: float, ry: float, window=None):
    """Anti-aliased coverage (0-1) of an axis-aligned ellipse in a ``size`` x ``size`` tile,
    on ``window`` (row and column slices) if given.

    Returns:
        ``(coverage [h, w] float32, (row slice, column slice))``: the coverage on the window of
        the tile where it can be non-zero (zero everywhere else), so that a large tile with
        hundreds of objects costs what its objects cover, not objects x tile.
    """
    edge = 1.0 / max(min(rx, ry), 0.5)  # one pixel, in normalized radius
    reach = 1.0 + edge / 2.0 + 1e-3  # coverage is zero at normalized radius >= 1 + edge / 2
    if window is None:
        window = (
            slice(max(int(math.floor(cy - ry * reach)), 0), min(int(math.ceil(cy + ry * reach)) + 1, size)),
            slice(max(int(math.floor(cx - rx * reach)), 0), min(int(math.ceil(cx + rx * reach)) + 1, size)),
        )
    (y0, y1), (x0, x1) = (window[0].start, window[0].stop), (window[1].start, window[1].stop)
    ys, xs = np.mgrid[y0:y1, x0:x1].astype(np.float32) + 0.5  # pixel centres
    r = np.sqrt(((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2)  # 1 on the ellipse
    return np.clip((1.0 - r) / edge + 0.5, 0.0, 1.0), window


def render_tile(
    rng: np.random.RandomState,
    size: int = 128,
    objects_per_tile: Tuple[int, int] = (4, 12),
    size_range: Tuple[float, float] = (3.0, 38.0),
    max_aspect: float = 3.0,
    ring_fraction: float = 0.3,
):
    """One tile and its boxes.

    Returns:
        ``(image [size, size, 3] uint8 RGB, boxes [K, 4] float64 XYXY pixels)``.
    """
    lo, hi = size_range
    image = _texture(rng, size)
    boxes = []
    wanted = rng.randint(objects_per_tile[0], objects_per_tile[1] + 1)
    for _ in range(50 * wanted):
        if len(boxes) == wanted:
            break
        long_side = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        aspect = math.exp(rng.uniform(-math.log(max_aspect), math.log(max_aspect)))  # h / w
        w, h = (long_side / aspect, long_side) if aspect >= 1 else (long_side, long_side * aspect)
        w, h = max(w, lo), max(h, lo)
        x0, y0 = rng.uniform(0, size - w), rng.uniform(0, size - h)
        box = (x0, y0, x0 + w, y0 + h)
        if any(
            box[0] < b[2] + 1 and b[0] < box[2] + 1 and box[1] < b[3] + 1 and b[1] < box[3] + 1
            for b in boxes
        ):
            continue  # overlaps (with a 1 px gap) an object already placed
        cx, cy, rx, ry = x0 + w / 2, y0 + h / 2, w / 2, h / 2
        mask, window = _ellipse_mask(size, cx, cy, rx, ry)
        brightness = rng.uniform(70.0, 120.0)
        if rng.rand() < ring_fraction and min(w, h) >= 8:
            inner, _ = _ellipse_mask(size, cx, cy, max(rx - 2.0, 0.5), max(ry - 2.0, 0.5), window)
            mask = mask - 0.7 * inner  # bright wall, dim inside
        colour = np.array([1.0, 0.95, 0.6], np.float32) * brightness  # yellowish fluorescence
        image[window] += mask[:, :, None] * colour
        boxes.append(box)
    blurred = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).filter(
        ImageFilter.GaussianBlur(0.7)
    )
    out = np.asarray(blurred, np.float32) + rng.normal(0.0, 4.0, (size, size, 3))
    return np.clip(out, 0, 255).astype(np.uint8), np.asarray(boxes, np.float64).reshape(-1, 4)


def make_coco_tiles(
    root: str,
    prefix: str = "cells",
    num_train: int = 48,
    num_val: int = 16,
    seed: int = 0,
    **tile_kwargs,
) -> Dict[str, Tuple[str, str]]:
    """Write ``num_train`` + ``num_val`` tiles (:func:`render_tile`) and two COCO jsons under ``root``.

    Layout: ``root/images/{train,val}_NNNN.png``, ``root/{prefix}_train.json``,
    ``root/{prefix}_val.json``. The same arguments always give the same files.

    Returns:
        ``{f"{prefix}_train": (json_file, image_root), f"{prefix}_val": (...)}``, ready for
        ``DATASETS.REGISTER_COCO`` or :func:`aadet.data.register_coco_detection`.
    """
    rng = np.random.RandomState(seed)
    image_root = os.path.join(root, "images")
    os.makedirs(image_root, exist_ok=True)
    out = {}
    for split, count in (("train", num_train), ("val", num_val)):
        entries = []
        for i in range(count):
            image, boxes = render_tile(rng, **tile_kwargs)
            name = f"{split}_{i:04d}.png"
            Image.fromarray(image).save(os.path.join(image_root, name))
            entries.append((name, image.shape[1], image.shape[0], boxes))
        coco = build_coco_dict(
            entries, categories=CATEGORIES, info={"description": f"synthetic {prefix} {split}"}
        )
        json_file = os.path.join(root, f"{prefix}_{split}.json")
        with open(json_file, "w") as f:
            json.dump(coco, f)
        out[f"{prefix}_{split}"] = (json_file, image_root)
    return out
