"""Every trainable YAML config has a LazyConfig twin (``configs/**/<name>.py``) that builds the same
detector: same parameter names and shapes, and from the same weights the same outputs (float64);
the same augmented samples for the same seed; the same optimizer and LR at chosen iterations; a
checkpoint of one loads strictly into the other. And the YACS ergonomics carry over: a misspelt
override gets the nearest keys, an out-of-range value fails at build time naming its key, the
files load with Detectron2's ``LazyConfig.load`` alone (``aadet/engine/lazy.py``).

The COCO-size models are built in the slow tier (once each); the demo models, data, schedule and
checks run in the fast tier.
"""
import glob
import os

import pytest
import torch
from detectron2.config import LazyConfig
from detectron2.modeling import build_model
from detectron2.solver import build_lr_scheduler
from detectron2.solver.lr_scheduler import LRMultiplier

import aadet  # noqa: F401
from aadet.config import ConfigValueError, UnknownConfigKeyError
from aadet.engine import AADetCheckpointer, Trainer, apply_epoch_schedule, load_config
from aadet.engine.lazy import (
    LazyBuildError,
    apply_lazy_epoch_schedule,
    build,
    load_lazy_config,
    eval_dataset_names,
)

from tests.helpers import REPO

YAMLS = sorted(
    os.path.relpath(p, REPO)
    for p in glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)
    if not os.path.basename(p).startswith("Base-")  # bases are not trained
)
DEMO = [c for c in YAMLS if "/Demo/" in c]
COCO = [c for c in YAMLS if c not in DEMO]
CONV_DEMO = "configs/Demo/trees_R_26_slim_FPN.yaml"
COCO_IMAGES = 117266  # coco_2017_train after the empty-image filter (for the epoch schedule)


def _twin(yaml_config: str) -> str:
    return os.path.join(REPO, yaml_config[: -len(".yaml")] + ".py")


def _pair(config, yaml_opts=(), lazy_opts=()):
    cfg = load_config(os.path.join(REPO, config), ["MODEL.DEVICE", "cpu", *yaml_opts], freeze=False)
    lazy = load_lazy_config(_twin(config), ["train.device=cpu", *lazy_opts])
    return cfg, lazy


def test_every_trainable_yaml_has_its_twin():
    twins = {
        os.path.relpath(p, REPO)
        for p in glob.glob(os.path.join(REPO, "configs", "*", "*.py"))
        if os.sep + "common" + os.sep not in p
    }
    assert twins == {os.path.relpath(_twin(c), REPO) for c in YAMLS}
    assert len(YAMLS) == 19  # 13 COCO (11 paper rows, HaloNet, CCNet) and 6 demos


@pytest.mark.parametrize("config", YAMLS)
def test_loads_with_detectron2_lazyconfig_alone(config):
    """Nothing but ``LazyConfig.load``: no aadet loader has to run first."""
    cfg = LazyConfig.load(_twin(config))
    assert {"model", "dataloader", "optimizer", "lr_multiplier", "train"} <= set(cfg)
    assert cfg.train.init_checkpoint == "", "configs train from scratch"


def _model_attributes(model):
    """What a RetinaNet is beyond its parameters: losses, inference and anchors' settings."""
    names = (
        "num_classes", "head_in_features", "focal_loss_alpha", "focal_loss_gamma", "smooth_l1_beta",
        "box_reg_loss_type", "test_score_thresh", "test_topk_candidates", "test_nms_thresh",
        "max_detections_per_image", "input_format", "vis_period", "bbox_vote_thresh",
    )
    out = {n: getattr(model, n) for n in names}
    out["pixel"] = (model.pixel_mean.flatten().tolist(), model.pixel_std.flatten().tolist())
    out["anchors"] = [a.tolist() for a in model.anchor_generator.cell_anchors]
    out["strides"] = list(model.anchor_generator.strides)
    out["box2box"] = tuple(model.box2box_transform.weights)
    out["matcher"] = (model.anchor_matcher.thresholds, model.anchor_matcher.labels)
    out["modules"] = [type(m).__name__ for m in model.modules()]
    return out


def _check_same_model(config):
    # Every attention route computes the same function (tests/layers); the plain-tensor one needs
    # no C++ build (a minute, once per process) and makes the same modules.
    cfg, lazy = _pair(config, ["MODEL.AA.IMPL", "materialized", "MODEL.SASA.IMPL", "materialized"])
    if "attention" in lazy.model.backbone.bottom_up:  # the FPN's and head's routes follow it
        lazy.model.backbone.bottom_up.attention.impl = "materialized"
    torch.manual_seed(0)
    ours = build_model(cfg)
    torch.manual_seed(0)
    twin = build(lazy.model, "model")
    a, b = ours.state_dict(), twin.state_dict()
    assert list(a) == list(b), "parameter and buffer names"
    assert {k: tuple(v.shape) for k, v in a.items()} == {k: tuple(v.shape) for k, v in b.items()}
    assert _model_attributes(ours) == _model_attributes(twin)
    # The same weights give the same outputs, to rounding in float64.
    twin.load_state_dict(a, strict=True)
    ours, twin = ours.double().eval(), twin.double().eval()
    torch.manual_seed(1)
    images = torch.randn(1, 3, 64, 96, dtype=torch.float64)
    with torch.no_grad():
        fa, fb = ours.backbone(images), twin.backbone(images)
        assert list(fa) == list(fb)
        for k in fa:
            torch.testing.assert_close(fa[k], fb[k], rtol=1e-12, atol=1e-12)
        feats = [fa[f] for f in ours.head_in_features]
        for x, y in zip(ours.head(feats), twin.head(feats)):
            for u, v in zip(x, y):
                torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)
    return cfg, lazy


@pytest.mark.parametrize("config", DEMO)
def test_demo_twin_builds_the_same_model(config):
    _check_same_model(config)


@pytest.mark.slow
@pytest.mark.parametrize("config", COCO)
def test_coco_twin_builds_the_same_model(config):
    _check_same_model(config)


def test_conv_demo_twin_initialises_the_same_weights():
    """Built in the YACS trainer's order, the same seed gives the same initial weights (what the
    same val AP from tools/lazyconfig_train_net.py and tools/train_net.py relies on)."""
    cfg, lazy = _pair(CONV_DEMO)
    torch.manual_seed(0)
    a = build_model(cfg).state_dict()
    torch.manual_seed(0)
    b = build(lazy.model, "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoints_load_strictly_either_way(tmp_path):
    cfg, lazy = _pair(CONV_DEMO)
    ours, twin = build_model(cfg), build(lazy.model, "model")
    for src, dst, name in ((ours, twin, "yaml"), (twin, ours, "lazy")):
        AADetCheckpointer(src, str(tmp_path)).save(name)
        with torch.no_grad():
            for p in dst.parameters():
                p.zero_()
        AADetCheckpointer(dst, strict=True).load(str(tmp_path / f"{name}.pth"))
        a, b = src.state_dict(), dst.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def _lazy_schedule_and_yaml(config):
    cfg, lazy = _pair(config)
    num_images = COCO_IMAGES if config in COCO else None
    apply_epoch_schedule(cfg, num_images)
    apply_lazy_epoch_schedule(lazy, num_images)
    return cfg, lazy


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
@pytest.mark.parametrize("config", YAMLS)
def test_same_schedule_and_lr(config, trees_root):
    cfg, lazy = _lazy_schedule_and_yaml(config)
    assert lazy.train.max_iter == cfg.SOLVER.MAX_ITER
    assert list(lazy.train.steps) == list(cfg.SOLVER.STEPS)
    assert lazy.dataloader.train.total_batch_size == cfg.SOLVER.IMS_PER_BATCH
    assert lazy.train.seed == cfg.SEED
    param = [torch.nn.Parameter(torch.zeros(1))]
    yaml_opt = torch.optim.SGD(param, lr=cfg.SOLVER.BASE_LR)
    lazy_opt = torch.optim.SGD(param, lr=lazy.optimizer.lr)
    yaml_sched = build_lr_scheduler(cfg, yaml_opt)
    lazy_sched = LRMultiplier(lazy_opt, build(lazy.lr_multiplier, "lr_multiplier"), lazy.train.max_iter)
    steps, warmup = list(cfg.SOLVER.STEPS), cfg.SOLVER.WARMUP_ITERS
    chosen = {0, 1, warmup // 2, warmup, *steps, *(s - 1 for s in steps), cfg.SOLVER.MAX_ITER - 1}
    for it in sorted(chosen):
        lrs = []
        for opt, sched in ((yaml_opt, yaml_sched), (lazy_opt, lazy_sched)):
            sched.last_epoch = it - 1  # jump there: step() sets the LR of iteration `it`
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        assert lrs[0] == lrs[1], f"LR at iteration {it}"


def test_same_optimizer(trees_root):
    cfg, lazy = _pair(CONV_DEMO)
    model = build_model(cfg)
    ours = Trainer.build_optimizer(cfg, model)
    lazy.optimizer.params.model = model
    twin = build(lazy.optimizer, "optimizer")
    assert type(ours) is type(twin)
    strip = [{k: v for k, v in g.items() if k != "params"} for g in ours.param_groups]
    assert strip == [{k: v for k, v in g.items() if k != "params"} for g in twin.param_groups]
    assert [[id(p) for p in g["params"]] for g in ours.param_groups] == [
        [id(p) for p in g["params"]] for g in twin.param_groups
    ]


@pytest.mark.parametrize("config", [CONV_DEMO, "configs/COCO-Detection/retinanet_R_50_FPN_scratch_150ep.yaml"])
def test_same_augmented_batches_for_the_same_seed(config, trees_root):
    """The train loaders give the same first batch (images after jitter/crop/flip/photometric,
    boxes); the COCO recipe is run on the demo tiles (COCO is not here)."""
    cfg, lazy = _pair(
        config,
        ["DATASETS.TRAIN", "('trees_train',)", "DATALOADER.NUM_WORKERS", "0", "SOLVER.IMS_PER_BATCH", "2"],
        ["dataloader.train.dataset.names=[trees_train]", "dataloader.train.num_workers=0",
         "dataloader.train.total_batch_size=2"],
    )
    ours = next(iter(Trainer.build_train_loader(cfg)))
    twin = next(iter(build(lazy.dataloader.train, "dataloader.train")))
    assert [d["file_name"] for d in ours] == [d["file_name"] for d in twin]
    for a, b in zip(ours, twin):
        assert torch.equal(a["image"], b["image"])
        assert torch.equal(a["instances"].gt_boxes.tensor, b["instances"].gt_boxes.tensor)


def test_same_test_splits_and_test_size():
    cfg, lazy = _pair(CONV_DEMO)
    assert eval_dataset_names(lazy) == list(cfg.DATASETS.TEST)
    resize = build(lazy.dataloader.test.mapper, "dataloader.test.mapper").augmentations.augs[0]
    assert (resize.short_edge_length, resize.max_size) == ((cfg.INPUT.MIN_SIZE_TEST,) * 2, cfg.INPUT.MAX_SIZE_TEST)


# ----------------------------------------------------------------------------- ergonomics
def test_misspelt_override_names_the_nearest_keys():
    sasa = _twin("configs/Demo/trees_SASA_R_26_slim_FPN.yaml")
    with pytest.raises(UnknownConfigKeyError) as e:
        load_lazy_config(sasa, ["model.backbone.bottom_up.kernel_sz=5"])
    assert "model.backbone.bottom_up.kernel_sz" in str(e.value)
    assert "model.backbone.bottom_up.attention.kernel_size" in e.value.suggestions
    with pytest.raises(UnknownConfigKeyError, match="did you mean train.max_iter"):
        load_lazy_config(sasa, ["train.max_iters=5"])
    # an argument the call takes by name is a key, even when the config does not write it
    cfg = load_lazy_config(_twin(CONV_DEMO), ["model.backbone.bottom_up.builder=mine", "train.max_iter=7"])
    assert (cfg.model.backbone.bottom_up.builder, cfg.train.max_iter) == ("mine", 7)


def test_out_of_range_values_fail_at_build_time_naming_the_key():
    sasa = _twin("configs/Demo/trees_SASA_R_26_slim_FPN.yaml")
    cfg = load_lazy_config(sasa, ["model.backbone.bottom_up.attention.kernel_size=4"])
    with pytest.raises(LazyBuildError, match=r"model\.backbone\.bottom_up\.attention\.kernel_size.*odd"):
        build(cfg.model, "model")
    cfg = load_lazy_config(sasa, ["model.backbone.bottom_up.attention.recompute_attention=1"])
    key = r"model\.backbone\.bottom_up\.attention\.recompute_attention"
    with pytest.raises(LazyBuildError, match=key + ".*True or False"):
        build(cfg.model, "model")
    cfg = load_lazy_config(_twin(CONV_DEMO), ["model.backbone.spatial_layer=transformer"])
    with pytest.raises(ConfigValueError, match=r"model\.backbone\.spatial_layer.*'attention'"):
        build(cfg.model, "model")
    cfg = load_lazy_config(_twin(CONV_DEMO), ["train.model_ema.decay=1.5"])
    from aadet.engine.lazy import build_lazy_model_ema

    with pytest.raises(ConfigValueError, match="train.model_ema.decay"):
        build_lazy_model_ema(cfg, torch.nn.Linear(1, 1))


def test_own_data_is_registered_from_the_config(tmp_path):
    from detectron2.data import DatasetCatalog

    (tmp_path / "images").mkdir()
    (tmp_path / "a.json").write_text('{"images": [], "annotations": [], "categories": [{"id": 1, "name": "x"}]}')
    entry = f"[[lazy_own_data,{tmp_path / 'a.json'},{tmp_path / 'images'}]]"
    load_lazy_config(_twin(CONV_DEMO), [f"dataloader.register_coco={entry}"])
    assert "lazy_own_data" in DatasetCatalog.list()
    with pytest.raises(ConfigValueError, match=r"dataloader\.register_coco\[0\]"):
        load_lazy_config(_twin(CONV_DEMO), ["dataloader.register_coco=[[only_a_name]]"])


# ----------------------------------------------------------------------------- the tools
@pytest.mark.parametrize("config", YAMLS)
def test_tools_read_the_same_settings_from_either(config):
    """What the predictor, export and visualization tools read (``load_any_config``)."""
    from aadet.engine.tool_config import inference_settings, load_any_config

    ours = inference_settings(load_any_config(os.path.join(REPO, config), ["MODEL.DEVICE", "cpu"]))
    twin = inference_settings(load_any_config(_twin(config), ["train.device=cpu"]))
    skip = {"attention_routes"}
    assert {k: v for k, v in vars(ours).items() if k not in skip} == {
        k: v for k, v in vars(twin).items() if k not in skip
    }
    by_kind = {kind: route for kind, route in ours.attention_routes.values()}
    attention = any(w in os.path.basename(config).lower() for w in ("aa_", "sasa", "halo", "ccnet"))
    assert bool(twin.attention_routes) == attention, "the attention models' routes are checked"
    for key, (kind, route) in twin.attention_routes.items():
        assert route == by_kind[kind], key


def test_export_check_names_the_lazy_key():
    from aadet.export.tracing import check_exportable

    aa = load_lazy_config(
        _twin("configs/Demo/trees_AA_R_26_slim_FPN.yaml"), ["model.backbone.bottom_up.attention.impl=cpp"]
    )
    with pytest.raises(ConfigValueError, match=r"model\.backbone\.bottom_up\.attention\.impl"):
        check_exportable(aa, "onnx")
    full = load_lazy_config(_twin("configs/Demo/trees_SASA_full_attention_R_26_slim.yaml"),
                            ["model.backbone.bottom_up.attention.impl=cpp"])
    with pytest.raises(ConfigValueError, match=r"model\.(backbone|head)\..*impl"):
        check_exportable(full, "onnx")  # the FPN's and head's routes follow the backbone's
    halo = load_lazy_config(_twin("configs/Demo/trees_Halo_R_26_slim_FPN.yaml"),
                            ["model.backbone.bottom_up.attention.impl=cpp"])
    with pytest.raises(ConfigValueError, match=r"model\.backbone\.bottom_up\.attention\.impl.*materialized"):
        check_exportable(halo, "onnx")  # a halo route, checked against the halo registry


def test_predictor_gives_the_same_detections_from_either(tmp_path):
    import numpy as np

    from aadet.engine import Predictor

    cfg, lazy = _pair(CONV_DEMO, ["MODEL.RETINANET.SCORE_THRESH_TEST", "0.0"], ["model.test_score_thresh=0.0"])
    torch.manual_seed(0)
    AADetCheckpointer(build_model(cfg), str(tmp_path)).save("w")
    image = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    a = Predictor(cfg, str(tmp_path / "w.pth"))(image)["instances"]
    b = Predictor(lazy, str(tmp_path / "w.pth"))(image)["instances"]
    assert len(a) > 0
    assert torch.equal(a.pred_boxes.tensor, b.pred_boxes.tensor) and torch.equal(a.scores, b.scores)


@pytest.mark.slow
def test_a_short_run_matches_train_net(tmp_path, data_env):
    """tools/lazyconfig_train_net.py and tools/train_net.py, three iterations of the conv demo
    from the same seed, each in its own process as a user runs them: bit-identical weights (what
    the same val AP relies on). (In one process the first training differs from later ones, for
    either trainer: a process-wide first-use effect, not the config.)"""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    runs = {
        "yaml": ["tools/train_net.py", "--config-file", CONV_DEMO, "--num-gpus", "0", "SOLVER.EPOCHS", "0",
                 "SOLVER.STEPS_EPOCHS", "()", "SOLVER.STEPS", "()", "SOLVER.MAX_ITER", "3", "DATASETS.TEST", "()",
                 "OUTPUT_DIR", str(tmp_path / "yaml")],
        "lazy": ["tools/lazyconfig_train_net.py", "--config-file", _twin(CONV_DEMO), "--num-gpus", "0",
                 "train.epochs=0", "train.steps=[]", "train.max_iter=3", "dataloader.test.dataset.names=[]",
                 f"train.output_dir={tmp_path / 'lazy'}"],
    }
    weights = {}
    for name, argv in runs.items():
        done = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        weights[name] = torch.load(tmp_path / name / "model_final.pth", weights_only=False)["model"]
    a, b = weights["yaml"], weights["lazy"]
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("override, key", [
    ("model.backbone.bottom_up.aa_stages=[res3,res9]", "model.backbone.bottom_up.aa_stages"),
    ("model.backbone.bottom_up.max_input_size=0", "model.backbone.bottom_up.max_input_size"),
])
def test_aa_builder_checks_its_plain_arguments(override, key):
    cfg = load_lazy_config(_twin("configs/Demo/trees_AA_R_26_slim_FPN.yaml"), [override])
    with pytest.raises(LazyBuildError, match=key.replace(".", r"\.")):
        build(cfg.model, "model")


def test_recipe_checks_its_plain_arguments():
    cfg = load_lazy_config(_twin(CONV_DEMO), ["dataloader.train.mapper.augmentations.flip_prob=1.5"])
    with pytest.raises(LazyBuildError, match=r"dataloader\.train\.mapper\.augmentations\.flip_prob"):
        build(cfg.dataloader.train.mapper, "dataloader.train.mapper")
