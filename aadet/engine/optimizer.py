"""The optimizer from ``SOLVER.OPTIMIZER``: Detectron2's SGD, or AdamW.

Both take Detectron2's parameter groups (``get_default_optimizer_params``: ``BASE_LR``,
``WEIGHT_DECAY``, ``WEIGHT_DECAY_NORM``, ``BIAS_LR_FACTOR``, ``WEIGHT_DECAY_BIAS``) and its
gradient clipping (``SOLVER.CLIP_GRADIENTS``); the LR schedule is Detectron2's either way.

* ``"SGD"`` (default; the papers' recipe): Detectron2's ``build_optimizer`` itself
  (``MOMENTUM``, ``NESTEROV``).
* ``"AdamW"``: ``torch.optim.AdamW`` with ``SOLVER.ADAMW_BETAS`` and decoupled weight decay.
  Adam scales each parameter's step by its own gradient statistics, so parameters whose
  gradients are orders of magnitude smaller than the others' (attention's relative position
  embeddings: ``||grad|| / ||w||`` around 1e-4 against 4e-2 to 1.6e-1 for the value projections
  on the SGD tree demo) still move; with SGD they barely do in a short schedule. Transformer
  detectors (DETR, ViTDet) train with AdamW for the same reason. Its ``BASE_LR`` is of another
  scale than SGD's (e.g. 1e-3 rather than 1e-2).
"""
from typing import Callable, Dict, List

import torch
from detectron2.solver import build_optimizer as detectron2_build_optimizer
from detectron2.solver import get_default_optimizer_params

from ..config import config_error
from ..layers.functional.checks import check_one_of
from ..utils.d2compat import maybe_add_gradient_clipping

__all__ = ["OPTIMIZERS", "build_optimizer", "optimizer_param_groups"]


def optimizer_param_groups(cfg, model: torch.nn.Module) -> List[Dict]:
    """Detectron2's parameter groups (``get_default_optimizer_params`` with ``BASE_LR``,
    ``WEIGHT_DECAY_NORM``, ``BIAS_LR_FACTOR``, ``WEIGHT_DECAY_BIAS``)."""
    s = cfg.SOLVER
    return get_default_optimizer_params(
        model,
        base_lr=s.BASE_LR,
        weight_decay_norm=s.WEIGHT_DECAY_NORM,
        bias_lr_factor=s.BIAS_LR_FACTOR,
        weight_decay_bias=s.WEIGHT_DECAY_BIAS,
    )


def _adamw(cfg, model) -> torch.optim.Optimizer:
    """AdamW over :func:`optimizer_param_groups`, with Detectron2's gradient clipping."""
    s = cfg.SOLVER
    adamw = torch.optim.AdamW(
        optimizer_param_groups(cfg, model),
        lr=s.BASE_LR,
        betas=tuple(s.ADAMW_BETAS),
        weight_decay=s.WEIGHT_DECAY,
        foreach=True,
    )
    return maybe_add_gradient_clipping(cfg, adamw)


#: ``SOLVER.OPTIMIZER`` value -> ``(cfg, model) -> optimizer``: the names the config accepts.
OPTIMIZERS: Dict[str, Callable] = {"SGD": detectron2_build_optimizer, "AdamW": _adamw}


def build_optimizer(cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``OPTIMIZERS[cfg.SOLVER.OPTIMIZER](cfg, model)``.

    Raises:
        ConfigValueError: ``SOLVER.OPTIMIZER`` not in :data:`OPTIMIZERS` (the message lists them).
    """
    check_one_of(cfg.SOLVER.OPTIMIZER, tuple(OPTIMIZERS), "SOLVER.OPTIMIZER", config_error)
    return OPTIMIZERS[cfg.SOLVER.OPTIMIZER](cfg, model)
