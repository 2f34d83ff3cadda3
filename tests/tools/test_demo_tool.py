"""tools/demo.py: images (files, folders, globs) and video in, pictures / video and COCO results out.

A random conv RetinaNet (cls_score scaled so that scores spread, tests/helpers/detectors.py) saved
as a checkpoint: the tool's detections are compared with the Predictor's on the same inputs.
"""
import json
import os

import cv2
import numpy as np
import pytest
import torch
from detectron2.data import detection_utils as utils

from aadet.engine import Predictor, load_config
from aadet.utils.visualizer import LEGEND_HEIGHT, enlarge_factor

from tests.helpers import REPO, load_tool
from tests.helpers.detectors import random_detector

demo = load_tool("demo")
CONFIG = os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml")

THRESH = 0.5
OPTS = ["MODEL.DEVICE", "cpu", "INPUT.MIN_SIZE_TEST", "128", "INPUT.MAX_SIZE_TEST", "128"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    _, model = random_detector(CONFIG, OPTS)
    path = str(tmp_path_factory.mktemp("ckpt") / "random.pth")
    torch.save({"model": model.state_dict()}, path)
    return path


def predictor_for(checkpoint, opts=()):
    cfg = load_config(CONFIG, OPTS + list(opts) + ["MODEL.RETINANET.SCORE_THRESH_TEST", THRESH])
    return cfg, Predictor(cfg, checkpoint)


def run(checkpoint, *args, opts=()):
    return demo.main(["--config-file", CONFIG, "--weights", checkpoint,
                      "--confidence-threshold", str(THRESH), *args, "--opts", *OPTS, *opts])


def noise_image(path, h, w, seed):
    img = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    cv2.imwrite(str(path), img)
    return path


def expected(predictor, cfg, path):
    inst = predictor(utils.read_image(str(path), format=cfg.INPUT.FORMAT))["instances"].to("cpu")
    return inst[inst.scores >= THRESH]


def check_results(results, inst, image_id, category_id):
    assert len(results) == len(inst)
    xyxy = inst.pred_boxes.tensor.numpy()
    for r, box, score in zip(results, xyxy, inst.scores.tolist()):
        assert r["image_id"] == image_id and r["category_id"] == category_id
        x, y, w, h = r["bbox"]
        np.testing.assert_allclose([x, y, x + w, y + h], box, atol=1e-3)
        assert r["score"] == pytest.approx(score, abs=1e-6) and r["score"] >= THRESH


def test_images_folders_globs_json_and_pictures(tmp_path, checkpoint):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    files = [noise_image(a / "x.png", 120, 160, 0), noise_image(a / "y.png", 100, 100, 1),
             noise_image(b / "z.jpg", 96, 128, 2)]
    (b / "notes.txt").write_text("not an image")
    out, js = tmp_path / "out", tmp_path / "dets.json"
    ret = run(checkpoint, "--input", str(a), str(b / "*.jpg"), str(a / "x.png"),  # x.png twice
              "--output", str(out), "--json", str(js))
    assert ret["written"] == [str(out / "x.png"), str(out / "y.png"), str(out / "z.jpg")]
    results = json.load(open(js))
    cfg, predictor = predictor_for(checkpoint)
    total = 0
    for i, f in enumerate(files):  # not trees_val images: image_id is the input's index
        inst = expected(predictor, cfg, f)
        mine = [r for r in results if r["file_name"] == str(f)]
        check_results(mine, inst, image_id=i, category_id=1)  # "Tree" is category 1 in the json
        total += len(inst)
        src, drawn = cv2.imread(str(f)), cv2.imread(ret["written"][i])
        fac = enlarge_factor(*src.shape[:2])  # small inputs are drawn enlarged, legend below
        assert drawn.shape == (fac * src.shape[0] + LEGEND_HEIGHT, fac * src.shape[1], 3)
        if f.suffix == ".jpg":  # re-encoded: lossy, no pixel comparison
            continue
        src = np.repeat(np.repeat(src, fac, 0), fac, 1)
        changed = (np.abs(drawn[: src.shape[0]].astype(int) - src.astype(int)).max(axis=2) > 40).mean()
        assert (changed > 0.005) == (len(inst) > 0), (f, len(inst), changed)  # boxes drawn
    assert len(results) == total >= 3, "too few detections to test anything"


def test_dataset_image_and_category_ids(tmp_path, checkpoint, trees_root):
    """trees_val images get their json image ids; without DATASETS.TEST, class indices."""
    from detectron2.data import MetadataCatalog

    json_file = MetadataCatalog.get("trees_val").json_file
    coco = json.load(open(json_file))
    root = MetadataCatalog.get("trees_val").image_root
    images = coco["images"][:2]
    files = [os.path.join(root, im["file_name"]) for im in images]
    js = tmp_path / "dets.json"
    run(checkpoint, "--input", *files, "--json", str(js))
    results = json.load(open(js))
    cfg, predictor = predictor_for(checkpoint)
    for im, f in zip(images, files):
        check_results([r for r in results if r["file_name"] == f], expected(predictor, cfg, f),
                      image_id=im["id"], category_id=coco["categories"][0]["id"])
    assert results, "no detections on the val tiles"

    js2 = tmp_path / "dets_nods.json"
    run(checkpoint, "--input", files[0], "--json", str(js2), opts=["DATASETS.TEST", "()"])
    plain = json.load(open(js2))
    assert plain and {r["category_id"] for r in plain} == {0} and {r["image_id"] for r in plain} == {0}


@pytest.mark.parametrize("ext,codec", [(".avi", "MJPG"), (".mp4", "mp4v")])
def test_video_in_video_out(tmp_path, checkpoint, ext, codec):
    src = str(tmp_path / f"clip{ext}")
    writer = cv2.VideoWriter(src, cv2.VideoWriter_fourcc(*codec), 5.0, (128, 96))
    rng = np.random.default_rng(3)
    for _ in range(4):
        writer.write(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))
    writer.release()
    out, js = tmp_path / "vis", tmp_path / "video.json"
    ret = run(checkpoint, "--video-input", src, "--output", str(out), "--json", str(js))
    assert ret["written"] == [str(out / "clip.mp4")]  # a folder: <stem>.mp4

    cap_in, cap_out = cv2.VideoCapture(src), cv2.VideoCapture(ret["written"][0])
    assert cap_out.get(cv2.CAP_PROP_FRAME_COUNT) == 4
    # same scale as the input, the legend strip below
    assert (cap_out.get(cv2.CAP_PROP_FRAME_WIDTH), cap_out.get(cv2.CAP_PROP_FRAME_HEIGHT)) == (128, 96 + LEGEND_HEIGHT)
    cfg, predictor = predictor_for(checkpoint)
    results = json.load(open(js))
    total = 0
    for i in range(4):
        ok, frame = cap_in.read()
        ok_out, frame_out = cap_out.read()
        assert ok and ok_out and frame_out.shape == (96 + LEGEND_HEIGHT, 128, 3)
        inst = predictor(frame)["instances"].to("cpu")
        inst = inst[inst.scores >= THRESH]
        check_results([r for r in results if r["frame"] == i], inst, image_id=i, category_id=1)
        total += len(inst)
    assert not cap_out.read()[0]  # exactly 4 frames
    assert len(results) == total >= 2


def test_errors_name_the_argument(tmp_path, checkpoint):
    img = noise_image(tmp_path / "one.png", 64, 64, 0)
    with pytest.raises(SystemExit):  # argparse error: out of [0, 1]
        run(checkpoint, "--input", str(img), "--confidence-threshold", "1.5")
    with pytest.raises(FileNotFoundError, match="--input .*missing_dir/\\*.png"):
        run(checkpoint, "--input", str(tmp_path / "missing_dir" / "*.png"))
    noise_image(tmp_path / "two.png", 64, 64, 1)
    with pytest.raises(ValueError, match="is an image file but there are 2 inputs"):
        run(checkpoint, "--input", str(tmp_path), "--output", str(tmp_path / "o.png"))
    with pytest.raises(ValueError, match=r"\['.avi', '.mp4'\]"):
        demo.video_output(str(tmp_path / "v.mkv"), "clip.avi")
    with pytest.raises(FileNotFoundError, match="--video-input: no such file"):
        run(checkpoint, "--video-input", str(tmp_path / "none.mp4"))
