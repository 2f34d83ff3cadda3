"""Readable pictures (aadet/utils/visualizer.py): pixel facts -- small images enlarged exactly, no
text per box in crowded scenes, a colour bar by score, ground truth and detections aligned."""
import numpy as np
import pytest

from aadet.utils.visualizer import (
    GAP,
    LEGEND_HEIGHT,
    TITLE_HEIGHT,
    class_color,
    draw_instances,
    enlarge_factor,
    panel_origin,
    score_color,
    side_by_side,
)


def _tile(h=128, w=128, seed=0):
    return np.random.RandomState(seed).randint(40, 90, (h, w, 3)).astype(np.uint8)


def _outline_mask(boxes, f, lw, shape):
    """Pixels of the drawn rectangle outlines (``lw`` wide, inside the box) on the enlarged image."""
    m = np.zeros(shape, bool)
    for x0, y0, x1, y1 in boxes * f:
        x0, y0, x1, y1 = int(np.floor(x0)), int(np.floor(y0)), int(np.ceil(x1)), int(np.ceil(y1))
        box = np.zeros(shape, bool)
        box[max(y0 - 1, 0): y1 + 1, max(x0 - 1, 0): x1 + 1] = True
        inner = np.zeros(shape, bool)
        inner[y0 + lw + 1: y1 - lw - 1, x0 + lw + 1: x1 - lw - 1] = True
        m |= box & ~inner
    return m


def _crowd(n=30, seed=1, size=128):
    rng = np.random.RandomState(seed)
    xy = rng.uniform(0, size - 20, (n, 2))
    wh = rng.uniform(4, 18, (n, 2))
    return np.concatenate([xy, xy + wh], 1), rng.uniform(0.5, 1.0, n)


def test_small_images_are_enlarged_by_an_integer_factor():
    assert enlarge_factor(128, 128) == 4 and enlarge_factor(100, 300) == 6
    assert enlarge_factor(512, 700) == 1 and enlarge_factor(3000, 4000) == 1
    img = _tile(128, 100)
    out = draw_instances(img, np.zeros((0, 4)))
    assert out.shape == (6 * 128 + LEGEND_HEIGHT, 6 * 100, 3)
    # nearest neighbour: each source pixel is a crisp 6x6 block
    np.testing.assert_array_equal(out[: 6 * 128], np.repeat(np.repeat(img, 6, 0), 6, 1))
    assert draw_instances(_tile(600, 800), np.zeros((0, 4))).shape == (600 + LEGEND_HEIGHT, 800, 3)
    with pytest.raises(ValueError, match="uint8"):
        draw_instances(img.astype(np.float32), np.zeros((0, 4)))


def test_crowded_scene_has_no_text_per_box_and_a_colour_bar():
    img = _tile()
    boxes, scores = _crowd()
    f, lw = 4, 2
    out = draw_instances(img, boxes, scores, threshold=0.5)
    base = np.repeat(np.repeat(img, f, 0), f, 1)
    changed = (out[: 128 * f] != base).any(-1)
    outline = _outline_mask(boxes, f, lw, changed.shape)
    assert changed.sum() > 5000  # boxes were drawn
    assert not (changed & ~outline).any(), "crowded: every drawn pixel is on a box outline"
    # the same boxes with labels on: text backgrounds cover pixels off the outlines
    labelled = draw_instances(img, boxes, scores, threshold=0.5, max_labels=100)
    changed_l = (labelled[: 128 * f] != base).any(-1)
    assert (changed_l & ~outline).sum() > 1000
    # colour bar in the legend: the ramp from the threshold's colour (cyan) to 1's (red), in order
    legend = out[128 * f + LEGEND_HEIGHT // 2]
    cols = lambda c: np.flatnonzero((legend == np.array(c)).all(-1))  # noqa: E731
    lo, hi = cols(score_color(0.5, 0.5)), cols(score_color(1.0, 0.5))
    assert score_color(0.5, 0.5) == (0, 255, 255) and score_color(1.0, 0.5) == (255, 0, 0)
    assert len(lo) and len(hi) and lo.max() < hi.min()
    assert len({tuple(p) for p in legend[lo.min(): hi.max() + 1]}) >= 40  # a continuous ramp
    # boxes are coloured by score: the best box's outline is red
    x0, y0 = (boxes[np.argmax(scores)][:2] * f).astype(int) + 1
    assert tuple(out[y0, x0]) == score_color(scores.max(), 0.5)


def test_threshold_hides_low_scores():
    img = _tile()
    boxes = np.array([[10, 10, 30, 30], [60, 60, 90, 90]], float)
    out = draw_instances(img, boxes, [0.9, 0.3], threshold=0.5)
    base = np.repeat(np.repeat(img, 4, 0), 4, 1)
    assert (out[40, 40:120] != base[40, 40:120]).any()  # first box top edge drawn
    np.testing.assert_array_equal(out[240, 240:360], base[240, 240:360])  # second not


def test_several_classes_are_coloured_by_class_with_a_legend():
    img = _tile()
    boxes = np.array([[10, 10, 30, 30], [60, 60, 90, 90]], float)
    out = draw_instances(img, boxes, [0.9, 0.8], [0, 2], ["a", "b", "c"], threshold=0.5)
    assert tuple(out[41, 41]) == class_color(0) and tuple(out[241, 241]) == class_color(2)
    legend = out[128 * 4:]
    for c in (0, 2):
        assert (legend == np.array(class_color(c))).all(-1).sum() > 50  # a swatch per class
    assert not (legend == np.array(class_color(1))).all(-1).any()  # absent class: no swatch


def test_ground_truth_and_detections_line_up():
    img = _tile()
    boxes = np.array([[20, 24, 50, 60], [70, 10, 100, 40]], float)
    gt = draw_instances(img, boxes, None, None, ["cell"])
    pred = draw_instances(img, boxes, [0.95, 0.7], None, ["cell"], threshold=0.5)
    assert gt.shape == pred.shape
    both = side_by_side(gt, pred, titles=("ground truth", "detections"))
    w = gt.shape[1]
    assert both.shape == (gt.shape[0] + TITLE_HEIGHT, 2 * w + GAP, 3)
    for i, panel in enumerate((gt, pred)):
        x, y = panel_origin(i, w)
        np.testing.assert_array_equal(both[y: y + panel.shape[0], x: x + w], panel)
    # the same box corner in both panels: outline colour at the same offset
    for (x0, y0, _, _), s in zip(boxes * 4, (0.95, 0.7)):
        px, py = int(x0) + 1, int(y0) + 1
        assert tuple(both[TITLE_HEIGHT + py, px]) == class_color(0)
        x1, y1 = panel_origin(1, w)
        assert tuple(both[y1 + py, x1 + px]) == score_color(s, 0.5)
    with pytest.raises(ValueError, match="same shape"):
        side_by_side(gt, draw_instances(_tile(100, 128), boxes))
