"""Checking a COCO-format detection dataset before training on it.

:func:`check_coco_json` reads the json and every image, and returns ALL the problems at once
(``tools/check_dataset.py`` prints them, one per line). Errors stop training or evaluation, or
silently corrupt them; info lines are worth knowing but fine:

* error: json missing/unreadable/without ``images``, ``annotations`` or ``categories``; an entry
  without a required key; duplicate image, annotation or category ids; a missing image file;
  an image that does not decode; an image whose size differs from the json's height/width (after
  EXIF rotation, as Detectron2 reads it); a box with ``w <= 0`` or ``h <= 0`` or not 4 finite
  numbers; a box beyond the image by more than 1 pixel; an annotation with an unknown
  ``image_id`` or ``category_id``; an annotation without ``area`` or ``iscrowd`` (COCO evaluation
  needs both).
* info: an image with no annotations; a grayscale or alpha/palette/CMYK image (Detectron2
  converts it to 3 channels); two image entries with the same file.
"""

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import List

from PIL import Image

__all__ = ["Problem", "check_coco_json"]

ERROR, INFO = "error", "info"
_GRAY_MODES = ("1", "L", "I", "I;16", "I;16B", "I;16L", "F", "LA")
_EXIF_ORIENTATION = 0x0112
_TOLERANCE = 1.0  # pixels a box may extend beyond the image


@dataclass(frozen=True)
class Problem:
    """One problem: ``level`` (``"error"`` or ``"info"``), the ``file`` it is about, a message."""

    level: str
    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper()}: {self.file}: {self.message}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _image_size(path: str):
    """``(width, height, mode)`` of a fully decoded image, as Detectron2 would read it."""
    with Image.open(path) as im:
        im.load()
        width, height = im.size
        try:
            orientation = im.getexif().get(_EXIF_ORIENTATION)
        except Exception:
            orientation = None
        if orientation in (5, 6, 7, 8):  # rotated by 90 degrees
            width, height = height, width
        return width, height, im.mode


def check_coco_json(json_file, image_root) -> List[Problem]:
    """All problems of a COCO detection dataset (json + image folder); empty when it is clean.

    Args:
        json_file: the COCO json.
        image_root: folder that ``file_name`` of each image is relative to.

    Returns:
        list of :class:`Problem`, in the order: json, categories, images, annotations, and the
        infos about images without annotations. ``[p for p in problems if p.level == "error"]``
        are the errors.
    """
    json_file, image_root = os.fspath(json_file), os.fspath(image_root)
    problems: List[Problem] = []

    def error(file, message):
        problems.append(Problem(ERROR, file, message))

    def info(file, message):
        problems.append(Problem(INFO, file, message))

    # ------------------------------------------------------------ the json
    try:
        with open(json_file) as f:
            coco = json.load(f)
    except FileNotFoundError:
        return [Problem(ERROR, json_file, "annotation file does not exist")]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return [Problem(ERROR, json_file, f"cannot read it as JSON ({e})")]
    if not isinstance(coco, dict):
        return [
            Problem(ERROR, json_file, f"top level is a {type(coco).__name__}, expected an object")
        ]
    for key in ("images", "annotations", "categories"):
        if not isinstance(coco.get(key), list):
            error(
                json_file,
                f"no {key!r} list (a COCO detection json has images, annotations, categories)",
            )
    if problems:
        return problems

    # ------------------------------------------------------------ categories
    category_ids = set()
    for i, cat in enumerate(coco["categories"]):
        cid = cat.get("id") if isinstance(cat, dict) else None
        if not _is_int(cid) or not isinstance(cat.get("name"), str):
            error(json_file, f"categories[{i}] = {cat!r}: expected {{'id': int, 'name': str}}")
        elif cid in category_ids:
            error(json_file, f"categories[{i}]: duplicate category id {cid}")
        else:
            category_ids.add(cid)
    if not coco["categories"]:
        error(json_file, "'categories' is empty")

    # ------------------------------------------------------------ images
    images = {}  # id -> (path, width, height)
    root_exists = os.path.isdir(image_root)
    if not root_exists:
        error(image_root, "image folder does not exist (no image file is checked)")
    if not coco["images"]:
        error(json_file, "'images' is empty")
    file_names = Counter()
    for i, im in enumerate(coco["images"]):
        if not isinstance(im, dict):
            error(json_file, f"images[{i}] is a {type(im).__name__}, expected an object")
            continue
        iid, name, w, h = im.get("id"), im.get("file_name"), im.get("width"), im.get("height")
        if not _is_int(iid):
            error(json_file, f"images[{i}]: 'id' is {iid!r}, expected an integer")
            continue
        if iid in images:
            error(json_file, f"images[{i}]: duplicate image id {iid} (also {images[iid][0]})")
            continue
        if not isinstance(name, str) or not name:
            error(json_file, f"images[{i}] (id {iid}): 'file_name' is {name!r}, expected a path")
            continue
        path = os.path.join(image_root, name)
        if not (_is_int(w) and _is_int(h) and w > 0 and h > 0):
            error(path, f"image id {iid}: width, height = {w!r}, {h!r}; expected positive integers")
            w = h = None
        images[iid] = (path, w, h)
        file_names[name] += 1
        if file_names[name] == 2:
            info(path, f"listed more than once in images (id {iid} and before)")
        if not root_exists:
            continue
        if not os.path.isfile(path):
            error(path, f"image id {iid}: file does not exist")
            continue
        try:
            real_w, real_h, mode = _image_size(path)
        except Exception as e:  # PIL raises several types for corrupt files
            error(path, f"image id {iid}: cannot decode the image ({type(e).__name__}: {e})")
            continue
        if w is not None and (real_w, real_h) != (w, h):
            error(
                path,
                f"image id {iid}: json says width x height = {w}x{h}, "
                f"the file is {real_w}x{real_h}",
            )
        if mode in _GRAY_MODES:
            info(
                path,
                f"image id {iid}: grayscale (mode {mode}); Detectron2 loads it as 3 equal channels",
            )
        elif mode != "RGB":
            info(
                path,
                f"image id {iid}: mode {mode}; Detectron2 converts it to RGB "
                "(alpha/palette dropped)",
            )

    # ------------------------------------------------------------ annotations
    annotated = set()
    ann_ids = set()
    for j, ann in enumerate(coco["annotations"]):
        if not isinstance(ann, dict):
            error(json_file, f"annotations[{j}] is a {type(ann).__name__}, expected an object")
            continue
        aid = ann.get("id")
        where = f"annotation id {aid}" if _is_int(aid) else f"annotations[{j}]"
        if not _is_int(aid):
            error(json_file, f"annotations[{j}]: 'id' is {aid!r}, expected an integer")
        elif aid in ann_ids:
            error(json_file, f"annotations[{j}]: duplicate annotation id {aid}")
        else:
            ann_ids.add(aid)
        iid = ann.get("image_id")
        image = images.get(iid) if _is_int(iid) else None
        file = image[0] if image else json_file
        if image is None:
            error(json_file, f"{where}: image_id {iid!r} is not an id in images")
        else:
            annotated.add(iid)
        cid = ann.get("category_id")
        if not _is_int(cid) or cid not in category_ids:
            error(
                file,
                f"{where}: category_id {cid!r} is not an id in categories {sorted(category_ids)}",
            )
        for key in ("area", "iscrowd"):
            if key not in ann:
                error(file, f"{where}: no {key!r} (COCO evaluation needs it)")
        bbox = ann.get("bbox")
        if not (
            isinstance(bbox, (list, tuple))
            and len(bbox) == 4
            and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in bbox
            )
        ):
            error(file, f"{where}: bbox is {bbox!r}, expected [x, y, w, h] (4 finite numbers)")
            continue
        x, y, bw, bh = bbox
        if bw <= 0 or bh <= 0:
            error(file, f"{where}: degenerate bbox {bbox} (w and h must be > 0)")
            continue
        if image is not None and image[1] is not None:
            _, w, h = image
            t = _TOLERANCE
            if x < -t or y < -t or x + bw > w + t or y + bh > h + t:
                error(
                    file,
                    f"{where}: bbox {bbox} (x1={x + bw:g}, y1={y + bh:g}) lies outside the {w}x{h} "
                    f"image; expected 0 <= x <= x + w <= {w} and 0 <= y <= y + h <= {h} "
                    f"(+-{t:g} px)",
                )

    # ------------------------------------------------------------ images without boxes
    for iid, (path, _, _) in images.items():
        if iid not in annotated:
            info(path, f"image id {iid}: no annotations")
    return problems
