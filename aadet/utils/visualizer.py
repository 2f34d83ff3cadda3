"""Readable pictures of detections and ground truth, for small images and crowded scenes.

Detectron2's ``Visualizer`` writes ``"Tree 38%"`` over every box at the image's own size: on a
128 px microscopy tile the labels cover the image, and a tile with 60 trees is a wall of text.
Here (all pure functions of numpy images, used by ``tools/visualize_detections.py`` and the
inference tool):

* :func:`enlarge_factor`: images whose short side is below ``min_side`` (512) are enlarged by an
  integer factor with nearest-neighbour resampling (every source pixel becomes a crisp f x f block,
  boxes scale exactly by f);
* :func:`draw_instances`: with at most ``max_labels`` boxes, each gets a short text label
  (``"87%"``, with the class name only when several classes are drawn: one class is named in the
  legend); in a crowded scene no box gets text. Boxes are coloured by score (a colour bar
  from the threshold to 1 in the legend) when all boxes are of one class, else by class (a legend
  of class colours). Ground truth (no scores) is drawn in one colour per class;
* :func:`side_by_side`: panels (same image, same factor, hence same canvas size) next to each
  other with a title above each, so that a box in one panel sits at the same place in the other.

Every panel is ``[f*H + LEGEND_HEIGHT, f*W, 3]`` uint8 RGB: the enlarged image above a legend strip.
"""

import math
from typing import List, Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "enlarge_factor",
    "enlarge",
    "draw_instances",
    "side_by_side",
    "score_color",
    "class_color",
    "panel_origin",
    "LEGEND_HEIGHT",
    "TITLE_HEIGHT",
]

MIN_SIDE = 512  # images are enlarged until the short side is at least this
MAX_LABELS = 10  # more boxes than this: no text per box
LEGEND_HEIGHT = 28  # pixels of the legend strip below every panel
TITLE_HEIGHT = 24  # pixels of the title above each side_by_side panel
GAP = 8  # pixels between side_by_side panels
FONT_SIZE = 13
_BACKGROUND = (255, 255, 255)
_TEXT = (0, 0, 0)
# Score colours: a ramp from cyan (low) through yellow to red (high), bright on dark and green images.
_RAMP = np.array([(0, 255, 255), (255, 255, 0), (255, 0, 0)], np.float64)
# Class colours (distinct, bright); ground truth of a single class is drawn in the first.
_PALETTE = [
    (0, 255, 0), (255, 0, 255), (0, 160, 255), (255, 160, 0), (255, 255, 255),
    (160, 0, 255), (255, 0, 0), (0, 255, 200), (200, 255, 0), (255, 120, 180),
]


def _font(size: int = FONT_SIZE):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed bitmap font
        return ImageFont.load_default()


def enlarge_factor(height: int, width: int, min_side: int = MIN_SIDE) -> int:
    """The integer factor that brings the short side to at least ``min_side`` (1 if it is)."""
    short = min(int(height), int(width))
    if short <= 0:
        raise ValueError(f"image has no pixels: {height}x{width}")
    return max(1, math.ceil(min_side / short))


def enlarge(image: np.ndarray, factor: int) -> np.ndarray:
    """``[H, W, 3]`` -> ``[f*H, f*W, 3]`` by nearest neighbour (each pixel an f x f block)."""
    if factor == 1:
        return image
    return np.repeat(np.repeat(image, factor, axis=0), factor, axis=1)


def score_color(score: float, threshold: float = 0.0) -> tuple:
    """RGB colour of a score on the ramp from ``threshold`` (cyan) to 1 (red)."""
    t = 0.0 if threshold >= 1 else float(np.clip((score - threshold) / (1 - threshold), 0, 1))
    pos = t * (len(_RAMP) - 1)
    i = min(int(pos), len(_RAMP) - 2)
    c = _RAMP[i] + (pos - i) * (_RAMP[i + 1] - _RAMP[i])
    return tuple(int(round(v)) for v in c)


def class_color(class_id: int) -> tuple:
    return _PALETTE[int(class_id) % len(_PALETTE)]


def _name(class_names, c) -> str:
    return class_names[c] if class_names is not None and 0 <= c < len(class_names) else str(c)


def draw_instances(
    image: np.ndarray,
    boxes,
    scores=None,
    classes=None,
    class_names: Optional[Sequence[str]] = None,
    *,
    threshold: float = 0.0,
    factor: Optional[int] = None,
    min_side: int = MIN_SIDE,
    max_labels: int = MAX_LABELS,
    line_width: Optional[int] = None,
) -> np.ndarray:
    """Draw boxes on an (enlarged) copy of ``image`` with a legend strip below it.

    Args:
        image: ``[H, W, 3]`` uint8 RGB.
        boxes: ``[N, 4]`` XYXY in ``image``'s pixels (array, tensor or Detectron2 ``Boxes``).
        scores: ``[N]`` in [0, 1] for detections; None for ground truth.
        classes: ``[N]`` class indices into ``class_names``; None = all class 0.
        class_names: names for the legend and labels.
        threshold: the lowest score drawn (the colour bar starts there); boxes below are skipped.
        factor: enlargement (default :func:`enlarge_factor` with ``min_side``); pass the same
            factor to panels that must line up.
        max_labels: above this many boxes, no text per box (colours and the legend only).
        line_width: box outline in output pixels (default: 1 per 256 px of the short side, >= 2).

    Returns:
        ``[f*H + LEGEND_HEIGHT, f*W, 3]`` uint8 RGB.
    """
    image = np.ascontiguousarray(image)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be [H, W, 3] uint8 RGB; got {image.shape} {image.dtype}")
    boxes = np.asarray(getattr(boxes, "tensor", boxes), np.float64).reshape(-1, 4)
    n = len(boxes)
    scores = None if scores is None else np.asarray(scores, np.float64).reshape(-1)
    classes = np.zeros(n, np.int64) if classes is None else np.asarray(classes, np.int64).reshape(-1)
    if (scores is not None and len(scores) != n) or len(classes) != n:
        raise ValueError(f"boxes, scores and classes differ in length: {n}, "
                         f"{None if scores is None else len(scores)}, {len(classes)}")
    if scores is not None:
        keep = scores >= threshold
        boxes, scores, classes = boxes[keep], scores[keep], classes[keep]
        n = len(boxes)
    h, w = image.shape[:2]
    f = factor or enlarge_factor(h, w, min_side)
    canvas = Image.new("RGB", (w * f, h * f + LEGEND_HEIGHT), _BACKGROUND)
    canvas.paste(Image.fromarray(enlarge(image, f)), (0, 0))
    draw = ImageDraw.Draw(canvas)
    lw = line_width or max(2, round(min(h, w) * f / 256))
    font = _font()
    present = sorted(set(classes.tolist()))
    by_score = scores is not None and len(present) <= 1
    label_each = n <= max_labels

    order = np.argsort(scores) if scores is not None else np.arange(n)  # best drawn last, on top
    for i in order:
        x0, y0, x1, y1 = (boxes[i] * f).tolist()
        color = score_color(scores[i], threshold) if by_score else class_color(classes[i])
        x0, x1 = min(x0, x1), max(x0, x1)
        y0, y1 = min(y0, y1), max(y0, y1)
        draw.rectangle([x0, y0, max(x0, x1 - 1), max(y0, y1 - 1)], outline=color, width=lw)
        if label_each:
            text = _name(class_names, classes[i]) if len(present) > 1 else ""  # one class: legend
            if scores is not None:
                text = f"{text} {scores[i]:.0%}".strip()
            if text:
                tb = draw.textbbox((0, 0), text, font=font)
                tw, th = tb[2] - tb[0], tb[3] - tb[1]
                ty = y0 - th - 4 if y0 - th - 4 >= 0 else y1 + 1  # above the box, else below
                tx = min(max(0, x0), w * f - tw - 4)
                draw.rectangle([tx, ty, tx + tw + 4, ty + th + 4], fill=color)
                draw.text((tx + 2, ty + 2 - tb[1]), text, fill=_TEXT, font=font)
    _legend(draw, w * f, h * f, n, scores, classes, present, class_names, threshold, by_score, font)
    return np.asarray(canvas)


def _legend(draw, width, top, n, scores, classes, present, class_names, threshold, by_score, font):
    """The strip below the image: count, then a colour bar (by score) or class swatches."""
    y0, y1 = top + 6, top + LEGEND_HEIGHT - 6
    kind = "detections" if scores is not None else "boxes"
    text = f"{n} {kind}" + (f" >= {threshold:.2f}" if scores is not None else "")
    draw.text((6, y0), text, fill=_TEXT, font=font)
    x = 6 + int(draw.textlength(text, font=font)) + 16
    if by_score:
        name = _name(class_names, present[0]) if present else ""
        label = f"{name} score {threshold:.2f}".strip()
        draw.text((x, y0), label, fill=_TEXT, font=font)
        x += int(draw.textlength(label, font=font)) + 6
        bar = max(40, min(200, width - x - 44))
        for i in range(bar):
            c = score_color(threshold + (1 - threshold) * i / max(bar - 1, 1), threshold)
            draw.line([(x + i, y0), (x + i, y1)], fill=c)
        draw.text((x + bar + 6, y0), "1.00", fill=_TEXT, font=font)
        return
    for c in present or ([0] if scores is None else []):
        color = class_color(c)
        draw.rectangle([x, y0, x + 14, y1], fill=color, outline=_TEXT)
        name = _name(class_names, c)
        draw.text((x + 20, y0), name, fill=_TEXT, font=font)
        x += 20 + int(draw.textlength(name, font=font)) + 16


def side_by_side(*panels: np.ndarray, titles: Sequence[str] = ()) -> np.ndarray:
    """Panels of the same size (e.g. ground truth and detections drawn with the same factor) left
    to right, ``GAP`` px apart, each under a ``TITLE_HEIGHT`` title strip.

    Raises:
        ValueError: panels of different sizes (they would not line up).
    """
    if not panels:
        raise ValueError("side_by_side needs at least one panel")
    shapes = {p.shape for p in panels}
    if len(shapes) != 1:
        raise ValueError(f"panels must have the same shape to line up; got {sorted(shapes)}")
    h, w = panels[0].shape[:2]
    titles = list(titles) + [""] * (len(panels) - len(titles))
    out = Image.new("RGB", (len(panels) * w + (len(panels) - 1) * GAP, h + TITLE_HEIGHT), _BACKGROUND)
    draw = ImageDraw.Draw(out)
    font = _font(FONT_SIZE + 2)
    for i, (p, t) in enumerate(zip(panels, titles)):
        x = i * (w + GAP)
        out.paste(Image.fromarray(p), (x, TITLE_HEIGHT))
        draw.text((x + 6, 4), t, fill=_TEXT, font=font)
    return np.asarray(out)


def panel_origin(index: int, panel_width: int) -> List[int]:
    """``(x, y)`` of panel ``index``'s image corner in :func:`side_by_side`'s output."""
    return [index * (panel_width + GAP), TITLE_HEIGHT]
