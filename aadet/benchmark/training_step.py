"""One training step of a detector on a fixed batch, the one that the tools time and check:
forward with losses (under autocast), backward, optimizer step.

``tools/benchmark.py`` times it, ``dev/profile_step.py`` profiles it, the GPU check trains every
config a few steps with it. It is Detectron2's ``SimpleTrainer.run_step`` / ``AMPTrainer.run_step``
without the data loader and the metrics: the losses summed, the gradients zeroed after the
forward, and with float16 on CUDA a ``GradScaler`` (bfloat16 needs none,
:func:`aadet.benchmark.timing.needs_grad_scaler`). The losses are logged to the step's own
``EventStorage`` (RetinaNet's loss needs one), so a step runs anywhere.

    step = TrainingStep(model, detectron2_inputs(make_batch(2, 256, 256, seed=0), num_classes))
    step()  # -> the summed loss of that step (detached)
"""
from typing import Dict, Optional, Sequence

import torch
from detectron2.utils.events import EventStorage

from .timing import autocast, needs_grad_scaler

__all__ = ["default_optimizer", "TrainingStep"]


def default_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The tools' optimizer when the config's is not wanted: SGD, lr 1e-4, momentum 0.9, weight
    decay 1e-4 (small steps: a timed model stays near its initialization)."""
    return torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, weight_decay=1e-4)


class TrainingStep:
    """``step()`` trains ``model`` one step on ``inputs``, its ``batched_inputs`` with instances
    (:func:`aadet.benchmark.synthetic_batch.detectron2_inputs`). Puts ``model`` in train mode.

    Args:
        optimizer: default :func:`default_optimizer`; ``scheduler``, if given, steps after it
            (e.g. the config's, ``Trainer.build_lr_scheduler``).
        amp_dtype: None (float32), or the autocast dtype of the forward, ``"float16"`` or
            ``"bfloat16"`` (:data:`aadet.benchmark.timing.AMP_DTYPES`).
        check_finite: raise ``FloatingPointError`` naming the iteration when the loss or, without
            a ``GradScaler`` (which skips such steps itself), a gradient is not finite.

    Attributes:
        iteration: steps taken so far.
    """

    def __init__(self, model: torch.nn.Module, inputs: Sequence[Dict], optimizer=None, *, scheduler=None,
                 amp_dtype: Optional[str] = None, check_finite: bool = False):
        self.model = model.train()
        self.inputs = inputs
        self.optimizer = optimizer if optimizer is not None else default_optimizer(model)
        self.scheduler = scheduler
        self.device = next(model.parameters()).device
        self.amp_dtype = amp_dtype
        self.scaler = torch.amp.GradScaler(
            "cuda", enabled=amp_dtype is not None and needs_grad_scaler(self.device, amp_dtype))
        self.check_finite = check_finite
        self.iteration = 0
        self._storage = EventStorage(0)

    def __call__(self) -> torch.Tensor:
        with self._storage, autocast(self.device, self.amp_dtype or "bfloat16", enabled=self.amp_dtype is not None):
            losses = self.model(self.inputs)
        loss = sum(losses.values())
        if self.check_finite and not torch.isfinite(loss):
            raise FloatingPointError(f"iteration {self.iteration}: loss is not finite: "
                                     f"{ {k: float(v.detach()) for k, v in losses.items()} }")
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.check_finite and not self.scaler.is_enabled():
            bad = [n for n, p in self.model.named_parameters()
                   if p.grad is not None and not torch.isfinite(p.grad).all()]
            if bad:
                raise FloatingPointError(f"iteration {self.iteration}: non-finite gradients in {bad[:5]}")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.iteration += 1
        return loss.detach()
