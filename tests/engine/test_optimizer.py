"""SOLVER.OPTIMIZER: "SGD" is Detectron2's optimizer exactly; "AdamW" takes the same parameter
groups; bad values are named at build time."""
import re

import pytest
import torch
from detectron2.config import get_cfg
from detectron2.solver import build_optimizer as d2_build_optimizer
from torch import nn

from aadet.config import ConfigValueError, add_aadet_config, validate_aadet_config
from aadet.engine import Trainer
from aadet.engine.optimizer import OPTIMIZERS, build_optimizer


def _cfg(**solver):
    cfg = get_cfg()
    add_aadet_config(cfg)
    cfg.SOLVER.BASE_LR = 0.1
    cfg.SOLVER.WEIGHT_DECAY = 1e-4
    cfg.SOLVER.WEIGHT_DECAY_NORM = 0.0
    cfg.SOLVER.MAX_ITER = 10
    for key, value in solver.items():
        setattr(cfg.SOLVER, key, value)
    return cfg


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Conv2d(4, 2, 1))


def test_sgd_is_detectron2s_optimizer():
    cfg = _cfg()
    ours, theirs = Trainer.build_optimizer(cfg, _model()), d2_build_optimizer(cfg, _model())
    assert type(ours) is type(theirs)
    assert isinstance(ours, torch.optim.SGD)
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in ours.param_groups] == [
        (g["lr"], g["weight_decay"], len(g["params"])) for g in theirs.param_groups]
    assert ours.defaults["momentum"] == theirs.defaults["momentum"] == cfg.SOLVER.MOMENTUM


def test_adamw_uses_detectron2s_parameter_groups_and_betas():
    cfg = _cfg(OPTIMIZER="AdamW", ADAMW_BETAS=(0.8, 0.99), BASE_LR=1e-3)
    opt = Trainer.build_optimizer(cfg, _model())
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.8, 0.99)
    # norm weights/biases without decay (WEIGHT_DECAY_NORM 0), conv weights and biases with it
    assert sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups) == [(0.0, 2), (1e-4, 4)]


def test_adamw_moves_parameters_whose_gradients_are_tiny():
    """The reason for AdamW: a parameter with a 1e-4 gradient takes an lr-sized step, as a
    parameter with a 1e-1 gradient does; SGD moves it 1000x less."""
    for name, expect in (("SGD", 0.1 * 1e-4), ("AdamW", 0.1)):
        cfg = _cfg(OPTIMIZER=name, WEIGHT_DECAY=0.0)
        model = nn.Module()
        model.w = nn.Parameter(torch.ones(2))
        opt = Trainer.build_optimizer(cfg, model)
        model.w.grad = torch.full((2,), 1e-4)
        opt.step()
        assert torch.allclose(1 - model.w.detach(), torch.full((2,), expect), rtol=1e-3), name


@pytest.mark.parametrize("key,value,needle", [
    ("ADAMW_BETAS", (0.9, 1.0), "SOLVER.ADAMW_BETAS must be two values in [0, 1)"),
    ("ADAMW_BETAS", (0.9,), "SOLVER.ADAMW_BETAS must be two values in [0, 1)"),
])
def test_bad_optimizer_keys_are_named(key, value, needle):
    cfg = _cfg(**{key: value})
    with pytest.raises(ConfigValueError) as e:
        validate_aadet_config(cfg)
    assert needle in str(e.value)


def test_the_registry_is_the_allowed_list():
    """SOLVER.OPTIMIZER is checked against OPTIMIZERS itself when the optimizer is built: a name
    registered there is accepted, any other is an error listing the registered ones."""
    cfg = _cfg(OPTIMIZER="Adam")
    with pytest.raises(ConfigValueError, match=re.escape("SOLVER.OPTIMIZER must be one of ('SGD', 'AdamW')")):
        build_optimizer(cfg, torch.nn.Linear(2, 2))
    OPTIMIZERS["Adam"] = lambda cfg, model: torch.optim.Adam(model.parameters(), lr=cfg.SOLVER.BASE_LR)
    try:
        assert isinstance(build_optimizer(cfg, torch.nn.Linear(2, 2)), torch.optim.Adam)
    finally:
        del OPTIMIZERS["Adam"]
