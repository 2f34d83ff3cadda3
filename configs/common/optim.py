"""Optimizers over Detectron2's parameter groups (``get_default_optimizer_params``; ``params.model``
is set to the model before it is built), as ``SOLVER.OPTIMIZER`` builds them
(``aadet/engine/optimizer.py``): ``SGD`` (the papers') and ``AdamW``. Values: the YACS defaults."""
import torch
from detectron2.config import LazyCall as L
from detectron2.solver import get_default_optimizer_params

from aadet.engine import get_aadet_cfg

_s = get_aadet_cfg().SOLVER  # Detectron2's and aadet's defaults: the values' one home


def _params():
    return L(get_default_optimizer_params)(
        base_lr="${..lr}",
        weight_decay_norm=_s.WEIGHT_DECAY_NORM,  # SOLVER.WEIGHT_DECAY_NORM
        bias_lr_factor=_s.BIAS_LR_FACTOR,  # SOLVER.BIAS_LR_FACTOR
        weight_decay_bias=_s.WEIGHT_DECAY_BIAS,  # SOLVER.WEIGHT_DECAY_BIAS
    )


SGD = L(torch.optim.SGD)(
    params=_params(),
    lr=_s.BASE_LR,  # SOLVER.BASE_LR
    momentum=_s.MOMENTUM,  # SOLVER.MOMENTUM
    nesterov=_s.NESTEROV,  # SOLVER.NESTEROV
    weight_decay=_s.WEIGHT_DECAY,  # SOLVER.WEIGHT_DECAY
    foreach=True,  # as Detectron2's build_optimizer
)

AdamW = L(torch.optim.AdamW)(
    params=_params(),
    lr=_s.BASE_LR,  # SOLVER.BASE_LR
    betas=tuple(_s.ADAMW_BETAS),  # SOLVER.ADAMW_BETAS
    weight_decay=_s.WEIGHT_DECAY,  # SOLVER.WEIGHT_DECAY (decoupled)
    foreach=True,  # as aadet/engine/optimizer.py
)
