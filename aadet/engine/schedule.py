"""Epoch-based schedules: the papers train "150 epochs"; Detectron2 counts iterations.

``SOLVER.EPOCHS``/``STEPS_EPOCHS``/``WARMUP_EPOCHS`` are converted to ``MAX_ITER``/``STEPS``/
``WARMUP_ITERS`` from the number of training images and ``SOLVER.IMS_PER_BATCH`` (the total batch
of ``SOLVER.REFERENCE_WORLD_SIZE`` workers). Conversion happens before Detectron2's
``auto_scale_workers`` so that a run on a different number of GPUs still covers the same epochs.
"""
import logging
import math

from ..config import config_error

__all__ = ["epochs_to_iters", "apply_epoch_schedule", "count_training_images"]

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
    s.MAX_ITER = epochs_to_iters(s.EPOCHS, num_images, batch)
    s.STEPS = tuple(epochs_to_iters(e, num_images, batch) for e in s.STEPS_EPOCHS)
    late = [(e, it) for e, it in zip(s.STEPS_EPOCHS, s.STEPS) if it >= s.MAX_ITER]
    if late:  # Detectron2's LR scheduler refuses a step at or after the last iteration
        raise config_error(
            "SOLVER.STEPS_EPOCHS",
            f"epochs whose iteration is below MAX_ITER={s.MAX_ITER} ({s.EPOCHS} epochs x "
            f"{num_images} images / batch {batch}); these round to iterations {late}",
            tuple(s.STEPS_EPOCHS),
        )
    if s.WARMUP_EPOCHS > 0:
        s.WARMUP_ITERS = epochs_to_iters(s.WARMUP_EPOCHS, num_images, batch)
    logger.info(
        f"Epoch schedule: {s.EPOCHS} epochs x {num_images} images / batch {batch} -> "
        f"MAX_ITER={s.MAX_ITER}, STEPS={s.STEPS} (epochs {tuple(s.STEPS_EPOCHS)}), "
        f"WARMUP_ITERS={s.WARMUP_ITERS}"
    )
    return cfg
