"""``lr_multiplier``: Detectron2's ``WarmupMultiStepLR`` (``SOLVER.LR_SCHEDULER_NAME``'s default)
over ``train.max_iter`` with decays at ``train.steps`` and warm-up over ``train.warmup_iters``
(all three filled from ``train.epochs`` at start: ``aadet.engine.lazy.apply_lazy_epoch_schedule``)."""
from detectron2.config import LazyCall as L
from detectron2.config import get_cfg

from aadet.engine.schedule import warmup_multistep_multiplier

_s = get_cfg().SOLVER  # Detectron2's defaults: the values' one home

lr_multiplier = L(warmup_multistep_multiplier)(
    max_iter="${train.max_iter}",
    steps="${train.steps}",
    gamma=_s.GAMMA,  # SOLVER.GAMMA
    warmup_factor=_s.WARMUP_FACTOR,  # SOLVER.WARMUP_FACTOR
    warmup_iters="${train.warmup_iters}",
    warmup_method=_s.WARMUP_METHOD,  # SOLVER.WARMUP_METHOD
    rescale_interval=_s.RESCALE_INTERVAL,  # SOLVER.RESCALE_INTERVAL
)
