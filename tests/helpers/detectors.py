"""Detectors with random weights whose scores spread (the export and demo-tool tests)."""
import math

import torch
from detectron2.modeling import build_model

from aadet.engine import load_config


def random_detector(config_file, opts=(), seed=0):
    """``(cfg, model)``: random weights in eval mode, ``cls_score`` scaled (N(0, 0.1) weights,
    prior 0.05 bias) so that scores of random images spread instead of all sitting at 0.01."""
    cfg = load_config(config_file, list(opts))
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    torch.nn.init.normal_(model.head.cls_score.weight, std=0.1)
    torch.nn.init.constant_(model.head.cls_score.bias, -math.log(19.0))
    return cfg, model
