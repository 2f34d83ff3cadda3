#!/usr/bin/env python
"""Make the demo dataset: NEON tree crowns from the ``deepforest==2.1.0`` wheel, as COCO tiles.

    python datasets/prepare_trees.py              # root: $AADET_DATASETS, else
                                                  # $DETECTRON2_DATASETS, else ./datasets
    python datasets/prepare_trees.py --root /data # then aadet.data.register_trees("/data")

Downloads the pinned wheel with pip (no dependencies, not installed) into ``<root>/.cache/``,
reads the NEON images and boxes from it, and writes ``<root>/trees/``. A second run does nothing;
an interrupted run leaves nothing that looks complete. It lives beside the data, as Detectron2's
``datasets/prepare_*.py`` do: ``aadet`` itself downloads and writes nothing. Split names, dataset
names, paths and the class come from :mod:`aadet.data.trees`, which the registration
(:func:`aadet.data.register_trees`) reads too.

Source. The ``deepforest`` wheel on the package index ships hand-labelled RGB aerial images of tree
crowns (National Ecological Observatory Network, public domain) as PNG + Pascal-VOC XML in
``deepforest/data/``; one class, ``"Tree"``. We download the pinned wheel with pip
(``--no-deps --only-binary=:all:``, nothing is installed), check its sha256, and read the files
straight from the zip archive. Box coordinates are taken as written, as continuous pixel
coordinates (DeepForest reads them the same way; in these files ``1 <= xmin`` and
``xmax <= width``).

Split, by source image (no source image is in two splits; :data:`SOURCES`)::

    source image                              size (WxH)   boxes  split
    2019_YELL_2_528000_4978000_image_crop2    2299x2472    574    train
    OSBS_029                                  400x400       61    train
    2019_YELL_2_541000_4977000_image_crop     1249x1035    279    val
    SOAP_061                                  400x400       37    test

Val is a whole image from the same NEON site (YELL) as the big train image: it measures detection
on an unseen area, not on an unseen site, and every recipe choice of the demo configs was made on
it. Test is the one annotated image of the wheel that no other split uses: another site (SOAP,
Sierra Nevada), 37 crowns of which 28 are labelled "Dead" and 9 "Alive" in the XML (both are
tree crowns: the class here is "Tree"). It measures transfer to an unseen site; with 37 boxes one
crown moves AP50 by about 2.7 points (docs/demo_results.md says what it can and cannot show).
OSBS_029 (another site, 61 boxes) stays in train, where the demo recipe was tuned with it.

Tiles. Each source image is cut into ``TILE_SIZE`` x ``TILE_SIZE`` windows (an image side shorter
than the tile gives a tile as long as that side: OSBS_029 is one tile). Per axis we use the fewest
windows whose spacing is at most the stride, spread evenly from the first pixel to the last, so
every tile lies fully inside the image and the overlap is shared equally (:func:`tile_offsets`):

* train: stride 300 (>= 100 px overlap, so almost every crown is whole in some tile);
  tiles without boxes are dropped;
* val and test: stride 400 = tile size, i.e. the fewest tiles that cover the image (4 x 3 for 1249x1035,
  offsets x 0/283/566/849, y 0/318/635), so a val box is counted in as few tiles as possible;
  all tiles are kept.

Clipping rule. A box cut by a tile border is kept, clipped to the tile, when at least
``MIN_VISIBLE`` (50%) of its area lies inside the tile; otherwise it is dropped from that tile.
A box whole in the tile is kept unchanged. Tiles are named ``<source>_x<x0>_y<y0>.png`` with the
tile's top-left corner in the source image, zero-padded to 4 digits (:func:`tile_file_name`).

Layout under the data root (``--root``; default ``$AADET_DATASETS``, else ``$DETECTRON2_DATASETS``,
else ``./datasets``; the dataset paths are :func:`aadet.data.trees.dataset_paths`)::

    <root>/.cache/deepforest-2.1.0-py3-none-any.whl   downloaded wheel (kept for reruns)
    <root>/trees/annotations/trees_train.json         COCO detection json
    <root>/trees/annotations/trees_val.json
    <root>/trees/train/*.png, <root>/trees/val/*.png   tiles ("file_name" is relative to these)
    <root>/trees/MANIFEST.json                        completion marker, written last

Never half-written. :func:`prepare` builds into ``<root>/.trees.tmp-*`` and renames it to
``<root>/trees`` only when everything, the manifest last, is written. The manifest holds the wheel's
sha256, the tiling parameters and every file with its size: a later run does nothing when they all
match, and rebuilds when the manifest is missing, its parameters differ, or a file is missing.
Concurrent runs on one root are serialized with a lock file (POSIX).
"""

import argparse
import contextlib
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np
from PIL import Image

from aadet.data.coco_json import build_coco_dict
from aadet.data.trees import (
    CATEGORIES,
    DATASET_DIR,
    SPLITS,
    dataset_name,
    dataset_paths,
    default_root,
    json_relpath,
)

__all__ = [
    "WHEEL_REQUIREMENT",
    "WHEEL_NAME",
    "WHEEL_SHA256",
    "SOURCES",
    "TILE_SIZE",
    "TRAIN_STRIDE",
    "VAL_STRIDE",
    "MIN_VISIBLE",
    "VocAnnotation",
    "Tile",
    "PreparedTrees",
    "parse_voc_xml",
    "tile_offsets",
    "clip_boxes_to_window",
    "make_tiles",
    "tile_file_name",
    "parse_tile_file_name",
    "fetch_wheel",
    "prepare",
]

# ---------------------------------------------------------------- source: the pinned wheel
WHEEL_REQUIREMENT = "deepforest==2.1.0"
WHEEL_NAME = "deepforest-2.1.0-py3-none-any.whl"
# sha256 of the wheel on the package index (PyPI); a wheel with another hash is refused.
WHEEL_SHA256 = "8c2798d8e9be7f0004b194fe207b76c1d9fff6e711b3db67b9508dcd5d00ae54"
WHEEL_DATA_DIR = "deepforest/data/"

# split (aadet.data.trees.SPLITS) -> source images (stems of <stem>.png + <stem>.xml in
# WHEEL_DATA_DIR). See module docstring.
SOURCES: Dict[str, Tuple[str, ...]] = {
    "train": ("2019_YELL_2_528000_4978000_image_crop2", "OSBS_029"),
    "val": ("2019_YELL_2_541000_4977000_image_crop",),
    "test": ("SOAP_061",),
}
MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1  # bump when the output format changes: forces a rebuild

# ---------------------------------------------------------------- tiling defaults
TILE_SIZE = 400  # tile side in pixels
TRAIN_STRIDE = 300  # largest spacing of train tiles (overlap >= TILE_SIZE - TRAIN_STRIDE)
VAL_STRIDE = 400  # = TILE_SIZE: fewest tiles that cover each val and test image
MIN_VISIBLE = 0.5  # keep a cut box when >= this fraction of its area is inside the tile
DROP_EMPTY = {"train": True, "val": False, "test": False}  # drop tiles without boxes (train only)

for _table in (SOURCES, DROP_EMPTY):  # keyed by the library's split names, all of them
    if tuple(_table) != SPLITS:
        raise ImportError(f"prepare_trees: {tuple(_table)} are not the splits {SPLITS}")
del _table


class VocAnnotation(NamedTuple):
    """One Pascal-VOC XML file: image size, boxes ``[N, 4]`` float64 XYXY (pixels), labels."""

    filename: str
    width: int
    height: int
    boxes: np.ndarray
    labels: List[str]


class Tile(NamedTuple):
    """A window ``[x0, x0 + width) x [y0, y0 + height)`` of a source image and its boxes.

    ``boxes`` is ``[K, 4]`` float64 XYXY in tile coordinates (clipped to the tile);
    ``box_indices`` is ``[K]``, the row of each box in the source image's boxes.
    """

    x0: int
    y0: int
    width: int
    height: int
    boxes: np.ndarray
    box_indices: np.ndarray


@dataclass(frozen=True)
class PreparedTrees:
    """What :func:`prepare` made: ``splits`` maps a dataset name to ``(json_file, image_root)``.

    ``built`` is False when the dataset was already complete and nothing was written. Register
    with ``for name, (json_file, image_root) in p.splits.items():
    register_coco_detection(name, json_file, image_root)``.
    """

    dataset_dir: str
    splits: Dict[str, Tuple[str, str]]
    built: bool


# ---------------------------------------------------------------- pure functions
def parse_voc_xml(
    xml: Union[bytes, str, os.PathLike], source: Optional[str] = None
) -> VocAnnotation:
    """Parse a Pascal-VOC annotation.

    Args:
        xml: the XML content (``bytes``) or the path of an XML file (``str`` / path-like).
        source: name used in error messages (default: the path, or ``"<xml>"``).

    Returns:
        :class:`VocAnnotation`; boxes are clipped to ``[0, width] x [0, height]``.

    Raises:
        ValueError naming ``source`` and the element when the XML is malformed, a value is not a
        number, a box is empty (``xmin >= xmax`` or ``ymin >= ymax``) or lies beyond the image by
        more than 1 pixel.
    """
    if isinstance(xml, bytes):
        source = source or "<xml>"
        data = xml
    else:
        source = source or os.fspath(xml)
        with open(xml, "rb") as f:
            data = f.read()
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        raise ValueError(f"{source}: not a valid XML file ({e})") from None

    def number(elem, tag, where):
        text = elem.findtext(tag)
        if text is None:
            raise ValueError(f"{source}: {where} has no <{tag}>")
        try:
            return float(text)
        except ValueError:
            raise ValueError(
                f"{source}: {where} <{tag}> is {text.strip()!r}, expected a number"
            ) from None

    size = root.find("size")
    if size is None:
        raise ValueError(f"{source}: no <size> element (expected <size><width>..<height>..</size>)")
    width, height = number(size, "width", "<size>"), number(size, "height", "<size>")
    if width < 1 or height < 1 or width != int(width) or height != int(height):
        raise ValueError(f"{source}: <size> is {width}x{height}, expected positive integers")
    width, height = int(width), int(height)

    boxes, labels = [], []
    for i, obj in enumerate(root.iter("object")):
        where = f"<object> #{i}"
        label = (obj.findtext("name") or "").strip()
        if not label:
            raise ValueError(f"{source}: {where} has no <name>")
        bnd = obj.find("bndbox")
        if bnd is None:
            raise ValueError(f"{source}: {where} ({label!r}) has no <bndbox>")
        x0, y0, x1, y1 = (
            number(bnd, k, f"{where} <bndbox>") for k in ("xmin", "ymin", "xmax", "ymax")
        )
        if not (x0 < x1 and y0 < y1):
            raise ValueError(
                f"{source}: {where} ({label!r}) has an empty box xmin={x0:g} xmax={x1:g} "
                f"ymin={y0:g} ymax={y1:g}; expected xmin < xmax and ymin < ymax"
            )
        if x0 < -1 or y0 < -1 or x1 > width + 1 or y1 > height + 1:
            raise ValueError(
                f"{source}: {where} ({label!r}) box ({x0:g}, {y0:g}, {x1:g}, {y1:g}) lies outside "
                f"the {width}x{height} image; expected 0 <= x <= {width}, 0 <= y <= {height}"
            )
        boxes.append((x0, y0, x1, y1))
        labels.append(label)
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, width)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, height)
    return VocAnnotation(root.findtext("filename") or "", width, height, boxes, labels)


def tile_offsets(length: int, tile_size: int, stride: int) -> List[int]:
    """Start offsets of the windows along one image axis of ``length`` pixels.

    The fewest windows of ``tile_size`` whose spacing is at most ``stride``, spread evenly from 0 to
    ``length - tile_size`` (rounded to integers), so the first and last windows touch the borders
    and all windows lie inside the image. ``length <= tile_size`` gives ``[0]``.

    Example: ``tile_offsets(1249, 400, 400) == [0, 283, 566, 849]``.
    """
    if tile_size < 1:
        raise ValueError(f"tile_size must be >= 1, got {tile_size}")
    if not 1 <= stride <= tile_size:
        raise ValueError(f"stride must be in [1, tile_size={tile_size}] (no gaps), got {stride}")
    if length < 1:
        raise ValueError(f"image length must be >= 1 pixel, got {length}")
    span = length - tile_size
    if span <= 0:
        return [0]
    n = -(-span // stride) + 1  # ceil(span / stride) + 1 windows
    # round(i * span / (n - 1)), half up, in integers; consecutive spacing <= stride
    return [(2 * i * span + (n - 1)) // (2 * (n - 1)) for i in range(n)]


def clip_boxes_to_window(
    boxes: np.ndarray, window: Tuple[int, int, int, int], min_visible: float = MIN_VISIBLE
) -> Tuple[np.ndarray, np.ndarray]:
    """Boxes of a window, by the clipping rule.

    Args:
        boxes: ``[N, 4]`` XYXY in image coordinates.
        window: ``(x0, y0, x1, y1)`` in image coordinates.
        min_visible: keep a box when ``area(box & window) >= min_visible * area(box)``.

    Returns:
        ``(clipped, keep)``: ``clipped`` ``[K, 4]`` XYXY in window coordinates (origin at
        ``(x0, y0)``, clipped to the window), ``keep`` ``[K]`` indices into ``boxes``.
    """
    if not 0 < min_visible <= 1:
        raise ValueError(f"min_visible must be in (0, 1], got {min_visible}")
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    wx0, wy0, wx1, wy1 = window
    inter = np.stack(
        [
            np.maximum(boxes[:, 0], wx0),
            np.maximum(boxes[:, 1], wy0),
            np.minimum(boxes[:, 2], wx1),
            np.minimum(boxes[:, 3], wy1),
        ],
        axis=1,
    )
    iw = (inter[:, 2] - inter[:, 0]).clip(min=0)
    ih = (inter[:, 3] - inter[:, 1]).clip(min=0)
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep = np.nonzero((iw * ih > 0) & (iw * ih >= min_visible * area))[0]
    clipped = inter[keep] - np.array([wx0, wy0, wx0, wy0], dtype=np.float64)
    return clipped, keep


def make_tiles(
    width: int,
    height: int,
    boxes: np.ndarray,
    *,
    tile_size: int = TILE_SIZE,
    stride: int = TRAIN_STRIDE,
    min_visible: float = MIN_VISIBLE,
    drop_empty: bool = False,
) -> List[Tile]:
    """Cut a ``width`` x ``height`` image with ``boxes`` ``[N, 4]`` (XYXY) into :class:`Tile` s.

    Windows come from :func:`tile_offsets` on each axis, in row-major order (y, then x); boxes
    follow :func:`clip_boxes_to_window`. ``drop_empty`` leaves out tiles without boxes.
    """
    tiles = []
    tw, th = min(tile_size, width), min(tile_size, height)
    for y0 in tile_offsets(height, tile_size, stride):
        for x0 in tile_offsets(width, tile_size, stride):
            clipped, keep = clip_boxes_to_window(boxes, (x0, y0, x0 + tw, y0 + th), min_visible)
            if drop_empty and len(keep) == 0:
                continue
            tiles.append(Tile(x0, y0, tw, th, clipped, keep))
    return tiles


_TILE_NAME = re.compile(r"^(?P<source>.+)_x(?P<x0>\d+)_y(?P<y0>\d+)\.png$")


def tile_file_name(source: str, x0: int, y0: int) -> str:
    """``"<source>_x<x0>_y<y0>.png"``, offsets zero-padded to 4 digits (sorts row by row)."""
    return f"{source}_x{x0:04d}_y{y0:04d}.png"


def parse_tile_file_name(file_name: str) -> Tuple[str, int, int]:
    """Inverse of :func:`tile_file_name`: ``(source, x0, y0)`` (accepts a path)."""
    m = _TILE_NAME.match(os.path.basename(file_name))
    if m is None:
        raise ValueError(f"{file_name!r} is not a tile name '<source>_x<x0>_y<y0>.png'")
    return m["source"], int(m["x0"]), int(m["y0"])


# ---------------------------------------------------------------- wheel
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_wheel_hash(path: str, hint: str) -> None:
    got = _sha256(path)
    if got != WHEEL_SHA256:
        raise ValueError(
            f"{path}: sha256 is {got}, expected {WHEEL_SHA256} (the {WHEEL_REQUIREMENT} wheel "
            f"from the package index); {hint}"
        )


def fetch_wheel(cache_dir: str) -> str:
    """Path of the pinned wheel in ``cache_dir``, downloading it with pip when not there.

    Runs ``python -m pip download --no-deps --only-binary=:all: deepforest==2.1.0`` (nothing is
    installed) into a temporary folder and moves the wheel into the cache once its sha256 checks.
    """
    path = os.path.join(cache_dir, WHEEL_NAME)
    if os.path.isfile(path):
        _check_wheel_hash(path, "delete it to download it again")
        return path
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=cache_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", tmp]  # fmt: skip
        print(
            f"Downloading {WHEEL_REQUIREMENT} (data only, not installed) into {cache_dir} ...",
            flush=True,
        )
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        downloaded = os.path.join(tmp, WHEEL_NAME)
        if proc.returncode != 0 or not os.path.isfile(downloaded):
            tail = "\n".join(proc.stdout.strip().splitlines()[-10:])
            raise RuntimeError(
                f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}\n"
                f"Download {WHEEL_NAME} by other means and pass it with --wheel PATH "
                f"(or copy it to {path})."
            )
        _check_wheel_hash(downloaded, "the download is corrupt or not the published wheel")
        os.replace(downloaded, path)
    return path


def _read_source(
    archive: zipfile.ZipFile, wheel: str, stem: str
) -> Tuple[Image.Image, VocAnnotation]:
    """Image (RGB) and annotation of one source image, read from the wheel."""
    members = {}
    for ext in ("png", "xml"):
        name = WHEEL_DATA_DIR + f"{stem}.{ext}"
        try:
            members[ext] = (name, archive.read(name))
        except KeyError:
            raise FileNotFoundError(
                f"{wheel}: the archive has no {name} (is it the {WHEEL_NAME} wheel?)"
            ) from None
    ann = parse_voc_xml(members["xml"][1], source=f"{wheel}!{members['xml'][0]}")
    png_name = f"{wheel}!{members['png'][0]}"
    try:
        image = Image.open(io.BytesIO(members["png"][1]))
        image.load()
    except Exception as e:  # PIL raises several types for corrupt data
        raise ValueError(f"{png_name}: cannot decode the image ({type(e).__name__}: {e})") from None
    if image.size != (ann.width, ann.height):
        raise ValueError(
            f"{png_name}: image is {image.size[0]}x{image.size[1]} but its XML says "
            f"{ann.width}x{ann.height}"
        )
    return image.convert("RGB"), ann


# ---------------------------------------------------------------- prepare
def _params(tile_size: int, train_stride: int, val_stride: int, min_visible: float) -> dict:
    """Everything the output depends on; a manifest with other params triggers a rebuild."""
    return {
        "format_version": FORMAT_VERSION,
        "wheel": WHEEL_NAME,
        "wheel_sha256": WHEEL_SHA256,
        "splits": {split: list(stems) for split, stems in SOURCES.items()},
        "tile_size": tile_size,
        "stride": {"train": train_stride, "val": val_stride, "test": val_stride},
        "min_visible": min_visible,
        "drop_empty": dict(DROP_EMPTY),
        "category": CATEGORIES[0]["name"],
    }


def _check_complete(dataset_dir: str, params: dict) -> Tuple[Optional[dict], str]:
    """``(manifest, "")`` if ``dataset_dir`` is complete with ``params``, else ``(None, why)``."""
    path = os.path.join(dataset_dir, MANIFEST)
    if not os.path.isdir(dataset_dir):
        return None, "not built yet"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None, f"{path} is missing (incomplete build)"
    except (OSError, ValueError) as e:
        return None, f"{path} is unreadable ({e})"
    if not isinstance(manifest, dict) or manifest.get("params") != params:
        old = manifest.get("params") if isinstance(manifest, dict) else None
        if not isinstance(old, dict):
            return None, f"{path} has no parameters"
        diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in params.items() if old.get(k) != v]
        return None, "parameters changed (" + "; ".join(diff) + ")"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None, f"{path} lists no files"
    for rel, size in files.items():
        full = os.path.join(dataset_dir, rel)
        try:
            if os.path.getsize(full) != size:
                return None, f"{full} has changed size"
        except OSError:
            return None, f"{full} is missing"
    return manifest, ""


@contextlib.contextmanager
def _lock(root: str):
    """Exclusive lock on ``<root>/.trees.lock`` (no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:  # Windows: no locking
        yield
        return
    with open(os.path.join(root, f".{DATASET_DIR}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _print_summary(splits: Dict[str, Tuple[str, str]], counts: dict, note: str = "") -> None:
    for name, (json_file, _) in splits.items():
        c = counts[name]
        print(f"{name}: {c['images']} images, {c['boxes']} boxes -> {json_file}{note}")


def _write_split(
    out_dir: str, split: str, images: Dict[str, Tuple[Image.Image, VocAnnotation]], params: dict
):
    """Write the tiles and the json of one split into ``out_dir``; returns (json_rel, counts)."""
    os.makedirs(os.path.join(out_dir, split))
    os.makedirs(os.path.join(out_dir, "annotations"), exist_ok=True)
    entries = []
    for stem in SOURCES[split]:
        image, ann = images[stem]
        tiles = make_tiles(
            ann.width,
            ann.height,
            ann.boxes,
            tile_size=params["tile_size"],
            stride=params["stride"][split],
            min_visible=params["min_visible"],
            drop_empty=params["drop_empty"][split],
        )
        for t in tiles:
            name = tile_file_name(stem, t.x0, t.y0)
            _save_tile(
                image.crop((t.x0, t.y0, t.x0 + t.width, t.y0 + t.height)),
                os.path.join(out_dir, split, name),
            )
            entries.append((name, t.width, t.height, t.boxes))
    info = {
        "description": f"NEON tree crowns ({split}), {params['tile_size']} px tiles of "
        + ", ".join(SOURCES[split]),
        "source": f"{WHEEL_REQUIREMENT} wheel (sha256 {WHEEL_SHA256}), {WHEEL_DATA_DIR}; "
        "public domain (NEON)",
        "version": str(FORMAT_VERSION),
    }
    coco = build_coco_dict(entries, categories=CATEGORIES, info=info)
    json_rel = json_relpath(split)
    with open(os.path.join(out_dir, json_rel), "w") as f:
        json.dump(coco, f)
    return json_rel, {"images": len(coco["images"]), "boxes": len(coco["annotations"])}


def _save_tile(image: Image.Image, path: str) -> None:
    image.save(path, format="PNG")


def prepare(
    root: Optional[str] = None,
    wheel: Optional[str] = None,
    force: bool = False,
    *,
    tile_size: int = TILE_SIZE,
    train_stride: int = TRAIN_STRIDE,
    val_stride: int = VAL_STRIDE,
    min_visible: float = MIN_VISIBLE,
) -> PreparedTrees:
    """Build the tree-crown COCO dataset under ``<root>/trees`` unless it is already complete.

    Args:
        root: data root (default :func:`default_root`); created if missing.
        wheel: path of a local ``deepforest-2.1.0-py3-none-any.whl``; default: the copy cached in
            ``<root>/.cache/``, downloaded with pip when not there.
        force: rebuild even when the dataset is complete.
        tile_size, train_stride, val_stride, min_visible: tiling parameters (module docstring).

    Returns:
        :class:`PreparedTrees`. Prints one line per split: images, boxes.

    Raises:
        ValueError: a parameter is out of range, or the wheel's sha256 is not the published one.
        FileNotFoundError: ``wheel`` does not exist, or lacks a source file.
        RuntimeError: pip could not download the wheel.
    """
    if not (isinstance(tile_size, int) and tile_size >= 1):
        raise ValueError(f"tile_size must be an integer >= 1, got {tile_size!r}")
    for key, stride in (("train_stride", train_stride), ("val_stride", val_stride)):
        if not (isinstance(stride, int) and 1 <= stride <= tile_size):
            raise ValueError(
                f"{key} must be an integer in [1, tile_size={tile_size}], got {stride!r}"
            )
    if not 0 < min_visible <= 1:
        raise ValueError(f"min_visible must be in (0, 1], got {min_visible!r}")
    root = os.path.abspath(
        os.path.expanduser(os.fspath(root if root is not None else default_root()))
    )
    if wheel is not None:
        wheel = os.path.abspath(os.path.expanduser(os.fspath(wheel)))
        if not os.path.isfile(wheel):
            raise FileNotFoundError(
                f"wheel file {wheel} does not exist (expected a path to {WHEEL_NAME})"
            )
        _check_wheel_hash(wheel, f"pass the {WHEEL_NAME} wheel from the package index")

    params = _params(tile_size, train_stride, val_stride, min_visible)
    dataset_dir = os.path.join(root, DATASET_DIR)
    splits = dataset_paths(root)
    os.makedirs(root, exist_ok=True)
    with _lock(root):
        if not force:
            manifest, why = _check_complete(dataset_dir, params)
            if manifest is not None:
                _print_summary(splits, manifest["counts"], " (up to date)")
                return PreparedTrees(dataset_dir, splits, built=False)
            if os.path.isdir(dataset_dir):
                print(f"Rebuilding {dataset_dir}: {why}", flush=True)
        # leftovers of interrupted runs (safe: we hold the lock)
        for stale in glob.glob(os.path.join(root, f".{DATASET_DIR}.tmp-*")) + glob.glob(
            os.path.join(root, f".{DATASET_DIR}.old-*")
        ):
            shutil.rmtree(stale, ignore_errors=True)

        wheel_path = wheel or fetch_wheel(os.path.join(root, ".cache"))
        tmp = tempfile.mkdtemp(prefix=f".{DATASET_DIR}.tmp-", dir=root)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the dataset is not
        old = None
        try:
            try:
                archive = zipfile.ZipFile(wheel_path)
            except (zipfile.BadZipFile, OSError) as e:
                raise ValueError(f"{wheel_path}: not a readable wheel/zip archive ({e})") from None
            with archive:
                sources = {
                    stem: _read_source(archive, wheel_path, stem)
                    for stems in SOURCES.values()
                    for stem in stems
                }
            counts = {}
            for split in SPLITS:
                _, c = _write_split(tmp, split, sources, params)
                counts[dataset_name(split)] = c
            files = {}
            for dirpath, _, names in os.walk(tmp):
                for n in names:
                    full = os.path.join(dirpath, n)
                    files[os.path.relpath(full, tmp).replace(os.sep, "/")] = os.path.getsize(full)
            manifest = {"params": params, "counts": counts, "files": dict(sorted(files.items()))}
            with open(os.path.join(tmp, MANIFEST), "w") as f:  # the completion marker, last
                json.dump(manifest, f, indent=1)
            # swap in: move a previous build aside, rename the new one into place
            if os.path.lexists(dataset_dir):
                old = tempfile.mkdtemp(prefix=f".{DATASET_DIR}.old-", dir=root)
                os.rename(dataset_dir, os.path.join(old, DATASET_DIR))
            try:
                os.rename(tmp, dataset_dir)
            except BaseException:
                if old is not None:  # put the previous build back
                    os.rename(os.path.join(old, DATASET_DIR), dataset_dir)
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    _print_summary(splits, counts)
    return PreparedTrees(dataset_dir, splits, built=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root",
        default=None,
        help="data root (default: $AADET_DATASETS, else $DETECTRON2_DATASETS, else ./datasets; "
        f"now {default_root()!r})",
    )
    parser.add_argument(
        "--wheel",
        default=None,
        help=f"use this local {WHEEL_NAME} instead of downloading it",
    )
    parser.add_argument(
        "--wheelhouse",
        default=None,
        metavar="DIR",
        help=f"take {WHEEL_NAME} from this folder of wheels (no package index needed; "
        "dev/make_wheelhouse.sh puts it there)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the dataset is complete"
    )
    args = parser.parse_args(argv)
    if args.wheelhouse and args.wheel:
        parser.error("give --wheel FILE or --wheelhouse DIR, not both")
    if args.wheelhouse:
        args.wheel = f"{args.wheelhouse.rstrip('/')}/{WHEEL_NAME}"
    try:
        prepare(args.root, wheel=args.wheel, force=args.force)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
