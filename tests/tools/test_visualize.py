"""The visualization tools write real images: detections (and ground truth side by side), and
augmented training samples. Boxes are checked pixel by pixel: each drawn box's outline has its
colour all around, the image is untouched away from the outlines, labels and legend strip, panels
are aligned with the (enlarged) source image, and sizes are exact.

Two drawings are checked: ``visualize_detections`` draws with :mod:`aadet.utils.visualizer`
(small images enlarged by an integer nearest-neighbour factor, outlines inside the box edges,
score-coloured, a label above each box's top-left corner, a legend strip below, titled panels);
``visualize_data`` still draws with Detectron2's ``Visualizer``."""
import os

import numpy as np
import pytest
import torch
from detectron2.data import DatasetCatalog, DatasetMapper
from detectron2.modeling import build_model
from detectron2.structures import BoxMode, Boxes, Instances
from detectron2.utils.colormap import random_color
from PIL import Image

import aadet  # noqa: F401
from aadet.data.augmentation import build_augmentation
from aadet.engine import AADetCheckpointer, CheckpointMismatchError, load_config
from aadet.utils.visualizer import (
    GAP,
    LEGEND_HEIGHT,
    TITLE_HEIGHT,
    class_color,
    enlarge_factor,
    panel_origin,
    score_color,
)

from tests.helpers import REPO, load_tool

visualize_data, visualize_detections = load_tool("visualize_data"), load_tool("visualize_detections")
DEMO = os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml")

# visualize_data: Detectron2's Visualizer at these image sizes (default font 10 px): a box
# outline is a line about 2.5 px wide centred on the edge, so the pixels on either side of the edge are fully
# coloured and nothing lies more than BAND px from it. A label ("Tree 90%", at most ~65 x 12 px)
# starts at the box's top-left corner, inside it; for a small box (< 40 px high) below it or
# right of it (Visualizer.overlay_instances).
BAND = 3
LABEL_W, LABEL_H = 80, 20


def _pixel_centres(shape):
    ys, xs = np.mgrid[0 : shape[0], 0 : shape[1]]
    return xs + 0.5, ys + 0.5


def _band(shape, box, width):
    """Pixels whose centre lies within ``width`` of the outline of ``box`` (XYXY)."""
    xs, ys = _pixel_centres(shape)
    x0, y0, x1, y1 = box
    outer = (xs > x0 - width) & (xs < x1 + width) & (ys > y0 - width) & (ys < y1 + width)
    inner = (xs > x0 + width) & (xs < x1 - width) & (ys > y0 + width) & (ys < y1 - width)
    return outer & ~inner


def _rect(shape, x0, y0, x1, y1):
    xs, ys = _pixel_centres(shape)
    return (xs > x0) & (xs < x1) & (ys > y0) & (ys < y1)


def _label_zone(shape, box):
    """Where the box's label may be, by Visualizer.overlay_instances' rule: from the top-left
    corner; for a small box from the bottom-left corner, or from the top-right one when the box
    touches the image's bottom."""
    x0, y0, x1, y1 = box
    if y1 - y0 >= 40 and (x1 - x0) * (y1 - y0) >= 1000:
        x, y = x0, y0
    elif y1 >= shape[0] - 5:
        x, y = x1, y0
    else:
        x, y = x0, y1
    return _rect(shape, x - 1, y - 1, x + LABEL_W, y + LABEL_H)


def check_boxes_drawn(drawn, source, boxes, min_core_changed=1.0, min_visible=0.8):
    """``drawn`` is ``source`` (both ``[H, W, 3]`` uint8 RGB, same size) with exactly ``boxes``
    (``[N, 4]`` XYXY) drawn: each box's core outline pixels (within 1 px of the edge, away from
    labels) changed, and nothing changed outside the outline bands and label zones. Outlines
    hidden under other boxes' labels (crowded small boxes) are skipped, at most
    ``1 - min_visible`` of them.

    Returns ``(changed, allowed)`` masks for further checks."""
    assert drawn.shape == source.shape, (drawn.shape, source.shape)
    shape = drawn.shape[:2]
    changed = (drawn.astype(int) != source.astype(int)).any(axis=-1)
    labels = np.zeros(shape, bool)
    allowed = np.zeros(shape, bool)
    for box in boxes:
        labels |= _label_zone(shape, box)
        allowed |= _band(shape, box, BAND)
    allowed |= labels
    checked = 0
    for box in boxes:
        core = _band(shape, box, 1) & ~labels
        if core.sum() < 20:  # a small box under other boxes' labels
            continue
        frac = changed[core].mean()
        assert frac >= min_core_changed, f"box {box}: only {frac:.0%} of its outline is drawn"
        checked += 1
    assert checked >= min_visible * len(boxes), f"only {checked} of {len(boxes)} outlines visible"
    stray = changed & ~allowed
    ys, xs = np.nonzero(stray)
    assert not stray.any(), (
        f"{stray.sum()} pixels changed away from the boxes, e.g. (x, y) = ({xs[:1]}, {ys[:1]})"
    )
    return changed, allowed


# visualize_detections: aadet.utils.visualizer. Boxes are scaled by the enlargement factor f;
# an outline is ``lw`` px wide *inside* the box edge (PIL rectangle, no antialiasing: exactly
# one colour); with at most 10 boxes each gets a label ("90%": ~31 x 14 px, filled with the
# box's colour, black text) whose bottom-left corner is the box's top-left one (below the box
# when there is no room above); below the enlarged image, a LEGEND_HEIGHT white strip.
NEW_LABEL_W, NEW_LABEL_H = 64, 24


def _line_width(h, w, f):
    """draw_instances' default outline width: 1 px per 256 px of the enlarged short side, >= 2."""
    return max(2, round(min(h, w) * f / 256))


def _enlarged(image, f):
    return np.repeat(np.repeat(image, f, axis=0), f, axis=1)


def _ring(shape, box, lw):
    """Pixels inside ``box`` (XYXY, integer corners) within ``lw`` of its edge."""
    x0, y0, x1, y1 = box
    return _rect(shape, x0, y0, x1, y1) & ~_rect(shape, x0 + lw, y0 + lw, x1 - lw, y1 - lw)


def _new_label_zone(shape, box):
    """Where draw_instances may put ``box``'s label: above its top-left corner, from x0 (shifted
    left only at the image's right edge); below the box when it touches the top."""
    x0, y0, x1, y1 = box
    x = min(x0, shape[1] - NEW_LABEL_W)
    zone = _rect(shape, x - 1, y0 - NEW_LABEL_H, x + NEW_LABEL_W, y0 + 1)
    if y0 < NEW_LABEL_H:
        zone |= _rect(shape, x - 1, y1 - 1, x + NEW_LABEL_W, y1 + NEW_LABEL_H)
    return zone


def check_panel(drawn, source, boxes, colours, lw, labelled):
    """``drawn`` (the image part of a draw_instances panel, ``[f*H, f*W, 3]``) is ``source``
    (already enlarged, same size) with exactly ``boxes`` (XYXY, already scaled) drawn in
    ``colours``, in order (later outlines over earlier ones): every outline pixel outside the
    label zones has its box's colour exactly, all around, and every other pixel outside the
    label zones is the source pixel. Returns ``(outlines, labels)`` masks."""
    assert drawn.shape == source.shape, (drawn.shape, source.shape)
    shape = drawn.shape[:2]
    expected = source.astype(int).copy()
    outlines = np.zeros(shape, bool)
    labels = np.zeros(shape, bool)
    rings = []
    for box, colour in zip(boxes, colours):
        ring = _ring(shape, box, lw)
        expected[ring] = colour
        outlines |= ring
        rings.append(ring)
        if labelled:
            labels |= _new_label_zone(shape, box)
    ok = (drawn.astype(int) == expected).all(axis=-1)
    for box, ring in zip(boxes, rings):
        core = ring & ~labels
        x0, y0, x1, y1 = box
        # each of the four sides is checked (a label covers at most part of the top one)
        for side in (_rect(shape, x0, y0, x0 + lw, y1), _rect(shape, x1 - lw, y0, x1, y1),
                     _rect(shape, x0, y1 - lw, x1, y1), _rect(shape, x0, y0, x1, y0 + lw)):
            assert (core & side).sum() >= lw * 4, f"box {box}: a side is hidden under labels"
        frac = ok[core].mean()
        assert frac == 1.0, f"box {box}: only {frac:.1%} of its outline is in its colour"
    stray = ~ok & ~labels & ~outlines
    ys, xs = np.nonzero(stray)
    assert not stray.any(), (
        f"{stray.sum()} pixels changed away from the boxes, e.g. (x, y) = ({xs[:1]}, {ys[:1]})"
    )
    return outlines, labels


def check_label(drawn, box, colour, outlines):
    """The label of ``box``: a rectangle filled with ``colour`` and black text, above the box
    with its bottom-left corner on the box's top-left one."""
    shape = drawn.shape[:2]
    zone = _new_label_zone(shape, box) & ~outlines
    fill = zone & (drawn.astype(int) == np.array(colour)).all(axis=-1)
    ys, xs = np.nonzero(fill)
    x0, y0 = int(box[0]), int(box[1])
    assert len(ys) >= 150, f"box {box}: no label ({len(ys)} pixels of its colour)"
    assert (xs.min(), ys.max()) == (x0, y0 - 1), f"box {box}: label at {xs.min(), ys.max()}"
    assert xs.max() - xs.min() < NEW_LABEL_W and ys.max() - ys.min() < NEW_LABEL_H
    text = zone & (drawn.astype(int) < 60).all(axis=-1)  # black, antialiased edges
    assert text.sum() >= 15, f"box {box}: label without text"
    assert text[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1].sum() == text.sum()


def check_legend(strip, width, colours):
    """A LEGEND_HEIGHT strip: white, black text, and each of ``colours`` (colour bar ends or
    class swatches), nothing of the image."""
    assert strip.shape == (LEGEND_HEIGHT, width, 3)
    white = (strip == 255).all(axis=-1)
    assert white.mean() > 0.5 and white[:, -20:].all()
    assert ((strip.astype(int) < 60).all(axis=-1)).sum() >= 30  # the count, in text
    for c in colours:
        assert (strip == np.array(c)).all(axis=-1).sum() >= 10, f"legend lacks {c}"


def fixed_predictor(boxes, scores):
    """A stand-in for :class:`aadet.engine.Predictor` that 'detects' fixed boxes of class 0."""

    class FixedPredictor:
        def __init__(self, cfg, weights=None):
            self.cfg = cfg

        def __call__(self, image):
            inst = Instances(image.shape[:2])
            inst.pred_boxes = Boxes(torch.tensor(boxes, dtype=torch.float32))
            inst.scores = torch.tensor(scores, dtype=torch.float32)
            inst.pred_classes = torch.zeros(len(boxes), dtype=torch.int64)
            return {"instances": inst}

    return FixedPredictor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A demo model whose classifier bias is raised so that it 'detects' everywhere."""
    cfg = load_config(DEMO, ["MODEL.DEVICE", "cpu"])
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        model.head.cls_score.bias.fill_(3.0)
    path = str(tmp_path_factory.mktemp("ckpt"))
    AADetCheckpointer(model, path).save("model")
    return os.path.join(path, "model.pth")


@pytest.mark.slow  # the real model on a 4000x3000 image (36 s on a shared 2-core machine)
def test_detections_on_a_folder_including_odd_images(checkpoint, tmp_path):
    """RGB, grayscale, RGBA, tiny (32x32) and large (4000x3000) images all work."""
    folder = tmp_path / "in"
    folder.mkdir()
    rng = np.random.RandomState(0)
    Image.fromarray(rng.randint(0, 255, (300, 400, 3), np.uint8)).save(folder / "rgb.png")
    Image.fromarray(rng.randint(0, 255, (200, 250), np.uint8), mode="L").save(folder / "gray.png")
    Image.fromarray(rng.randint(0, 255, (120, 90, 4), np.uint8), mode="RGBA").save(folder / "rgba.png")
    Image.fromarray(rng.randint(0, 255, (32, 32, 3), np.uint8)).save(folder / "tiny.jpg")
    Image.fromarray(np.full((3000, 4000, 3), 90, np.uint8)).save(folder / "large.jpg")
    out = tmp_path / "out"
    written = visualize_detections.main(
        ["--config-file", DEMO, "--weights", checkpoint, "--input", str(folder),
         "--output", str(out), "--threshold", "0.5", "MODEL.DEVICE", "cpu"]
    )
    assert len(written) == 5
    for path in written:
        img = np.asarray(Image.open(path))
        stem = os.path.splitext(os.path.basename(path))[0]
        (src,) = [f for f in os.listdir(folder) if os.path.splitext(f)[0] == stem]
        w, h = Image.open(folder / src).size
        f = enlarge_factor(h, w)  # small images are enlarged (nearest) for drawing
        assert img.shape[:2] == (f * h + LEGEND_HEIGHT, f * w)
        assert f == {"tiny": 16, "rgba": 6, "gray": 3, "rgb": 2, "large": 1}[stem]
    # boxes were drawn: the rgb render's image part differs from its (enlarged) input on many
    # pixels
    drawn = np.asarray(Image.open(out / "rgb.png").convert("RGB")).astype(int)[: 2 * 300]
    orig = _enlarged(np.asarray(Image.open(folder / "rgb.png").convert("RGB")), 2).astype(int)
    assert drawn.shape == orig.shape
    assert (drawn != orig).any(axis=-1).sum() > 1000


# Two confident boxes (room above for their labels) and one below the 0.5 threshold.
DRAWN_BOXES = [[40.0, 30.0, 200.0, 150.0], [250.0, 160.0, 370.0, 270.0]]
DRAWN_SCORES = [0.9, 0.8]
LOW_SCORE_BOX = [10.0, 200.0, 120.0, 290.0]


def test_detections_are_drawn_on_the_boxes_and_nowhere_else(tmp_path, monkeypatch):
    """On a uniform image (enlarged 2x): each detection's outline has its score's colour all
    around, its inside is untouched, its label sits above it, a detection under --threshold is
    not drawn, nothing else changes, and the legend strip below shows the colour bar."""
    monkeypatch.setattr(
        visualize_detections, "Predictor",
        fixed_predictor(DRAWN_BOXES + [LOW_SCORE_BOX], DRAWN_SCORES + [0.2]),
    )  # fmt: skip
    source = np.full((300, 400, 3), 90, np.uint8)
    Image.fromarray(source).save(tmp_path / "gray.png")
    (path,) = visualize_detections.main(
        ["--config-file", DEMO, "--input", str(tmp_path / "gray.png"), "--output",
         str(tmp_path / "out"), "--threshold", "0.5", "MODEL.DEVICE", "cpu"]
    )  # fmt: skip
    drawn = np.asarray(Image.open(path).convert("RGB"))
    f = enlarge_factor(300, 400)
    assert f == 2 and drawn.shape == (2 * 300 + LEGEND_HEIGHT, 2 * 400, 3)
    lw = _line_width(300, 400, f)
    boxes = [[f * v for v in box] for box in DRAWN_BOXES]
    colours = [score_color(s, 0.5) for s in DRAWN_SCORES]
    image = drawn[: f * 300]
    outlines, labels = check_panel(image, _enlarged(source, f), boxes[::-1], colours[::-1], lw, True)
    shape = image.shape[:2]
    changed = (image.astype(int) != 90).any(axis=-1)
    for box, colour in zip(boxes, colours):
        assert np.abs(np.array(colour) - 90).max() >= 20, f"box {box}: outline colour ~ background"
        x0, y0, x1, y1 = box
        assert not changed[_rect(shape, x0 + lw, y0 + lw, x1 - lw, y1 - lw)].any(), "drawn inside"
        check_label(image, box, colour, outlines)
    low = [f * v for v in LOW_SCORE_BOX]
    assert not changed[_band(shape, low, 2 * lw)].any()  # below --threshold: no outline
    assert not changed[_new_label_zone(shape, low)].any()  # ... and no label
    check_legend(drawn[f * 300:], 2 * 400, [score_color(0.5, 0.5), score_color(1.0, 0.5)])


def _xyxy(record):
    return [BoxMode.convert(a["bbox"], a["bbox_mode"], BoxMode.XYXY_ABS)
            for a in record["annotations"]]  # fmt: skip


def test_dataset_with_ground_truth_side_by_side(trees_root, tmp_path, monkeypatch):
    """Ground truth left, detections right, both the source image enlarged by the same factor
    and aligned with it: each panel is the source image with its own boxes drawn (ground truth:
    one class colour, no text with > 10 boxes; detections: score colours and labels), over its
    legend strip, under its title, nothing else."""
    from aadet.data import register_trees

    register_trees(trees_root)
    monkeypatch.setattr(
        visualize_detections, "Predictor", fixed_predictor(DRAWN_BOXES, DRAWN_SCORES)
    )  # fmt: skip
    (path,) = visualize_detections.main(
        ["--config-file", DEMO, "--dataset", "trees_val", "--show-gt",
         "--max-images", "1", "--output", str(tmp_path), "MODEL.DEVICE", "cpu"]
    )  # fmt: skip
    record = DatasetCatalog.get("trees_val")[0]
    assert os.path.basename(path) == os.path.splitext(os.path.basename(record["file_name"]))[0] + ".png"
    source = np.asarray(Image.open(record["file_name"]).convert("RGB"))
    assert source.shape == (record["height"], record["width"], 3) == (400, 400, 3)
    img = np.asarray(Image.open(path).convert("RGB"))
    f = enlarge_factor(400, 400)
    panel_w, image_h = f * 400, f * 400
    # ground truth | detections: two tiles enlarged 2x over legend strips, under titles, a gap
    assert f == 2 and img.shape == (TITLE_HEIGHT + image_h + LEGEND_HEIGHT, 2 * panel_w + GAP, 3)
    big = _enlarged(source, f)
    lw = _line_width(400, 400, f)
    gt_boxes = [[f * v for v in box] for box in _xyxy(record)]
    assert len(gt_boxes) > 10  # crowded: no text per box
    (gx, gy), (dx, dy) = panel_origin(0, panel_w), panel_origin(1, panel_w)
    assert (gx, gy, dx, dy) == (0, TITLE_HEIGHT, panel_w + GAP, TITLE_HEIGHT)
    # The ground-truth panel: all its boxes in the class colour, exactly, the rest the source.
    gt = img[gy: gy + image_h, gx: gx + panel_w]
    outlines, _ = check_panel(gt, big, gt_boxes, [class_color(0)] * len(gt_boxes), lw, False)
    assert (~outlines).mean() > 0.5  # enough untouched pixels for "nothing else" to mean much
    check_legend(img[gy + image_h:, gx: gx + panel_w], panel_w, [class_color(0)])
    # The detections panel: exactly the two detections (score colours, labels), aligned.
    det = img[dy: dy + image_h, dx: dx + panel_w]
    boxes = [[f * v for v in box] for box in DRAWN_BOXES]
    colours = [score_color(s, 0.5) for s in DRAWN_SCORES]  # default --threshold 0.5
    outlines, _ = check_panel(det, big, boxes[::-1], colours[::-1], lw, True)
    for box, colour in zip(boxes, colours):
        check_label(det, box, colour, outlines)
    check_legend(img[dy + image_h:, dx: dx + panel_w], panel_w,
                 [score_color(0.5, 0.5), score_color(1.0, 0.5)])  # fmt: skip
    # Titles: black text on white above each panel; the gap between the panels is white.
    titles = img[:TITLE_HEIGHT].astype(int)
    assert (titles[..., 0] == titles[..., 1]).all() and (titles[..., 1] == titles[..., 2]).all()
    for x in (gx, dx):
        assert (titles[:, x: x + panel_w, 0] < 60).sum() >= 30
    assert (img[:, panel_w: panel_w + GAP] == 255).all()


def test_mismatched_checkpoint_is_refused(tmp_path):
    other = build_model(load_config(DEMO, ["MODEL.DEVICE", "cpu", "MODEL.RETINANET.NUM_CLASSES", "3"]))
    AADetCheckpointer(other, str(tmp_path)).save("other")
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "x.png")
    with pytest.raises(CheckpointMismatchError, match="cls_score"):
        visualize_detections.main(
            ["--config-file", DEMO, "--weights", str(tmp_path / "other.pth"), "--input",
             str(tmp_path / "x.png"), "--output", str(tmp_path / "o"), "MODEL.DEVICE", "cpu"]
        )


def test_missing_or_corrupt_input_is_named(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        visualize_detections.main(["--config-file", DEMO, "--weights", checkpoint, "--input",
                                   str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(RuntimeError, match="bad.png"):
        visualize_detections.main(["--config-file", DEMO, "--weights", checkpoint, "--input",
                                   str(tmp_path / "bad.png"), "--output", str(tmp_path / "o")])


def test_augmented_training_samples(trees_root, tmp_path):
    from aadet.data import register_trees

    register_trees(trees_root)
    written = visualize_data.main(["--config-file", DEMO, "--output", str(tmp_path), "-n", "3"])
    assert len(written) == 3
    for path in written:
        img = np.asarray(Image.open(path))
        assert img.shape == (256, 256, 3)  # crop/pad size of the demo recipe (INPUT.SCALE_JITTER)
    # The samples again, with the tool's seeds and random stream (the augmentation, then one box
    # colour per box): each picture is that augmented image with its boxes drawn, nothing else.
    cfg = load_config(DEMO)
    records = DatasetCatalog.get(cfg.DATASETS.TRAIN[0])[:3]
    mapper = DatasetMapper(cfg, is_train=True, augmentations=build_augmentation(cfg, True))
    torch.manual_seed(0)
    np.random.seed(0)
    num_boxes = 0
    for record, path in zip(records, written):
        sample = mapper(dict(record))
        image = sample["image"].permute(1, 2, 0).numpy().astype("uint8")
        image = np.ascontiguousarray(image[:, :, ::-1] if cfg.INPUT.FORMAT == "BGR" else image)
        boxes = sample["instances"].gt_boxes.tensor.tolist()
        [random_color(rgb=True, maximum=1) for _ in boxes]  # as Visualizer.overlay_instances
        drawn = np.asarray(Image.open(path).convert("RGB"))
        # crowded ~20 px crowns: a small box's label, under it, hides neighbours' outlines
        check_boxes_drawn(drawn, image, boxes, min_core_changed=0.95, min_visible=0.5)
        num_boxes += len(boxes)
    assert num_boxes >= 5


def test_attention_maps_of_an_aa_layer(tmp_path):
    """Figure-10 style: heads x pixels maps, each a distribution over the attention grid."""
    visualize_attention = load_tool("visualize_attention")

    aa_cfg = os.path.join(REPO, "configs", "Demo", "trees_AA_R_26_slim_FPN.yaml")
    cfg = load_config(aa_cfg, ["MODEL.DEVICE", "cpu"])
    torch.manual_seed(0)
    AADetCheckpointer(build_model(cfg), str(tmp_path)).save("aa")
    rng = np.random.RandomState(0)
    Image.fromarray(rng.randint(0, 255, (300, 360, 3), np.uint8)).save(tmp_path / "img.png")
    out, maps = visualize_attention.main(
        ["--config-file", aa_cfg, "--weights", str(tmp_path / "aa.pth"), "--image",
         str(tmp_path / "img.png"), "--pixels", "10,20", "200,150", "359,299",
         "--output", str(tmp_path / "att.png"), "MODEL.DEVICE", "cpu"]
    )
    assert maps.shape[:2] == (cfg.MODEL.AA.NUM_HEADS, 3)
    np.testing.assert_allclose(maps.sum(axis=(2, 3)), 1.0, rtol=1e-4)
    img = np.asarray(Image.open(out))
    # a heads x pixels grid of 2.2-inch panels at 80 dpi
    assert img.shape[:2] == (176 * cfg.MODEL.AA.NUM_HEADS, 176 * 3) and img.std() > 10
    with pytest.raises(SystemExit):
        visualize_attention.main(["--config-file", aa_cfg, "--weights", str(tmp_path / "aa.pth"),
                                  "--image", str(tmp_path / "img.png"), "--pixels", "1,1",
                                  "--layer", "backbone.nope", "MODEL.DEVICE", "cpu"])
