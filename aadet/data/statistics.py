"""Box statistics of a COCO detection dataset, and the recipe (scale, anchors) they suggest.

A detector trained from scratch learns little when its anchors and input scale do not fit the
objects: RetinaNet labels an anchor positive at IoU >= 0.5 with a box, and a square anchor never
reaches 0.5 with a 1:3 rod, nor does a 16 px anchor with a 5 px cell. ``tools/check_dataset.py``
prints :func:`box_statistics` per split and the :func:`suggest_recipe` of the training split, as
YAML lines to paste (or a whole config with ``--write``).

The rule (all sizes are ``sqrt(w * h)`` of a box, taken at quantiles, not extremes, so that a few
odd boxes do not set the recipe):

1. **Scale.** Resize so that the small objects (quantile ``SMALL_QUANTILE``) become
   ``MIN_OBJECT_STRIDES`` strides of the finest FPN level (2 x 8 = 16 px on P3, the demo's smallest
   anchor): ``scale = 16 / q05``, at most ``max_scale`` (and the image long side at most
   ``max_size``), at least ``1 / max_scale``. The test size is ``scale`` x the median long side,
   rounded to a multiple of ``SIZE_MULTIPLE`` (32); training resizes the long side uniformly in
   ``JITTER`` x the test size (the papers' [512, 768] around 640) and crops ``min(test size,
   max_crop_size)``.
2. **Anchors.** Per FPN level ``l`` (stride ``2^l``), ``octaves`` sizes ``A * 2^(l - l0) *
   2^(k / octaves)``, with the smallest ``A`` = the small objects at the test scale, never below
   ``MIN_OBJECT_STRIDES`` strides (16 px on P3): the small objects fit the finest anchors, and each
   coarser level doubles. Where the scale cap leaves small objects below 16 px, RetinaNet's
   low-quality matching still gives each its best anchor.
3. **Aspect ratios** (Detectron2's h / w). An anchor of the boxes' median shape and the same area
   matches a box at IoU >= 0.5 only if their h / w differ by at most ``SQUARE_FIT`` = 2.25
   (IoU = 1 / (2 sqrt(r) - 1)). If at most ``MAX_MISFIT_SHARE`` (a quarter) of the boxes are
   beyond that, one ratio, the median (to 0.1); those few still get their best anchor by
   low-quality matching. Otherwise three: the medians of the lower, middle and upper thirds of
   log(h / w), so that each third has an anchor shape (three ratios triple the anchors per
   position, so one is preferred where it suffices).
4. ``TEST.DETECTIONS_PER_IMAGE``: at least 100, at least twice the most boxes in one image.
5. **Norm** of the backbone and FPN, from the batch, not the data (:func:`suggest_norm`): BN
   (the papers') from ``BN_MIN_IMAGES_PER_WORKER`` images per worker up, GN below, where BN's batch
   statistics are too noisy (Wu & He, "Group Normalization", ECCV 2018, Figure 1).

On the demo's tree crowns the rule gives back the hand-tuned demo anchors (16-102 px, square)
(``tests/data/test_dataset_stats.py``). On fields of small synthetic cells and rods
(:mod:`aadet.data.synthetic`), which the demo config's resize shrinks, the suggested recipe learns
where the demo's does not (``test_suggested_recipe_learns_better``, in ``make test-learning``).
"""

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "BoxStatistics",
    "Recipe",
    "box_statistics",
    "load_coco_boxes",
    "misfit_share",
    "suggest_recipe",
    "suggest_norm",
    "format_statistics",
    "strides_of",
    "to_yaml_lines",
]

QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
SMALL_QUANTILE = 0.05  # "the small objects" of the rule
LARGE_QUANTILE = 0.95  # "the large objects" (reported; the anchors double per level past them)
MIN_OBJECT_STRIDES = 2.0  # small objects are resized to this many strides of the finest level
SIZE_MULTIPLE = 32  # test sizes are multiples of this (FPN strides up to 32 divide it)
JITTER = (0.8, 1.2)  # training long side range, relative to the test size (papers: 512-768 / 640)
SQUARE_FIT = 2.25  # h / w more than this off an anchor's: IoU < 0.5 at equal area (1 / (2 sqrt(r) - 1))
MAX_MISFIT_SHARE = 0.25  # more boxes than this beyond SQUARE_FIT of the median shape: three ratios
MIN_DETECTIONS = 100  # Detectron2's default TEST.DETECTIONS_PER_IMAGE
#: Images per worker from which BN is suggested; GN below (rule 5, :func:`suggest_norm`).
BN_MIN_IMAGES_PER_WORKER = 8


@dataclass
class BoxStatistics:
    """Boxes of one split: ``wh [N, 2]`` (width, height in pixels), ``boxes_per_image [M]``,
    ``image_wh [M, 2]``, and the number of categories."""

    name: str
    wh: np.ndarray
    boxes_per_image: np.ndarray
    image_wh: np.ndarray
    num_classes: int = 1

    @property
    def sizes(self) -> np.ndarray:
        """``sqrt(w * h)`` per box, ``[N]``."""
        return np.sqrt(self.wh[:, 0] * self.wh[:, 1])

    @property
    def aspect_ratios(self) -> np.ndarray:
        """``h / w`` per box (Detectron2's ASPECT_RATIOS convention), ``[N]``."""
        return self.wh[:, 1] / self.wh[:, 0]

    def quantiles(self) -> Dict[str, np.ndarray]:
        """``QUANTILES`` of width, height, size, area, aspect (h/w) and boxes per image."""
        q = np.asarray(QUANTILES)
        out = {}
        if len(self.wh):
            out.update(
                width=np.quantile(self.wh[:, 0], q),
                height=np.quantile(self.wh[:, 1], q),
                size=np.quantile(self.sizes, q),
                area=np.quantile(self.wh[:, 0] * self.wh[:, 1], q),
                aspect=np.quantile(self.aspect_ratios, q),
            )
        if len(self.boxes_per_image):
            out["boxes_per_image"] = np.quantile(self.boxes_per_image, q)
        return out


def load_coco_boxes(json_file: str, name: Optional[str] = None) -> BoxStatistics:
    """:class:`BoxStatistics` of a COCO detection json (``iscrowd`` boxes and boxes with
    ``w <= 0`` or ``h <= 0`` are left out, as Detectron2's training loader does)."""
    with open(json_file) as f:
        coco = json.load(f)
    images = coco.get("images", [])
    index = {im["id"]: i for i, im in enumerate(images)}
    counts = np.zeros(len(images), np.int64)
    wh = []
    for ann in coco.get("annotations", []):
        if ann.get("iscrowd", 0):
            continue
        w, h = float(ann["bbox"][2]), float(ann["bbox"][3])
        if not (w > 0 and h > 0):
            continue
        wh.append((w, h))
        if ann.get("image_id") in index:
            counts[index[ann["image_id"]]] += 1
    image_wh = np.array([(im["width"], im["height"]) for im in images], np.float64).reshape(-1, 2)
    return BoxStatistics(
        name=name or os.path.splitext(os.path.basename(json_file))[0],
        wh=np.asarray(wh, np.float64).reshape(-1, 2),
        boxes_per_image=counts,
        image_wh=image_wh,
        num_classes=len(coco.get("categories", [])),
    )


def box_statistics(dataset_dicts: Sequence[dict], name: str = "dataset") -> BoxStatistics:
    """:class:`BoxStatistics` of Detectron2 dataset dicts (``DatasetCatalog.get(name)``)."""
    from detectron2.structures import BoxMode

    wh, counts, image_wh, classes = [], [], [], set()
    for d in dataset_dicts:
        n = 0
        for ann in d.get("annotations", []):
            if ann.get("iscrowd", 0):
                continue
            x0, y0, x1, y1 = BoxMode.convert(ann["bbox"], ann["bbox_mode"], BoxMode.XYXY_ABS)
            if x1 > x0 and y1 > y0:
                wh.append((x1 - x0, y1 - y0))
                classes.add(ann.get("category_id", 0))
                n += 1
        counts.append(n)
        image_wh.append((d["width"], d["height"]))
    return BoxStatistics(
        name=name,
        wh=np.asarray(wh, np.float64).reshape(-1, 2),
        boxes_per_image=np.asarray(counts, np.int64),
        image_wh=np.asarray(image_wh, np.float64).reshape(-1, 2),
        num_classes=max(len(classes), 1),
    )


def strides_of(in_features: Sequence[str]) -> List[int]:
    """Strides of FPN levels named ``pN`` (``"p3"`` -> 8), e.g. ``MODEL.RETINANET.IN_FEATURES``."""
    out = []
    for f in in_features:
        if not (f.startswith("p") and f[1:].isdigit()):
            raise ValueError(f"FPN level names must be 'pN' (stride 2^N); got {f!r}")
        out.append(2 ** int(f[1:]))
    return out


@dataclass
class Recipe:
    """The suggested recipe; :meth:`yaml_lines` writes it as config keys."""

    scale: float  # test size / median image long side
    test_size: int
    long_side_range: Tuple[int, int]
    crop_size: int
    anchor_sizes: List[List[float]]
    aspect_ratios: List[float]
    detections_per_image: int
    max_input_size: int  # MODEL.AA.MAX_INPUT_SIZE covering training crops and test images
    notes: List[str] = field(default_factory=list)
    norm: Optional[str] = None  # backbone and FPN norm (rule 5); None: not suggested

    def config_dict(self) -> dict:
        """Nested ``{section: {key: value}}`` of the suggested config keys."""
        norm = {} if self.norm is None else {"RESNETS": {"NORM": self.norm}, "FPN": {"NORM": self.norm}}
        return {
            "MODEL": {
                **norm,
                "ANCHOR_GENERATOR": {
                    "SIZES": self.anchor_sizes,
                    "ASPECT_RATIOS": [self.aspect_ratios],
                },
                "AA": {"MAX_INPUT_SIZE": self.max_input_size},
            },
            "INPUT": {
                "SCALE_JITTER": {
                    "LONG_SIDE_RANGE": list(self.long_side_range),
                    "CROP_SIZE": self.crop_size,
                },
                "MIN_SIZE_TEST": self.test_size,
                "MAX_SIZE_TEST": self.test_size,
            },
            "TEST": {"DETECTIONS_PER_IMAGE": self.detections_per_image},
        }

    def yaml_lines(self) -> List[str]:
        """The config keys as YAML lines (flow style lists), ready to paste."""
        return to_yaml_lines(self.config_dict())


def _fmt(v) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:g}" if v != int(v) else f"{v:.1f}"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def to_yaml_lines(d: dict, indent: int = 0) -> List[str]:
    lines = []
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(" " * indent + f"{k}:")
            lines += to_yaml_lines(v, indent + 2)
        else:
            lines.append(" " * indent + f"{k}: {_fmt(v)}")
    return lines


def _round_to(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def misfit_share(aspect: np.ndarray) -> float:
    """Share of the boxes (``h / w`` each) that an anchor of the median shape and the same area
    cannot match at IoU 0.5: their ``h / w`` is more than ``SQUARE_FIT`` times off the median."""
    log_r = np.log(aspect)
    return float(np.mean(np.abs(log_r - np.median(log_r)) > math.log(SQUARE_FIT)))


def suggest_aspect_ratios(aspect: np.ndarray) -> List[float]:
    """Rule 3 of the module docstring, on ``h / w`` per box."""
    log_r = np.log(aspect)
    if misfit_share(aspect) <= MAX_MISFIT_SHARE:
        return [round(float(math.exp(np.median(log_r))), 1)]
    return [round(float(math.exp(np.quantile(log_r, q))), 2) for q in (1 / 6, 1 / 2, 5 / 6)]


def suggest_norm(images_per_worker: int) -> Tuple[str, str]:
    """Rule 5: the norm of the backbone and FPN for ``images_per_worker`` training images per
    process, and why (one line, for the written config and the report).

    Raises:
        ValueError: ``images_per_worker`` is not a positive integer.
    """
    if not isinstance(images_per_worker, int) or images_per_worker < 1:
        raise ValueError(f"images_per_worker must be an integer >= 1; got {images_per_worker!r}")
    if images_per_worker >= BN_MIN_IMAGES_PER_WORKER:
        return "BN", (f"BN (the papers' norm): {images_per_worker} images per worker, at least the "
                      f"{BN_MIN_IMAGES_PER_WORKER} its batch statistics need")
    return "GN", (f"GN: {images_per_worker} images per worker, fewer than the {BN_MIN_IMAGES_PER_WORKER} "
                  "BN's batch statistics need (Wu & He, Group Normalization); BN from "
                  f"{BN_MIN_IMAGES_PER_WORKER} up")


def suggest_recipe(
    stats: BoxStatistics,
    strides: Sequence[int] = (8, 16, 32),
    octaves: int = 3,
    max_scale: float = 4.0,
    max_size: int = 1024,
    max_crop_size: int = 640,
    images_per_worker: Optional[int] = None,
) -> Recipe:
    """The recipe of the module docstring for the boxes in ``stats`` (the training split).

    Args:
        strides: strides of the FPN levels the head reads (:func:`strides_of` of
            ``MODEL.RETINANET.IN_FEATURES``), ascending, each twice the previous.
        octaves: anchor sizes per level (the RetinaNet recipe: 3, ``2^(k/3)``).
        max_scale: the largest enlargement (and, inverted, reduction) of the images.
        max_size: the largest test long side.
        max_crop_size: the largest training crop (the base config's ``CROP_SIZE`` bounds the cost
            of an iteration).
        images_per_worker: training images per process (the base config's batch); given, the
            recipe suggests the norm (rule 5) and says why in its notes.

    Raises:
        ValueError: no boxes, or strides that do not double per level.
    """
    if len(stats.wh) == 0:
        raise ValueError(f"{stats.name}: no boxes; cannot suggest anchors for an empty dataset")
    strides = [int(s) for s in strides]
    if any(b != 2 * a for a, b in zip(strides, strides[1:])) or not strides:
        raise ValueError(f"strides must double per level (e.g. 8, 16, 32); got {strides}")
    if octaves < 1 or max_scale < 1 or max_size < SIZE_MULTIPLE or max_crop_size < SIZE_MULTIPLE:
        raise ValueError(
            f"need octaves >= 1, max_scale >= 1, max_size and max_crop_size >= {SIZE_MULTIPLE}; "
            f"got {octaves}, {max_scale}, {max_size}, {max_crop_size}"
        )
    notes = []
    sizes = stats.sizes
    small, large = np.quantile(sizes, [SMALL_QUANTILE, LARGE_QUANTILE])
    long_side = float(np.median(stats.image_wh.max(axis=1))) if len(stats.image_wh) else 640.0

    # 1. scale and sizes
    target = MIN_OBJECT_STRIDES * strides[0]
    scale = min(max(target / small, 1.0 / max_scale), max_scale, max_size / long_side)
    if scale * small < target * 0.99:
        notes.append(
            f"small objects ({small:.1f} px) reach only {scale * small:.1f} px at the largest "
            f"allowed scale ({scale:.2f}x), below the finest anchor ({target:.0f} px); each still gets "
            f"its best anchor, but a finer level (p2) would fit them"
        )
    test_size = min(_round_to(scale * long_side, SIZE_MULTIPLE), max_size)
    scale = test_size / long_side  # the scale actually used
    long_side_range = (
        _round_to(JITTER[0] * test_size, 8),
        _round_to(JITTER[1] * test_size, 8),
    )
    crop_size = min(test_size, int(max_crop_size))

    # 2. anchors: the small objects at the test scale fit the finest anchor, never below
    # MIN_OBJECT_STRIDES strides (anchors of one stride did not train in the demo's trials)
    base = max(small * scale, target)
    anchor_sizes = [
        [round(base * (s / strides[0]) * 2 ** (k / octaves)) * 1.0 for k in range(octaves)]
        for s in strides
    ]
    if large * scale > anchor_sizes[-1][-1] * math.sqrt(2):
        notes.append(
            f"large objects ({large * scale:.0f} px at the test scale) exceed the largest anchor "
            f"({anchor_sizes[-1][-1]:.0f} px) by more than sqrt(2): add a coarser level (p6)"
        )

    # 3. shapes, 4. detections per image
    aspect_ratios = suggest_aspect_ratios(stats.aspect_ratios)
    most = int(stats.boxes_per_image.max()) if len(stats.boxes_per_image) else 0
    detections = max(MIN_DETECTIONS, 2 * most)
    max_input = int(math.ceil(max(test_size, crop_size, long_side_range[1]) / 128.0) * 128)
    norm = None
    if images_per_worker is not None:
        norm, why = suggest_norm(images_per_worker)
        notes.append(f"norm {why}")
    return Recipe(
        scale=scale,
        test_size=test_size,
        long_side_range=long_side_range,
        crop_size=crop_size,
        anchor_sizes=anchor_sizes,
        aspect_ratios=aspect_ratios,
        detections_per_image=detections,
        max_input_size=max_input,
        notes=notes,
        norm=norm,
    )


def format_statistics(stats: BoxStatistics) -> List[str]:
    """Human-readable lines: counts, then one line of quantiles per quantity."""
    n_img, n_box = len(stats.image_wh), len(stats.wh)
    lines = [f"{stats.name}: {n_img} images, {n_box} boxes, {stats.num_classes} categories"]
    if len(stats.image_wh):
        lo, hi = stats.image_wh.min(axis=0), stats.image_wh.max(axis=0)
        lines.append(f"  image size (w x h): {lo[0]:.0f}x{lo[1]:.0f} .. {hi[0]:.0f}x{hi[1]:.0f}")
    lines.append("  quantile        " + " ".join(f"{q:>7g}" for q in QUANTILES))
    for key, values in stats.quantiles().items():
        label = {"size": "sqrt(w*h)", "aspect": "h/w"}.get(key, key)
        lines.append(f"  {label:<15} " + " ".join(f"{v:7.2f}" for v in values))
    return lines
