"""Every YAML in configs/ (the ``_BASE_`` files included) loads, validates, builds its model and
runs a forward pass: a broken config never ships (after Detectron2's
projects/DensePose/tests/common.py)."""
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
)
# Written out so that a config lost from the tree (or a glob that stops finding some) fails here;
# a new config must be added to this list.
EXPECTED = [
    "configs/Base-RetinaNet-Scratch.yaml",
    "configs/COCO-Detection/aa_retinanet_R_101_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep_pos_coordconv.yaml",
    "configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep_pos_none.yaml",
    "configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep_pos_sine2d.yaml",
    "configs/COCO-Detection/retinanet_R_101_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/sasa_attnstem_retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep.yaml",
    "configs/COCO-Detection/sasa_convstem_retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/sasa_convstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep.yaml",
    "configs/Demo/Base-Trees.yaml",
    "configs/Demo/trees_AA_R_26_slim_FPN.yaml",
    "configs/Demo/trees_R_26_slim_FPN.yaml",
    "configs/Demo/trees_SASA_R_26_slim_FPN.yaml",
    "configs/Demo/trees_SASA_full_attention_R_26_slim.yaml",
]


def test_every_config_is_found():
    """The glob finds exactly the configs in the tree (no .yml, no misplaced file)."""
    assert CONFIGS == EXPECTED
    every_file = {
        os.path.relpath(os.path.join(d, f), REPO)
        for d, _, files in os.walk(os.path.join(REPO, "configs"))
        for f in files
    }
    assert every_file == set(EXPECTED), "configs/ holds files that are not .yaml configs"


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
