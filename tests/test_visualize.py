"""The visualization tools write real images: detections (and ground truth side by side), and
augmented training samples. Boxes are checked pixel by pixel: each drawn box's outline has its
colour, the image is untouched away from the outlines and labels, panels are aligned with the
source image, and sizes are exact."""
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
import visualize_data  # tools/ is on the test path (pytest.ini)
import visualize_detections
from aadet.data.augmentation import build_augmentation
from aadet.engine import AADetCheckpointer, CheckpointMismatchError, load_config
from aadet.utils.visualizer import GAP, LEGEND_HEIGHT, TITLE_HEIGHT, enlarge_factor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "configs", "Demo", "trees_R_50_slim_FPN.yaml")

# Detectron2's Visualizer at these image sizes (default font 10 px): a box outline is a line
# about 2.5 px wide centred on the edge, so the pixels on either side of the edge are fully
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
    # boxes were drawn: the rgb render differs from its (converted) input
    drawn = np.asarray(Image.open(out / "rgb.png").convert("RGB")).astype(int)[:600]
    orig = np.asarray(Image.open(folder / "rgb.png").convert("RGB")).astype(int)
    orig = np.repeat(np.repeat(orig, 2, 0), 2, 1)
    assert np.abs(drawn - orig).sum() > 1000


# Two confident boxes (large: labels inside) and one below the 0.5 threshold.
DRAWN_BOXES = [[40.0, 30.0, 200.0, 150.0], [250.0, 160.0, 370.0, 270.0]]
LOW_SCORE_BOX = [10.0, 200.0, 120.0, 290.0]


def test_detections_are_drawn_on_the_boxes_and_nowhere_else(tmp_path, monkeypatch):
    """On a uniform image: each detection's outline has one colour all around, its inside is
    untouched except for its label, a detection under --threshold is not drawn, and nothing else
    changes."""
    monkeypatch.setattr(
        visualize_detections, "Predictor",
        fixed_predictor(DRAWN_BOXES + [LOW_SCORE_BOX], [0.9, 0.8, 0.2]),
    )  # fmt: skip
    source = np.full((300, 400, 3), 90, np.uint8)
    Image.fromarray(source).save(tmp_path / "gray.png")
    np.random.seed(0)  # the Visualizer picks box colours with np.random
    (path,) = visualize_detections.main(
        ["--config-file", DEMO, "--input", str(tmp_path / "gray.png"), "--output",
         str(tmp_path / "out"), "--threshold", "0.5", "MODEL.DEVICE", "cpu"]
    )  # fmt: skip
    drawn = np.asarray(Image.open(path).convert("RGB"))
    assert drawn.shape == (300, 400, 3)
    changed, _ = check_boxes_drawn(drawn, source, DRAWN_BOXES)
    shape = drawn.shape[:2]
    for box in DRAWN_BOXES:
        label = _label_zone(shape, box)
        core = drawn[_band(shape, box, 1) & ~label].astype(int)
        colour = np.median(core, axis=0)
        assert np.abs(core - colour).max() <= 2, f"box {box}: outline is not one colour"
        assert np.abs(colour - 90).max() >= 20, f"box {box}: outline colour {colour} ~ background"
        x0, y0, x1, y1 = box
        inside = _rect(shape, x0 + BAND, y0 + BAND, x1 - BAND, y1 - BAND) & ~label
        assert not changed[inside].any(), f"box {box}: drawn inside"
        # the label: dark background (black, alpha 0.8) with text, at the top-left corner
        dark = (drawn[label].astype(int) < 40).all(axis=-1)
        assert 300 <= dark.sum() <= LABEL_W * LABEL_H, dark.sum()
    assert not changed[_band(shape, LOW_SCORE_BOX, BAND)].any()  # below --threshold


def _xyxy(record):
    return [BoxMode.convert(a["bbox"], a["bbox_mode"], BoxMode.XYXY_ABS)
            for a in record["annotations"]]  # fmt: skip


def test_dataset_with_ground_truth_side_by_side(trees_root, tmp_path, monkeypatch):
    """Ground truth left, detections right, both exactly the source image's size and aligned
    with it: each panel is the source image with its own boxes drawn, and nothing else."""
    from aadet.data import register_trees

    register_trees(trees_root)
    monkeypatch.setattr(visualize_detections, "Predictor", fixed_predictor(DRAWN_BOXES, [0.9, 0.8]))
    np.random.seed(0)
    (path,) = visualize_detections.main(
        ["--config-file", DEMO, "--dataset", "trees_val", "--show-gt",
         "--max-images", "1", "--output", str(tmp_path), "MODEL.DEVICE", "cpu"]
    )
    (path,) = written
    img = np.asarray(Image.open(path))
    # ground truth | detections: two 400 px tiles enlarged 2x, legend strips, titles, gap
    assert img.shape[:2] == (800 + LEGEND_HEIGHT + TITLE_HEIGHT, 2 * 800 + GAP)
    assert img.std() > 10


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
    import visualize_attention

    aa_cfg = os.path.join(REPO, "configs", "Demo", "trees_AA_R_50_slim_FPN.yaml")
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
