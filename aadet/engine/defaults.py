"""Building an aadet config the same way in every tool."""
import logging

import torch
from detectron2.config import get_cfg

from ..config import add_aadet_config, validate_aadet_config
from ..data.datasets import register_coco_from_config

__all__ = ["get_aadet_cfg", "load_config"]

logger = logging.getLogger(__name__)


def get_aadet_cfg():
    """Detectron2's defaults plus aadet's keys (unfrozen)."""
    cfg = get_cfg()
    add_aadet_config(cfg)
    return cfg


def load_config(config_file: str = "", opts=(), *, freeze: bool = True):
    """``get_aadet_cfg()`` + a YAML file + ``KEY VALUE`` overrides, validated.

    ``MODEL.DEVICE`` "cuda" on a machine without CUDA falls back to "cpu" with a warning, so the
    same YAML serves GPU clusters and a laptop. The datasets of ``DATASETS.REGISTER_COCO`` are
    registered here, so every tool can use a dataset named only in the config.
    """
    import os

    cfg = get_aadet_cfg()
    if config_file:
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"config file not found: {config_file}")
        cfg.merge_from_file(config_file)
    cfg.merge_from_list(list(opts))
    if cfg.MODEL.DEVICE.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("MODEL.DEVICE=%s but CUDA is not available: using cpu", cfg.MODEL.DEVICE)
        cfg.MODEL.DEVICE = "cpu"
    validate_aadet_config(cfg)
    register_coco_from_config(cfg)  # DATASETS.REGISTER_COCO, before anything reads DATASETS.*
    if freeze:
        cfg.freeze()
    return cfg
