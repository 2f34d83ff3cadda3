"""Every YAML in configs/ (the ``_BASE_`` files included) loads, validates, builds its model and
runs a forward pass: a broken config never ships (after Detectron2's
projects/DensePose/tests/common.py)."""
import glob
import logging
import os
import warnings

import pytest
import torch
import yaml
from detectron2.modeling import build_model

import aadet  # noqa: F401
from aadet.engine import load_config

from tests.helpers import REPO

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
    "configs/COCO-Detection/ccnet_retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/halo_retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/retinanet_R_101_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/sasa_attnstem_retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep.yaml",
    "configs/COCO-Detection/sasa_convstem_retinanet_R_50_FPN_scratch_150ep.yaml",
    "configs/COCO-Detection/sasa_convstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep.yaml",
    "configs/Demo/Base-Trees.yaml",
    "configs/Demo/trees_AA_R_26_slim_FPN.yaml",
    "configs/Demo/trees_CCNet_R_26_slim_FPN.yaml",
    "configs/Demo/trees_Halo_R_26_slim_FPN.yaml",
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
    # the LazyConfig twins (tests/config/test_lazyconfig.py) and their pieces
    lazy = {
        f for f in every_file
        if f.startswith(os.path.join("configs", "common") + os.sep)
        or (f.endswith(".py") and f[: -len(".py")] + ".yaml" in EXPECTED)
    }
    assert every_file - lazy == set(EXPECTED), "configs/ holds files that are not .yaml configs"


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


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _load_recording_fvcore(path):
    """``load_config(path)`` with Python warnings as errors; returns fvcore's config log messages
    (where its "yaml.unsafe_load" warning goes, at WARNING level even if a tool raised it)."""
    records, fvcore_logger = _Records(), logging.getLogger("fvcore.common.config")
    level = fvcore_logger.level
    fvcore_logger.addHandler(records)
    fvcore_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_config(path, ["MODEL.DEVICE", "cpu"])
    finally:
        fvcore_logger.removeHandler(records)
        fvcore_logger.setLevel(level)
    return records.messages


@pytest.mark.parametrize("config", CONFIGS)
def test_config_loads_without_unsafe_yaml(config):
    """Plain YAML only: fvcore's ``CfgNode.load_yaml_with_base`` (Detectron2's ``merge_from_file``
    allows unsafe loading) tries ``yaml.safe_load``, and when a ``!!python`` tag makes that fail it
    logs "Loading config ... with yaml.unsafe_load. Your machine may be at risk" and evaluates the
    file. Neither may happen for our configs."""
    path = os.path.join(REPO, config)
    with open(path) as f:
        text = f.read()
    assert "!!python" not in text
    assert isinstance(yaml.safe_load(text), dict)
    messages = _load_recording_fvcore(path)
    assert not [m for m in messages if "unsafe" in m], messages


def test_unsafe_yaml_would_be_caught(tmp_path):
    """The check above sees fvcore's warning when there is one (Detectron2's own anchor line)."""
    path = tmp_path / "unsafe.yaml"
    path.write_text(
        f"_BASE_: {os.path.join(REPO, 'configs', 'Base-RetinaNet-Scratch.yaml')}\n"
        "MODEL:\n  ANCHOR_GENERATOR:\n    SIZES: !!python/object/apply:eval "
        '["[[x, x * 2**(1.0/3), x * 2**(2.0/3) ] for x in [32, 64, 128, 256, 512 ]]"]\n'
    )
    messages = _load_recording_fvcore(str(path))
    assert [m for m in messages if "yaml.unsafe_load" in m and "unsafe.yaml" in m], messages


@pytest.mark.parametrize("config", [c for c in CONFIGS if "/Demo/" not in c])
def test_coco_anchor_sizes_are_three_scales_per_octave(config):
    """The written-out anchor sizes are exactly Detectron2's RetinaNet expression
    ``[[x, x * 2**(1.0/3), x * 2**(2.0/3)] for x in [32, 64, 128, 256, 512]]``."""
    sizes = load_config(os.path.join(REPO, config), ["MODEL.DEVICE", "cpu"]).MODEL.ANCHOR_GENERATOR.SIZES
    assert sizes == [[x, x * 2 ** (1.0 / 3), x * 2 ** (2.0 / 3)] for x in [32, 64, 128, 256, 512]]
    assert [type(row[0]) for row in sizes] == [int] * 5
