"""Box statistics and the recipe they suggest (aadet/data/statistics.py, tools/check_dataset.py),
and the synthetic tiles (aadet/data/synthetic.py) they are tested on."""
import json
import math
import os
import sys

import numpy as np
import pytest
import yaml

import aadet  # noqa: F401
from aadet.data.statistics import (
    BN_MIN_IMAGES_PER_WORKER,
    BoxStatistics,
    box_statistics,
    load_coco_boxes,
    strides_of,
    misfit_share,
    suggest_aspect_ratios,
    suggest_norm,
    suggest_recipe,
)
from aadet.data.synthetic import make_coco_tiles

from tests.helpers import REPO, load_tool

DEMO = os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml")


def _stats(wh, image_side=128, per_image=None):
    wh = np.asarray(wh, np.float64).reshape(-1, 2)
    per_image = np.asarray(per_image if per_image is not None else [len(wh)])
    return BoxStatistics("t", wh, per_image, np.full((len(per_image), 2), float(image_side)))


@pytest.fixture(scope="module")
def tiles(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cells"))
    return root, make_coco_tiles(root, num_train=12, num_val=4, seed=3)


# ---------------------------------------------------------------- statistics
def test_coco_statistics_numbers(tmp_path):
    coco = {
        "images": [{"id": 1, "file_name": "a.png", "width": 100, "height": 50},
                   {"id": 2, "file_name": "b.png", "width": 200, "height": 80},
                   {"id": 3, "file_name": "c.png", "width": 10, "height": 10}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 4, 9], "area": 36, "iscrowd": 0},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [5, 5, 10, 10], "area": 100, "iscrowd": 0},
            {"id": 3, "image_id": 2, "category_id": 2, "bbox": [1, 1, 20, 5], "area": 100, "iscrowd": 0},
            {"id": 4, "image_id": 2, "category_id": 2, "bbox": [1, 1, 50, 50], "area": 2500, "iscrowd": 1},
            {"id": 5, "image_id": 2, "category_id": 2, "bbox": [1, 1, 0, 5], "area": 0, "iscrowd": 0},
        ],
        "categories": [{"id": 1, "name": "x"}, {"id": 2, "name": "y"}],
    }
    path = tmp_path / "d.json"
    path.write_text(json.dumps(coco))
    s = load_coco_boxes(str(path))
    assert s.name == "d" and s.num_classes == 2
    np.testing.assert_array_equal(s.wh, [[4, 9], [10, 10], [20, 5]])  # crowd and w=0 left out
    np.testing.assert_array_equal(s.boxes_per_image, [2, 1, 0])
    np.testing.assert_allclose(s.sizes, [6.0, 10.0, 10.0])
    np.testing.assert_allclose(s.aspect_ratios, [2.25, 1.0, 0.25])
    q = s.quantiles()
    np.testing.assert_allclose(q["size"][[0, 3, 6]], [6, 10, 10])  # min, median, max
    np.testing.assert_allclose(q["area"][[0, 3, 6]], [36, 100, 100])
    np.testing.assert_allclose(q["boxes_per_image"][[0, 3, 6]], [0, 1, 2])
    np.testing.assert_allclose(q["width"][3], 10.0)


def test_dataset_dicts_and_json_agree(tiles):
    from detectron2.data.datasets import load_coco_json

    root, paths = tiles
    json_file, image_root = paths["cells_train"]
    a = load_coco_boxes(json_file)
    b = box_statistics(load_coco_json(json_file, image_root), "b")
    np.testing.assert_allclose(np.sort(a.sizes), np.sort(b.sizes), rtol=1e-5)  # BoxMode: float32
    np.testing.assert_array_equal(a.boxes_per_image, b.boxes_per_image)
    assert a.num_classes == b.num_classes == 1


def test_synthetic_tiles_are_deterministic_and_in_range(tiles, tmp_path):
    root, paths = tiles
    again = make_coco_tiles(str(tmp_path), num_train=12, num_val=4, seed=3)
    for name in paths:
        with open(paths[name][0]) as f1, open(again[name][0]) as f2:
            assert json.load(f1) == json.load(f2)
    first = os.path.join(paths["cells_train"][1], "train_0000.png")
    with open(first, "rb") as f1, open(os.path.join(again["cells_train"][1], "train_0000.png"), "rb") as f2:
        assert f1.read() == f2.read()
    s = load_coco_boxes(paths["cells_train"][0])
    assert (s.image_wh == 128).all()
    assert s.wh.min() >= 3.0 - 1e-9 and s.wh.max() <= 38.0 + 1e-9
    assert 0.3 < s.aspect_ratios.min() < 0.5 and 2.0 < s.aspect_ratios.max() <= 3.0 + 1e-9
    assert s.boxes_per_image.min() >= 4 and s.boxes_per_image.max() <= 12


def test_object_coverage_is_computed_only_where_it_is_not_zero():
    """Objects are drawn on their window of the tile (large fields stay cheap): the window holds
    every non-zero pixel of the coverage computed over the whole tile, with the same values."""
    from aadet.data.synthetic import _ellipse_mask

    size = 64
    full = (slice(0, size), slice(0, size))
    for cx, cy, rx, ry in [(10.3, 20.7, 1.5, 4.5), (0.4, 63.2, 6.0, 2.0), (32.0, 32.0, 0.6, 0.6),
                           (50.5, 5.5, 18.0, 6.0)]:
        whole, _ = _ellipse_mask(size, cx, cy, rx, ry, full)
        local, window = _ellipse_mask(size, cx, cy, rx, ry)
        placed = np.zeros_like(whole)
        placed[window] = local
        np.testing.assert_array_equal(placed, whole)
        assert local.size < whole.size and whole.max() > 0

# ---------------------------------------------------------------- suggestion math
def test_scale_brings_small_objects_to_two_strides():
    # 4 px objects in 128 px tiles: scale 16 / 4 = 4 -> 512 px; finest anchor 16 = 2 x stride 8
    r = suggest_recipe(_stats([[4, 4]] * 20 + [[20, 20]] * 20))
    assert r.scale == 4.0 and r.test_size == 512
    assert r.anchor_sizes == [[16.0, 20.0, 25.0], [32.0, 40.0, 51.0], [64.0, 81.0, 102.0]]
    assert r.long_side_range == (408, 616)  # 0.8 / 1.2 x 512, to multiples of 8
    assert r.crop_size == 512 and r.aspect_ratios == [1.0] and r.notes == []
    assert r.max_input_size == 640  # covers 616 px training images


def test_scale_is_capped_and_says_so():
    # 2 px objects would need 8x: capped at 4x (notes say so); they reach 8 px, yet the anchors
    # start at 2 strides (16 px): 1-stride anchors did not learn at all (AP50 0, module docstring)
    r = suggest_recipe(_stats([[2, 2]] * 50), max_scale=4)
    assert r.scale == 4.0 and r.test_size == 512
    assert r.anchor_sizes[0] == [16.0, 20.0, 25.0]
    assert any("largest allowed scale" in n for n in r.notes)
    # a large image: the long side cap (max_size) wins over the scale
    r = suggest_recipe(_stats([[4, 4]] * 50, image_side=1000), max_size=1024)
    assert r.test_size == 1024 and math.isclose(r.scale, 1.024)
    # large objects shrink the image (at most 1 / max_scale)
    r = suggest_recipe(_stats([[64, 64]] * 50, image_side=640))
    assert r.test_size == 160 and r.anchor_sizes[0][0] == 16.0


def test_crop_strides_and_octaves_follow_the_base():
    r = suggest_recipe(_stats([[8, 8]] * 50), strides=(8, 16, 32, 64, 128), octaves=2, max_crop_size=256)
    assert r.test_size == 256 and r.crop_size == 256
    assert r.anchor_sizes == [[16.0, 23.0], [32.0, 45.0], [64.0, 91.0], [128.0, 181.0], [256.0, 362.0]]
    assert strides_of(["p3", "p4", "p5", "p6", "p7"]) == [8, 16, 32, 64, 128]
    with pytest.raises(ValueError, match="pN"):
        strides_of(["res3"])
    with pytest.raises(ValueError, match="double"):
        suggest_recipe(_stats([[8, 8]]), strides=(8, 32))
    with pytest.raises(ValueError, match="no boxes"):
        suggest_recipe(_stats(np.zeros((0, 2))))


def test_aspect_ratios_from_the_boxes():
    rng = np.random.RandomState(0)
    # log-uniform h/w in [1/3, 3]: tertile medians are 3^(-2/3), 1, 3^(2/3)
    r = np.exp(rng.uniform(-math.log(3), math.log(3), 20000))
    np.testing.assert_allclose(suggest_aspect_ratios(r), [3 ** (-2 / 3), 1.0, 3 ** (2 / 3)], atol=0.02)
    assert suggest_aspect_ratios(np.exp(rng.uniform(-0.3, 0.3, 1000))) == [1.0]  # round: one
    assert suggest_aspect_ratios(np.full(100, 3.0)) == [3.0]  # all upright rods: one, tall
    # a share of rods that a square anchor cannot match (IoU < 0.5 beyond h/w 2.25): up to a quarter,
    # one ratio (18% on the synthetic tiles, where one measured better); above, three
    round_ = np.exp(rng.uniform(-0.3, 0.3, 1000))
    assert math.isclose(misfit_share(np.r_[round_, np.full(250, 3.0)]), 0.2)
    assert suggest_aspect_ratios(np.r_[round_, np.full(250, 3.0)]) == [1.1]  # the median shape
    assert len(suggest_aspect_ratios(np.r_[round_, np.full(400, 3.0), np.full(400, 1 / 3)])) == 3
    # a wide detection count: twice the most crowded image
    s = _stats([[8, 8]] * 130, per_image=[1, 130])
    assert suggest_recipe(s).detections_per_image == 260


def test_demo_trees_get_the_demo_recipe_back(trees_root):
    """On the tree crowns the rule gives what the demo config was tuned to by hand (anchors
    16-101 on P3-P5, square, test side 400): 16-102, ratio 1.0, test side 416."""
    s = load_coco_boxes(os.path.join(trees_root, "trees", "annotations", "trees_train.json"))
    r = suggest_recipe(s, max_crop_size=256)
    assert r.anchor_sizes == [[16.0, 20.0, 26.0], [32.0, 40.0, 51.0], [64.0, 81.0, 102.0]]
    assert r.aspect_ratios == [1.0] and r.test_size == 416 and r.crop_size == 256


def test_yaml_lines_load_back_to_the_suggestion():
    r = suggest_recipe(_stats([[3, 9], [9, 3], [5, 5], [20, 40]] * 10))
    assert yaml.safe_load("\n".join(r.yaml_lines())) == r.config_dict()


# ---------------------------------------------------------------- the tool
def test_check_dataset_prints_and_writes_a_config_that_loads(tiles, tmp_path, capsys):
    check_dataset = load_tool("check_dataset")
    from detectron2.data import DatasetCatalog

    from aadet.engine import load_config

    root, paths = tiles
    out = tmp_path / "cfg" / "cells.yaml"
    rc = check_dataset.main([*paths["cells_train"], *paths["cells_val"], "--base", DEMO,
                             "--write", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "cells_train: 12 images" in text and "cells_val: 4 images" in text
    assert "sqrt(w*h)" in text and "ANCHOR_GENERATOR:" in text and "MIN_SIZE_TEST: 512" in text
    cfg = load_config(str(out))
    recipe = suggest_recipe(load_coco_boxes(paths["cells_train"][0]), max_crop_size=256)
    assert [list(s) for s in cfg.MODEL.ANCHOR_GENERATOR.SIZES] == recipe.anchor_sizes
    assert list(cfg.MODEL.ANCHOR_GENERATOR.ASPECT_RATIOS[0]) == recipe.aspect_ratios
    assert cfg.INPUT.MIN_SIZE_TEST == cfg.INPUT.MAX_SIZE_TEST == 512
    assert cfg.INPUT.SCALE_JITTER.CROP_SIZE == 256  # the base's crop bounds the cost
    assert cfg.DATASETS.TRAIN == ("cells_train",) and cfg.DATASETS.TEST == ("cells_val",)
    assert cfg.MODEL.RETINANET.NUM_CLASSES == 1
    assert len(DatasetCatalog.get("cells_val")) == 4
    # the demo's batch of 4 per worker: GN in the backbone and FPN, and the written config says why
    assert cfg.MODEL.RESNETS.NORM == cfg.MODEL.FPN.NORM == "GN"
    assert "norm GN: 4 images per worker" in out.read_text()
    assert cfg.MODEL.RETINANET.NORM == load_config(DEMO).MODEL.RETINANET.NORM  # the rest from the base
    # the demos mirror every tile for their own val image; the written config flips like the papers
    assert load_config(DEMO).INPUT.SCALE_JITTER.FLIP_PROB == 1.0
    assert cfg.INPUT.SCALE_JITTER.FLIP_PROB == 0.5
    assert "FLIP_PROB back to the papers' 0.5" in out.read_text()
    # a base that already flips like the papers: no FLIP_PROB written
    papers_flip = tmp_path / "papers_flip.yaml"
    papers_flip.write_text(f'_BASE_: "{DEMO}"\nINPUT:\n  SCALE_JITTER:\n    FLIP_PROB: 0.5\n')
    out2 = tmp_path / "cfg" / "cells_papers_flip.yaml"
    assert check_dataset.main([*paths["cells_train"], *paths["cells_val"], "--base",
                               str(papers_flip), "--write", str(out2)]) == 0
    assert "FLIP_PROB" not in out2.read_text()
    assert load_config(str(out2)).INPUT.SCALE_JITTER.FLIP_PROB == 0.5
    # a base with 16 images per worker: BN
    big_batch = tmp_path / "big_batch.yaml"
    big_batch.write_text(f'_BASE_: "{DEMO}"\nSOLVER:\n  IMS_PER_BATCH: 16\n')
    out3 = tmp_path / "cfg" / "cells_big_batch.yaml"
    assert check_dataset.main([*paths["cells_train"], *paths["cells_val"], "--base",
                               str(big_batch), "--write", str(out3)]) == 0
    assert load_config(str(out3)).MODEL.RESNETS.NORM == load_config(str(out3)).MODEL.FPN.NORM == "BN"


def test_norm_follows_the_images_per_worker():
    assert suggest_norm(BN_MIN_IMAGES_PER_WORKER)[0] == "BN"
    assert suggest_norm(BN_MIN_IMAGES_PER_WORKER - 1)[0] == "GN"
    assert suggest_norm(1)[0] == "GN" and suggest_norm(64)[0] == "BN"
    assert "fewer than" in suggest_norm(4)[1]
    with pytest.raises(ValueError, match="images_per_worker must be an integer >= 1; got 0"):
        suggest_norm(0)
    stats = _stats([[5, 5]] * 10)
    assert suggest_recipe(stats).norm is None  # no batch given, no norm suggested
    assert "NORM" not in "\n".join(suggest_recipe(stats).yaml_lines())
    assert suggest_recipe(stats, images_per_worker=2).config_dict()["MODEL"]["FPN"] == {"NORM": "GN"}


def test_check_dataset_errors_stop_before_writing(tmp_path, capsys):
    check_dataset = load_tool("check_dataset")

    coco = {"images": [{"id": 1, "file_name": "missing.png", "width": 10, "height": 10}],
            "annotations": [], "categories": [{"id": 1, "name": "x"}]}
    (tmp_path / "bad.json").write_text(json.dumps(coco))
    out = tmp_path / "never.yaml"
    rc = check_dataset.main([str(tmp_path / "bad.json"), str(tmp_path), "--base", DEMO,
                             "--write", str(out)])
    assert rc == 1 and not out.exists()
    assert "missing.png" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        check_dataset.main([str(tmp_path / "bad.json")])  # not a pair
    with pytest.raises(SystemExit):
        check_dataset.main([str(tmp_path / "bad.json"), str(tmp_path), "--write", str(out)])


# ---------------------------------------------------------------- the suggestion must pay off
# The shared demo recipe (Base-Trees.yaml: AdamW 2e-3, batch 8) shortened to 48 iterations: 48 epochs
# of 8 fields.
SHORT = ["SOLVER.EPOCHS", "48", "SOLVER.STEPS_EPOCHS", "(36, 45)", "SOLVER.WARMUP_ITERS", "30",
         "SOLVER.IMS_PER_BATCH", "8", "MODEL.DEVICE", "cpu"]


MIN_SUGGESTED_AP50 = 25.0
MIN_GAIN = 15.0


def _train(config, out, opts, env):
    import subprocess

    cmd = [sys.executable, os.path.join(REPO, "tools", "train_net.py"), "--config-file", config,
           "--num-gpus", "0", "OUTPUT_DIR", str(out), *SHORT, *opts]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-4000:]
    with open(os.path.join(out, "metrics.json")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "bbox/AP50" in r][-1]["bbox/AP50"]


@pytest.mark.learning
def test_suggested_recipe_learns_better(tmp_path):
    """A user's microscopy fields, not cut into tiles: 640 px images with 150-200 cells and rods
    of 3-38 px each (:mod:`aadet.data.synthetic`, data seed 0), 8 for training and 4 for val.
    The demo conv config with its guessed recipe (long side 320-480, so the fields shrink to
    0.5-0.75x and 3 px cells to 2 px; anchors 16-101; 100 detections per image for 150-200
    objects) against the config ``check_dataset.py --write`` suggests (scale 1.6x, test side 1024,
    anchors 16-102 from 2 strides of P3, one square ratio, 382 detections), same 48 iterations.

    Thresholds: the suggestion reaches AP50 25 and beats the guess by 15 points: the demo's own
    recipe fails them, as would one-stride anchors on 320 px tiles (the test prints both APs). (On
    128 px tiles of the same objects the demo's own resize already enlarges them 2.5-3.75x: demo
    recipe 94.7, suggestion 91.4, one seed each; there the guess happens to fit.)"""
    check_dataset = load_tool("check_dataset")

    data = tmp_path / "fields"
    # (its own names: the other tests of this module registered cells_* in this process)
    paths = make_coco_tiles(str(data), prefix="field", num_train=8, num_val=4, seed=0, size=640,
                            objects_per_tile=(150, 200))
    env = dict(os.environ, PYTHONPATH=REPO)
    (jt, it), (jv, iv) = paths["field_train"], paths["field_val"]
    # what a user writes without the statistics: the demo config, their data and class count
    guessed = _train(DEMO, tmp_path / "demo", [
        "DATASETS.REGISTER_COCO", f"[['field_train', '{jt}', '{it}'], ['field_val', '{jv}', '{iv}']]",
        "DATASETS.TRAIN", "('field_train',)", "DATASETS.TEST", "('field_val',)",
        "MODEL.RETINANET.NUM_CLASSES", "1"], env)
    config = str(tmp_path / "fields.yaml")
    assert check_dataset.main([jt, it, jv, iv, "--base", DEMO, "--write", config]) == 0
    suggested = _train(config, tmp_path / "suggested", [], env)
    print(f"AP50 demo recipe {guessed:.2f}, suggested {suggested:.2f}")
    assert suggested >= MIN_SUGGESTED_AP50, (guessed, suggested)
    assert suggested >= guessed + MIN_GAIN, (guessed, suggested)
