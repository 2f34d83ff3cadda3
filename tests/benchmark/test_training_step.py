"""The tools' training step (``aadet/benchmark/training_step.py``) on a toy detector: the same
weights as the loop it replaces, its own event storage, autocast, the scheduler, and the finite
checks naming the iteration."""
import copy

import pytest
import torch
from detectron2.utils.events import EventStorage, get_event_storage
from torch import nn

from aadet.benchmark.training_step import TrainingStep, default_optimizer


class Toy(nn.Module):
    """A "detector": ``batched_inputs`` in, a dict of losses out, logging to the event storage
    as RetinaNet does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.scale = 1.0
        self.dtype = None

    def forward(self, batched_inputs):
        x = torch.stack([d["image"] for d in batched_inputs])
        out = self.lin(x) * self.scale
        self.dtype = out.dtype
        get_event_storage().put_scalar("images", len(batched_inputs))
        return {"loss_fit": (out.float() - 1).pow(2).mean(), "loss_small": out.float().abs().mean() * 0.1}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [{"image": torch.randn(4, generator=g)} for _ in range(3)]


def test_the_step_is_the_hand_written_loop():
    torch.manual_seed(0)
    model, inputs = Toy(), _inputs()
    ref = copy.deepcopy(model)
    opt = default_optimizer(ref)
    step = TrainingStep(model, inputs)
    with EventStorage(0):
        for _ in range(3):
            losses = ref(inputs)
            opt.zero_grad(set_to_none=True)
            sum(losses.values()).backward()
            opt.step()
    for _ in range(3):
        step()
    assert step.iteration == 3 and model.training
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_loss_goes_down_and_the_scheduler_steps():
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = TrainingStep(model, _inputs(), opt, scheduler=sched)
    first = step()
    for _ in range(9):
        last = step()
    assert last < first and not last.requires_grad
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 5)


def test_autocast_only_when_asked():
    model = Toy()
    TrainingStep(model, _inputs(), amp_dtype="bfloat16")()
    assert model.dtype == torch.bfloat16
    TrainingStep(model, _inputs())()
    assert model.dtype == torch.float32
    assert not TrainingStep(model, _inputs(), amp_dtype="float16").scaler.is_enabled()  # CPU: no scaler


def test_non_finite_loss_and_gradients_name_the_iteration():
    model = Toy()
    step = TrainingStep(model, _inputs(), check_finite=True)
    step()
    model.scale = float("nan")
    with pytest.raises(FloatingPointError, match=r"iteration 1: loss is not finite: .*loss_fit"):
        step()

    model = Toy()
    model.lin.weight.register_hook(lambda g: g * float("inf"))
    with pytest.raises(FloatingPointError, match=r"iteration 0: non-finite gradients in \['lin.weight'\]"):
        TrainingStep(model, _inputs(), check_finite=True)()
    TrainingStep(model, _inputs())()  # unchecked: no error
