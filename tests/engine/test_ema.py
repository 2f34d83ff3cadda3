"""Moving average of the weights (``MODEL_EMA.*``, :class:`aadet.engine.ema.ModelEMA`): the update
formula in float64, swapping in and out, checkpoints, and that training's evaluation and
``--eval-only`` measure the averaged weights."""
import json
import os
import subprocess
import sys

import pytest
import torch
from detectron2.engine import hooks
from torch import nn

from aadet.config import ConfigValueError
from aadet.engine import AADetCheckpointer, CheckpointMismatchError, Trainer, get_aadet_cfg
from aadet.engine.ema import ModelEMA, build_model_ema, ema_decay
from aadet.engine.hooks import EMAHook

from tests.helpers import REPO
from tests.helpers.tiny_training import DEMO, WELL_CONDITIONED, run_worker


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()


def test_decay_warms_up_then_holds():
    assert ema_decay(0.998, 1) == pytest.approx(2 / 11)
    assert ema_decay(0.998, 90) == pytest.approx(91 / 100)
    assert ema_decay(0.998, 10**6) == 0.998  # (1 + t) / (10 + t) passes 0.998 at t = 4490
    assert ema_decay(0.9, 80) == 0.9


def test_update_is_the_formula_for_parameters_and_buffers():
    net = _net()
    ema = ModelEMA(net, decay=0.5)
    ref = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for t in range(1, 6):
        opt.zero_grad()
        net(torch.randn(8, 3, dtype=torch.float64)).square().sum().backward()
        opt.step()  # (the forward also moved BatchNorm's running stats)
        ema.update(net)
        d = min(0.5, (1 + t) / (10 + t))
        for k, w in net.state_dict().items():
            ref[k] = d * ref[k] + (1 - d) * w if w.is_floating_point() else w.clone()
    assert ema.updates == 5
    for k, v in ref.items():
        torch.testing.assert_close(ema.state[k], v, rtol=1e-12, atol=1e-14, msg=k)
    assert int(ema.state["1.num_batches_tracked"]) == 5  # integer buffers are copied
    assert not torch.equal(ema.state["0.weight"], net.state_dict()["0.weight"])


def test_applied_to_swaps_in_and_restores_the_trained_weights():
    net = _net()
    ema = ModelEMA(net, decay=0.9)
    trained = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        for p in ema.state.values():
            if p.is_floating_point():
                p.add_(1.0)
    with ema.applied_to(net):
        for k, v in net.state_dict().items():
            assert torch.equal(v, ema.state[k]), k
    for k, v in net.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_state_dict_round_trip_and_mismatch():
    net = _net()
    ema = ModelEMA(net, decay=0.9)
    ema.update(net)
    other = ModelEMA(_net(), decay=0.9)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1
    with pytest.raises(RuntimeError, match="does not match the model"):
        ModelEMA(nn.Linear(3, 2).double(), 0.9).load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        ModelEMA(net, decay=1.0)


def test_bad_decay_names_the_key():
    cfg = get_aadet_cfg()
    cfg.MODEL_EMA.DECAY = 1.0
    with pytest.raises(ConfigValueError, match=r"MODEL_EMA.DECAY must be in \[0, 1\); got 1.0"):
        build_model_ema(cfg, _net())  # when the trainer builds it


def test_checkpointer_loads_the_average_with_ema_weights(tmp_path):
    net = _net()
    ema = ModelEMA(net, decay=0.9)
    with torch.no_grad():
        ema.state["0.weight"].fill_(3.0)
    AADetCheckpointer(net, str(tmp_path), model_ema=ema).save("ckpt")
    path = str(tmp_path / "ckpt.pth")

    fresh = _net()
    AADetCheckpointer(fresh, strict=True, ema_weights=True).load(path)
    assert torch.equal(fresh.state_dict()["0.weight"], torch.full((4, 3), 3.0, dtype=torch.float64))
    AADetCheckpointer(fresh, strict=True).load(path)  # without: the trained weights
    assert torch.equal(fresh.state_dict()["0.weight"], net.state_dict()["0.weight"])

    AADetCheckpointer(net, str(tmp_path)).save("plain")
    with pytest.raises(CheckpointMismatchError, match="no moving-average weights.*MODEL_EMA.ENABLED False"):
        AADetCheckpointer(fresh, strict=True, ema_weights=True).load(str(tmp_path / "plain.pth"))


def test_trainer_updates_first_checkpoints_and_evaluates_the_average(hooks_trainer, monkeypatch):
    cfg = get_aadet_cfg()
    cfg.TEST.EVAL_PERIOD, cfg.MODEL_EMA.ENABLED, cfg.MODEL_EMA.DECAY = 2, True, 0.9
    model = nn.Linear(1, 1)
    trainer = hooks_trainer(cfg, model)
    built = trainer.build_hooks()
    assert isinstance(built[0], EMAHook)  # before the timer's, checkpointer's and evaluation's after_step
    assert trainer.checkpointer.checkpointables["model_ema"] is trainer.model_ema
    with torch.no_grad():
        trainer.model_ema.state["weight"].fill_(7.0)
    seen = []
    monkeypatch.setattr(Trainer, "test", classmethod(lambda cls, cfg, m: seen.append(float(m.weight)) or {}))
    next(h for h in built if isinstance(h, hooks.EvalHook))._do_eval()
    assert seen == [7.0] and float(model.weight) != 7.0  # evaluated the average, then restored

    cfg.MODEL_EMA.ENABLED = False
    assert EMAHook not in [type(h) for h in trainer.build_hooks()] and trainer.model_ema is None


def _detections(path):
    with open(path) as f:
        return sorted((d["image_id"], round(d["score"], 5), *map(lambda x: round(x, 2), d["bbox"]))
                      for d in json.load(f))


def test_training_and_eval_only_evaluate_the_average(data_env, tmp_path):
    """With MODEL_EMA.ENABLED the evaluation after training is of the averaged weights: the same
    detections as ``--eval-only`` of model_final.pth with MODEL_EMA.ENABLED, other detections
    than its trained weights (MODEL_EMA.ENABLED False)."""
    ema = ["MODEL_EMA.ENABLED", "True", "MODEL_EMA.DECAY", "0.9"]
    run_worker(tmp_path, opts=["SOLVER.MAX_ITER", "4", "SOLVER.STEPS", "()",
                               "DATASETS.TEST", "('trees_val',)", *ema])
    final = torch.load(tmp_path / "model_final.pth", map_location="cpu", weights_only=False)
    assert final["model_ema"]["updates"] == 4
    trained = _detections(tmp_path / "inference" / "trees_val" / "coco_instances_results.json")
    assert trained

    def eval_only(name, opts):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        p = subprocess.run(
            [sys.executable, os.path.join(REPO, "tools", "train_net.py"), "--config-file", DEMO,
             "--eval-only", "MODEL.WEIGHTS", str(tmp_path / "model_final.pth"),
             "OUTPUT_DIR", str(tmp_path / name), "MODEL.DEVICE", "cpu", *WELL_CONDITIONED, *opts],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return _detections(tmp_path / name / "inference" / "trees_val" / "coco_instances_results.json")

    assert eval_only("eval_ema", ema) == trained
    assert eval_only("eval_raw", ["MODEL_EMA.ENABLED", "False"]) != trained
