"""The Detectron2 internals wrapped in aadet.engine.d2compat still exist and mean what the wrappers
assume. A failure here names the internal a new Detectron2 changed: fix d2compat, nowhere else."""
import inspect
import os

import pytest
import torch
from detectron2.engine import DefaultTrainer, SimpleTrainer, defaults
from detectron2.modeling.meta_arch.dense_detector import DenseDetector
from detectron2.modeling.meta_arch.retinanet import RetinaNet
from detectron2.utils.events import EventStorage

import aadet  # noqa: F401
from aadet.engine import d2compat, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
