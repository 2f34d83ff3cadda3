"""The Detectron2 and fvcore internals wrapped in aadet.utils.d2compat still exist and mean what the
wrappers assume, one test (or more) per internal. A failure here names the internal a new Detectron2
or fvcore changed: fix d2compat, nowhere else."""
import inspect
import os

import pytest
import torch
from detectron2.engine import DefaultTrainer, SimpleTrainer, defaults
from detectron2.modeling.meta_arch.dense_detector import DenseDetector
from detectron2.modeling.meta_arch.retinanet import RetinaNet
from detectron2.utils.events import EventStorage

import aadet  # noqa: F401
from aadet.engine import load_config
from aadet.utils import d2compat

from tests.helpers import REPO


# ----------------------------------------------------------------------------- DefaultTrainer._trainer
def test_default_trainer_keeps_its_loop_in__trainer():
    assert "_trainer" in DefaultTrainer.__init__.__code__.co_names, (
        "DefaultTrainer.__init__ no longer sets self._trainer: update d2compat.inner_trainer")


def _loop(values):
    model = torch.nn.Linear(1, 1)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.seen = []

        def forward(self, batch):
            self.seen.append(batch)
            return {"loss": self.model(torch.tensor([[float(batch)]])).sum()}

    wrapped = Loss()
    return SimpleTrainer(wrapped, values, torch.optim.SGD(model.parameters(), lr=0.0)), wrapped


def test_restart_data_loader_switches_the_stream():
    loop, model = _loop([1, 2, 3])

    class Holder:  # what DefaultTrainer is to its SimpleTrainer
        _trainer = loop

    with EventStorage(0) as storage:
        loop.storage = storage
        loop.iter = 0
        loop.run_step()
        d2compat.restart_data_loader(Holder(), lambda: [7, 8])
        loop.run_step()
        loop.run_step()
    assert model.seen == [1, 7, 8]
    assert loop.data_loader == [7, 8]
    assert hasattr(SimpleTrainer, "reset_data_loader"), (
        "SimpleTrainer.reset_data_loader is gone: the v0.6 fallback in d2compat assumes an eager "
        "_data_loader_iter attribute; check what this Detectron2 does")
    params = list(inspect.signature(SimpleTrainer.reset_data_loader).parameters)
    assert params == ["self", "data_loader_builder"]


# ----------------------------------------------------------------------------- create_ddp_model
def test_default_trainer_looks_up_create_ddp_model_in_defaults():
    init = DefaultTrainer.__init__
    assert "create_ddp_model" in init.__code__.co_names and init.__globals__ is vars(defaults), (
        "DefaultTrainer.__init__ no longer calls detectron2.engine.defaults.create_ddp_model: "
        "update d2compat.ddp_without_device_ids_on_cpu")
    params = inspect.signature(defaults.create_ddp_model).parameters
    assert "fp16_compression" in params and any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_ddp_patch_drops_device_ids_for_cpu_models_only(monkeypatch):
    calls = []
    monkeypatch.setattr(defaults, "create_ddp_model", lambda model, **kw: calls.append(kw) or model)
    original = defaults.create_ddp_model
    cpu = torch.nn.Linear(2, 2)
    with d2compat.ddp_without_device_ids_on_cpu():
        assert defaults.create_ddp_model is not original
        assert defaults.create_ddp_model(cpu, broadcast_buffers=False) is cpu
        defaults.create_ddp_model(cpu, device_ids=[3])  # explicit arguments win
    assert defaults.create_ddp_model is original  # restored
    assert calls == [{"broadcast_buffers": False, "device_ids": None}, {"device_ids": [3]}]


# ----------------------------------------------------------------------------- DenseDetector._ema_update
def test_dense_detector_ema_update_is_what_retinanet_losses_call():
    params = list(inspect.signature(DenseDetector._ema_update).parameters)
    assert params == ["self", "name", "value", "initial_value", "momentum"], (
        "DenseDetector._ema_update changed its signature: update d2compat.EMAUpdateHook")
    code = RetinaNet.losses.__code__
    assert "_ema_update" in code.co_names and "loss_normalizer" in code.co_consts, (
        "RetinaNet.losses no longer normalizes through _ema_update('loss_normalizer', ...)")


def test_aadet_retinanet_normalizer_goes_through_the_hook():
    """One training step: Detectron2 calls the hook, the checkpointed buffer holds the EMA
    (100 * 0.9 + num_pos * 0.1), and Detectron2's own attribute is never created."""
    from detectron2.modeling import build_model
    from detectron2.structures import Boxes, Instances

    cfg = load_config(os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml"),
                      ["MODEL.DEVICE", "cpu"], freeze=False)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    seen = []
    hook = model.ema_update

    def spy(name, value, initial_value, momentum=0.9):
        seen.append((name, value, initial_value, momentum))
        return hook(name, value, initial_value, momentum)

    model.ema_update = spy
    inst = Instances((64, 64))
    inst.gt_boxes = Boxes(torch.tensor([[8.0, 8.0, 40.0, 48.0]]))
    inst.gt_classes = torch.tensor([0])
    with EventStorage(0):
        model([{"image": torch.rand(3, 64, 64) * 255, "instances": inst}])
    assert len(seen) == 1 and seen[0][0] == "loss_normalizer" and seen[0][2] == 100
    num_pos = seen[0][1]
    assert num_pos >= 1
    assert float(model.loss_normalizer_ema) == pytest.approx(100 * 0.9 + num_pos * 0.1)
    assert not hasattr(model, "loss_normalizer")


def _demo_model(*opts):
    from detectron2.modeling import build_model

    cfg = load_config(os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml"),
                      ["MODEL.DEVICE", "cpu", *opts], freeze=False)
    torch.manual_seed(0)
    return build_model(cfg)


# ------------------------------------------------------------------ DenseDetector._decode_multi_level_predictions
def test_decode_multi_level_predictions_is_what_retinanet_inference_calls():
    params = list(inspect.signature(DenseDetector._decode_multi_level_predictions).parameters)
    assert params == ["self", "anchors", "pred_scores", "pred_deltas", "score_thresh", "topk_candidates",
                      "image_size"], (
        "DenseDetector._decode_multi_level_predictions changed its signature: update "
        "d2compat.decode_multi_level_predictions")
    assert "_decode_multi_level_predictions" in RetinaNet.inference_single_image.__code__.co_names, (
        "RetinaNet.inference_single_image no longer decodes through _decode_multi_level_predictions")


def test_aadet_retinanet_inference_without_voting_is_detectron2s():
    from detectron2.structures import Boxes

    model = _demo_model("TEST.BBOX_VOTE.ENABLED", "False").eval()
    assert model.bbox_vote_thresh == 0.0
    g = torch.Generator().manual_seed(0)
    anchors, scores, deltas = [], [], []
    for n in (40, 12):  # two levels
        xy = torch.rand(n, 2, generator=g) * 48
        anchors.append(Boxes(torch.cat([xy, xy + 8 + torch.rand(n, 2, generator=g) * 8], dim=1)))
        scores.append(torch.rand(n, 1, generator=g))
        deltas.append(torch.randn(n, 4, generator=g) * 0.1)
    ours = model.inference_single_image(anchors, scores, deltas, (64, 64))
    theirs = RetinaNet.inference_single_image(model, anchors, scores, deltas, (64, 64))
    assert len(ours) > 0
    assert torch.equal(ours.pred_boxes.tensor, theirs.pred_boxes.tensor)
    assert torch.equal(ours.scores, theirs.scores) and torch.equal(ours.pred_classes, theirs.pred_classes)


# ----------------------------------------------------------------------------- DefaultTrainer._last_eval_results
def test_default_trainer_train_returns__last_eval_results():
    assert "_last_eval_results" in DefaultTrainer.train.__code__.co_names, (
        "DefaultTrainer.train() no longer returns self._last_eval_results: update "
        "d2compat.set_train_results")
    from detectron2.config import get_cfg

    trainer = DefaultTrainer.__new__(DefaultTrainer)  # no model, no loader: a loop of 0 iterations
    trainer._hooks, trainer.start_iter, trainer.max_iter = [], 0, 0
    trainer.cfg = get_cfg()
    trainer.cfg.TEST.EXPECTED_RESULTS = [["bbox", "AP", 50.0, 0.1]]
    results = {"bbox": {"AP": 50.0}}
    d2compat.set_train_results(trainer, results)
    assert trainer.train() is results


# ----------------------------------------------------------------------------- fvcore Checkpointer._load_model
def test_checkpointer_load_goes_through__load_model(tmp_path):
    from detectron2.checkpoint import DetectionCheckpointer
    from fvcore.common.checkpoint import Checkpointer

    assert "_load_model" in Checkpointer.load.__code__.co_names, (
        "fvcore Checkpointer.load no longer calls self._load_model: update d2compat.LoadModelHook")
    for cls in (Checkpointer, DetectionCheckpointer):
        assert list(inspect.signature(cls._load_model).parameters) == ["self", "checkpoint"], cls

    seen = []

    class Recording(d2compat.LoadModelHook, DetectionCheckpointer):
        def load_model_state(self, checkpoint):
            seen.append(sorted(checkpoint["model"]))
            return super().load_model_state(checkpoint)

    torch.save({"model": {"weight": torch.ones(2, 2), "extra": torch.zeros(1)}}, tmp_path / "w.pth")
    model = torch.nn.Linear(2, 2)
    Recording(model).load(str(tmp_path / "w.pth"))
    assert seen == [["extra", "weight"]]
    assert torch.equal(model.weight.detach(), torch.ones(2, 2))


def test_aadet_checkpointer_overrides_the_public_hook():
    from aadet.engine import AADetCheckpointer

    assert "_load_model" not in vars(AADetCheckpointer) and "load_model_state" in vars(AADetCheckpointer)


# ----------------------------------------------------------------------------- fvcore Registry._do_register
def test_named_registry_files_under_the_given_name():
    from fvcore.common.registry import Registry

    assert list(inspect.signature(Registry._do_register).parameters) == ["self", "name", "obj"], (
        "fvcore Registry._do_register changed its signature: update d2compat.NamedRegistry")
    registry = d2compat.NamedRegistry("TEST_NAMED")

    @registry.register("short")
    def a_descriptive_name():
        pass

    @registry.register()
    def plain():
        pass

    assert registry.get("short") is a_descriptive_name and registry.get("plain") is plain
    assert sorted(name for name, _ in registry) == ["plain", "short"]
    with pytest.raises(AssertionError, match="short"):  # fvcore refuses a second object of a name
        registry.register("short")(plain)


# ----------------------------------------------------------------------------- maybe_add_gradient_clipping
def test_maybe_add_gradient_clipping_wraps_any_optimizer():
    from detectron2.config import get_cfg

    assert list(inspect.signature(d2compat.maybe_add_gradient_clipping).parameters) == ["cfg", "optimizer"]
    cfg = get_cfg()
    params = [torch.nn.Parameter(torch.ones(2))]
    adamw = torch.optim.AdamW(params, lr=1.0)
    assert d2compat.maybe_add_gradient_clipping(cfg, adamw) is adamw  # CLIP_GRADIENTS off
    cfg.SOLVER.CLIP_GRADIENTS.ENABLED = True
    cfg.SOLVER.CLIP_GRADIENTS.CLIP_TYPE, cfg.SOLVER.CLIP_GRADIENTS.CLIP_VALUE = "value", 0.5
    clipped = d2compat.maybe_add_gradient_clipping(cfg, torch.optim.SGD(params, lr=1.0))
    assert isinstance(clipped, torch.optim.SGD) and type(clipped) is not torch.optim.SGD
    params[0].grad = torch.full((2,), 10.0)
    clipped.step()
    assert torch.allclose(params[0].detach(), torch.full((2,), 0.5))  # 1 - lr * clip(10, 0.5)


# ----------------------------------------------------------------------------- nowhere else
#: The internals d2compat wraps; no other module of aadet names them.
WRAPPED_INTERNALS = {
    "_trainer", "_data_loader_iter", "create_ddp_model", "_last_eval_results", "_ema_update",
    "_decode_multi_level_predictions", "_load_model", "_do_register", "_obj_map", "_init",
    "maybe_add_gradient_clipping", "COCOeval_opt", "_LOCAL_PROCESS_GROUP",
}


def test_no_other_module_of_aadet_touches_the_wrapped_internals():
    import ast

    root = os.path.join(REPO, "aadet")
    own = os.path.join(root, "utils", "d2compat.py")
    bad = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or path == own:
                continue
            with open(path) as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                names, private = [], []  # any wrapped name; any private name of detectron2/fvcore
                if isinstance(node, ast.Attribute):
                    names = [node.attr]
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names = [node.name]
                elif isinstance(node, ast.ImportFrom):  # (d2compat's own names may be imported)
                    if not node.level and node.module.split(".")[0] in ("detectron2", "fvcore"):
                        names = [a.name for a in node.names]
                        private = [n for n in node.module.split(".") + names if n.startswith("_")]
                elif isinstance(node, ast.Import):
                    private = [p for a in node.names if a.name.split(".")[0] in ("detectron2", "fvcore")
                               for p in a.name.split(".") if p.startswith("_")]
                for name in [n for n in names if n in WRAPPED_INTERNALS] + private:
                    bad.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {name}")
    assert not bad, "Detectron2/fvcore internals used outside aadet/utils/d2compat.py:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- comm._LOCAL_PROCESS_GROUP
@pytest.mark.parametrize("v06", [False, True], ids=["create_local_process_group", "v0.6"])
def test_create_local_process_group_sets_detectron2s_local_group(v06, monkeypatch, tmp_path):
    import torch.distributed as dist
    from detectron2.utils import comm

    assert hasattr(comm, "_LOCAL_PROCESS_GROUP"), (
        "detectron2.utils.comm._LOCAL_PROCESS_GROUP is gone: update d2compat.create_local_process_group")
    if v06:  # Detectron2 v0.6 has no create_local_process_group
        monkeypatch.delattr(comm, "create_local_process_group")
    else:
        comm.create_local_process_group.cache_clear()
    monkeypatch.setattr(comm, "_LOCAL_PROCESS_GROUP", None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        d2compat.create_local_process_group(1)
        assert comm._LOCAL_PROCESS_GROUP is not None
        assert comm.get_local_rank() == 0 and comm.get_local_size() == 1
        # Released at the end of a run (aadet.engine.launch), it can be created again.
        d2compat.release_local_process_group()
        assert comm._LOCAL_PROCESS_GROUP is None
        d2compat.create_local_process_group(1)
        assert comm._LOCAL_PROCESS_GROUP is not None
    finally:
        dist.destroy_process_group()
        if not v06:
            comm.create_local_process_group.cache_clear()
