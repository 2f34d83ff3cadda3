"""Test-time augmentation for RetinaNet (``TEST.AUG.*``, :class:`aadet.modeling.RetinaNetWithTTA`)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from detectron2.modeling import build_model
from detectron2.structures import Boxes, Instances
from torch import nn

from aadet.config import ConfigValueError, validate_aadet_config
from aadet.engine import get_aadet_cfg, load_config
from aadet.modeling import RetinaNetWithTTA

from tests.helpers import REPO
from tests.helpers.tiny_training import DEMO, WELL_CONDITIONED, run_worker

BLOB = (20.0, 30.0, 60.0, 70.0)  # x0, y0, x1, y1 of the bright square in the original image


class BlobDetector(nn.Module):
    """Finds the bright square of its input and returns its box in the frame of
    ``height``/``width`` (as a detector's postprocess does), scored by how often it was called."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, inputs):
        outs = []
        for x in inputs:
            img = x["image"].float()
            self.seen.append(tuple(img.shape[1:]))
            ys, xs = torch.nonzero(img[0] > 127, as_tuple=True)
            sy, sx = x["height"] / img.shape[1], x["width"] / img.shape[2]
            box = torch.tensor([[xs.min() * sx, ys.min() * sy, (xs.max() + 1) * sx, (ys.max() + 1) * sy]])
            inst = Instances((x["height"], x["width"]))
            inst.pred_boxes = Boxes(box)
            inst.scores = torch.tensor([0.9 - 0.1 * len(self.seen)])
            inst.pred_classes = torch.tensor([0])
            outs.append({"instances": inst})
        return outs


def _blob_image(h=100, w=160):
    img = torch.zeros(3, h, w, dtype=torch.uint8)
    x0, y0, x1, y1 = map(int, BLOB)
    img[:, y0:y1, x0:x1] = 255
    return img


def _tta_cfg(min_sizes, max_size, flip):
    cfg = get_aadet_cfg()
    cfg.TEST.AUG.ENABLED = True
    cfg.TEST.AUG.MIN_SIZES, cfg.TEST.AUG.MAX_SIZE, cfg.TEST.AUG.FLIP = min_sizes, max_size, flip
    return cfg


def test_flips_and_resizes_map_back_to_the_original_box():
    det = BlobDetector()
    tta = RetinaNetWithTTA(_tta_cfg((100, 200), 1000, True), det, batch_size=3)
    out = tta([{"image": _blob_image(), "height": 100, "width": 160}])[0]["instances"]
    # 2 sizes x (plain, flipped); the flipped passes see the blob on the right
    assert det.seen == [(100, 160), (100, 160), (200, 320), (200, 320)]
    # all four map back onto the same box: NMS keeps one, the first (highest-scored) pass's
    assert len(out) == 1 and out.image_size == (100, 160)
    torch.testing.assert_close(out.pred_boxes.tensor, torch.tensor([BLOB]), atol=0.5, rtol=0)
    assert out.scores.tolist() == pytest.approx([0.8])


def test_boxes_of_an_already_resized_input_go_back_to_the_original_size():
    # The test loader hands the model a resized image (here 2x); height/width are the original's.
    det = BlobDetector()
    big = torch.nn.functional.interpolate(_blob_image()[None].float(), scale_factor=2.0)[0]
    tta = RetinaNetWithTTA(_tta_cfg((200,), 1000, True), det)
    out = tta([{"image": big.to(torch.uint8), "height": 100, "width": 160}])[0]["instances"]
    torch.testing.assert_close(out.pred_boxes.tensor, torch.tensor([BLOB]), atol=0.5, rtol=0)


def test_one_augmentation_at_the_test_size_equals_plain_inference():
    """No flip, the test size only: TTA must return the detector's own detections (its NMS and
    top-k are idempotent on them), on a real RetinaNet."""
    cfg = load_config(
        os.path.join(REPO, "configs/Demo/trees_R_26_slim_FPN.yaml"),
        ["MODEL.DEVICE", "cpu", "MODEL.RETINANET.SCORE_THRESH_TEST", "0.0",
         "TEST.AUG.ENABLED", "True", "TEST.AUG.MIN_SIZES", "(448,)", "TEST.AUG.MAX_SIZE", "448",
         "TEST.AUG.FLIP", "False",
         # the merge of a voted pass would vote again (tests/modeling/test_box_voting.py covers that)
         "TEST.BBOX_VOTE.ENABLED", "False", *WELL_CONDITIONED],
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(0)
    inp = {"image": torch.randint(0, 256, (3, 448, 448), generator=g, dtype=torch.uint8),
           "height": 400, "width": 400}
    with torch.no_grad():
        plain = model([inp])[0]["instances"]
        tta = RetinaNetWithTTA(cfg, model)([inp])[0]["instances"]
    assert len(plain) == cfg.TEST.DETECTIONS_PER_IMAGE == len(tta)
    torch.testing.assert_close(tta.scores, plain.scores)
    torch.testing.assert_close(tta.pred_boxes.tensor, plain.pred_boxes.tensor, atol=1e-3, rtol=0)
    assert torch.equal(tta.pred_classes, plain.pred_classes)


@pytest.mark.parametrize(
    "key,value", [("MIN_SIZES", ()), ("MIN_SIZES", (448, 0)), ("MAX_SIZE", 0)]
)
def test_bad_tta_sizes_name_the_key(key, value):
    cfg = _tta_cfg((448,), 448, True)
    cfg.TEST.AUG[key] = value
    with pytest.raises(ConfigValueError, match=rf"TEST\.AUG\.{key}"):
        validate_aadet_config(cfg)
    cfg.TEST.AUG.ENABLED = False  # Detectron2's keys are only ours to check when TTA is on
    validate_aadet_config(cfg)


def test_training_and_eval_only_report_bbox_tta(data_env, tmp_path):
    """TEST.AUG.ENABLED: training ends with a TTA evaluation in metrics.json (``bbox_TTA/*``) next
    to the plain one, and ``--eval-only`` returns both, as Detectron2's train_net.py does."""
    tta = ["DATASETS.TEST", "('trees_val',)", "TEST.AUG.ENABLED", "True",
           "TEST.AUG.MIN_SIZES", "(400, 448)", "TEST.AUG.MAX_SIZE", "448", "TEST.AUG.FLIP", "True"]
    run_worker(tmp_path, opts=["SOLVER.MAX_ITER", "4", "SOLVER.STEPS", "()", *tta])
    final = losses_and_results(tmp_path)
    assert {"bbox/AP50", "bbox_TTA/AP50", "bbox_TTA/AP"} <= set(final)
    assert os.path.isfile(tmp_path / "inference_TTA" / "trees_val" / "coco_instances_results.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "train_net.py"), "--config-file", DEMO,
         "--eval-only", "MODEL.WEIGHTS", str(tmp_path / "model_final.pth"),
         "OUTPUT_DIR", str(tmp_path / "eval"), "MODEL.DEVICE", "cpu", *WELL_CONDITIONED, *tta],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / "eval" / "log.txt") as f:
        log = f.read()
    assert "Running inference with test-time augmentation: sizes (400, 448)" in log
    assert log.count("copypaste: Task: bbox") == 2  # plain, then TTA
    assert os.path.isfile(tmp_path / "eval" / "inference_TTA" / "trees_val" / "coco_instances_results.json")


def losses_and_results(out):
    """The last metrics.json row that has evaluation results."""
    with open(os.path.join(out, "metrics.json")) as f:
        rows = [json.loads(line) for line in f]
    return next(r for r in reversed(rows) if "bbox/AP50" in r)
