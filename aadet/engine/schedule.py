"""Epoch-based schedules: the papers train "150 epochs"; Detectron2 counts iterations.

``SOLVER.EPOCHS``/``STEPS_EPOCHS``/``WARMUP_EPOCHS`` are converted to ``MAX_ITER``/``STEPS``/
``WARMUP_ITERS`` from the number of training images and ``SOLVER.IMS_PER_BATCH`` (the total batch
of ``SOLVER.REFERENCE_WORLD_SIZE`` workers). Conversion happens before Detectron2's
``auto_scale_workers`` so that a run on a different number of GPUs still covers the same epochs.
"""
import logging
import math

from ..config import config_error

__all__ = [
    "epochs_to_iters",
    "epoch_schedule",
    "apply_epoch_schedule",
    "count_training_images",
    "warmup_multistep_multiplier",
]

logger = logging.getLogger(__name__)


def epochs_to_iters(epochs: float, num_images: int, ims_per_batch: int) -> int:
    """``ceil(epochs * num_images / ims_per_batch)``."""
    if num_images <= 0:
        raise ValueError(f"the training set is empty (0 images); cannot convert {epochs} epochs")
    if ims_per_batch <= 0:
        raise config_error("SOLVER.IMS_PER_BATCH", "> 0", ims_per_batch)
    return int(math.ceil(epochs * num_images / ims_per_batch))


def count_training_images(cfg) -> int:
    """Number of images the train loader samples from (after Detectron2's empty-image filter)."""
    from detectron2.data import get_detection_dataset_dicts

    dicts = get_detection_dataset_dicts(
        cfg.DATASETS.TRAIN, filter_empty=cfg.DATALOADER.FILTER_EMPTY_ANNOTATIONS
    )
    return len(dicts)


def epoch_schedule(
    epochs: float, steps_epochs, num_images: int, ims_per_batch: int, warmup_epochs: float = 0.0,
    key: str = "SOLVER.STEPS_EPOCHS",
):
    """``(max_iter, steps, warmup_iters)`` of an epoch schedule: each :func:`epochs_to_iters`;
    ``warmup_iters`` is None when ``warmup_epochs`` is 0 (the iteration count given stays).

    Raises:
        ConfigValueError: naming ``key``, a step that rounds to MAX_ITER or later (Detectron2's
            LR scheduler refuses it).
    """
    max_iter = epochs_to_iters(epochs, num_images, ims_per_batch)
    steps = tuple(epochs_to_iters(e, num_images, ims_per_batch) for e in steps_epochs)
    late = [(e, it) for e, it in zip(steps_epochs, steps) if it >= max_iter]
    if late:
        raise config_error(
            key,
            f"epochs whose iteration is below MAX_ITER={max_iter} ({epochs} epochs x "
            f"{num_images} images / batch {ims_per_batch}); these round to iterations {late}",
            tuple(steps_epochs),
        )
    warmup = epochs_to_iters(warmup_epochs, num_images, ims_per_batch) if warmup_epochs > 0 else None
    return max_iter, steps, warmup


def warmup_multistep_multiplier(
    *, max_iter: int, steps, gamma: float, warmup_factor: float, warmup_iters: int,
    warmup_method: str = "linear", rescale_interval: bool = False,
):
    """The LR multiplier of Detectron2's ``WarmupMultiStepLR`` (``build_lr_scheduler``) from
    plain arguments: ``gamma ** k`` after the ``k``-th of ``steps``, warmed up over the first
    ``warmup_iters`` of ``max_iter`` iterations. What a LazyConfig's ``lr_multiplier`` builds
    (``configs/common/schedule.py``); Detectron2's ``hooks.LRScheduler`` applies it."""
    from detectron2.solver import WarmupParamScheduler
    from fvcore.common.param_scheduler import MultiStepParamScheduler

    steps = [s for s in steps if s <= max_iter]
    return WarmupParamScheduler(
        MultiStepParamScheduler(
            values=[gamma**k for k in range(len(steps) + 1)], milestones=steps, num_updates=max_iter
        ),
        warmup_factor,
        min(warmup_iters / max_iter, 1.0),
        warmup_method,
        rescale_interval,
    )


def apply_epoch_schedule(cfg, num_images: int = None):
    """Fill MAX_ITER/STEPS/WARMUP_ITERS from the epoch keys (no-op if ``SOLVER.EPOCHS == 0``).

    Returns:
        the config (modified in place; it must not be frozen).
    """
    s = cfg.SOLVER
    if s.EPOCHS <= 0:
        return cfg
    if num_images is None:
        num_images = count_training_images(cfg)
    batch = s.IMS_PER_BATCH
    s.MAX_ITER, s.STEPS, warmup = epoch_schedule(
        s.EPOCHS, s.STEPS_EPOCHS, num_images, batch, s.WARMUP_EPOCHS
    )
    if warmup is not None:
        s.WARMUP_ITERS = warmup
    logger.info(
        f"Epoch schedule: {s.EPOCHS} epochs x {num_images} images / batch {batch} -> "
        f"MAX_ITER={s.MAX_ITER}, STEPS={s.STEPS} (epochs {tuple(s.STEPS_EPOCHS)}), "
        f"WARMUP_ITERS={s.WARMUP_ITERS}"
    )
    return cfg
