"""Every YAML in configs/ loads, validates, builds its model and runs a forward pass: a broken
config never ships (after Detectron2's projects/DensePose/tests/common.py)."""
import glob
import os

import pytest
import torch
from detectron2.modeling import build_model

import aadet  # noqa: F401
from aadet.engine import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(
    os.path.relpath(p, REPO)
    for p in glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)
    if not os.path.basename(p).startswith("Base-")
)


def test_there_are_configs():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("config", CONFIGS)
def test_config_builds_and_runs(config):
    cfg = load_config(os.path.join(REPO, config), ["MODEL.DEVICE", "cpu"])
    assert cfg.MODEL.WEIGHTS == "", "configs train from scratch"
    assert cfg.MODEL.BACKBONE.FREEZE_AT == 0
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 100_000
    image = torch.randint(0, 255, (3, 96, 128), dtype=torch.uint8).float()
    with torch.no_grad():
        (out,) = model([{"image": image, "height": 96, "width": 128}])
    inst = out["instances"]
    assert inst.image_size == (96, 128)
    assert inst.pred_boxes.tensor.shape[1] == 4
    assert torch.isfinite(inst.scores).all()
