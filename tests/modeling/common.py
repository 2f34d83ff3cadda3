"""What the model tests share: the conv R-50 RetinaNet config they start from, the small ResNet-26
configs on it (fast on CPU), the parameter-count configs, a parameter counter, and the check that
a backbone's features have the conv ResNet's shapes."""
import os

import torch
from detectron2.config import get_cfg

from aadet.config import add_aadet_config

from tests.helpers import REPO

R50_CONFIG = os.path.join(REPO, "configs", "COCO-Detection", "retinanet_R_50_FPN_scratch_150ep.yaml")


def n_params(module):
    return sum(p.numel() for p in module.parameters())


def assert_same_output_shapes(net, reference, hw=(75, 61)):
    """``net`` and ``reference`` (e.g. Detectron2's conv ResNet of the same config) declare and
    give the same features, names and shapes, on an odd-sized input; returns ``net``'s."""
    assert net.output_shape() == reference.output_shape()
    x = torch.randn(1, 3, *hw)
    with torch.no_grad():
        out, ref = net.eval()(x), reference.eval()(x)
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in ref.items()}
    return out


def cpu_cfg(config_file: str = R50_CONFIG):
    """aadet's keys, then ``config_file`` (default: the conv R-50 RetinaNet), on CPU."""
    cfg = get_cfg()
    add_aadet_config(cfg)
    cfg.merge_from_file(config_file)
    cfg.MODEL.DEVICE = "cpu"
    return cfg


def counting_cfg(config_file: str = R50_CONFIG):
    """:func:`cpu_cfg` with every norm SyncBN (2 parameters a channel, as the papers' BN), for
    parameter counts against the papers' tables."""
    cfg = cpu_cfg(config_file)
    cfg.MODEL.RESNETS.NORM = cfg.MODEL.FPN.NORM = cfg.MODEL.RETINANET.NORM = "SyncBN"
    return cfg


def small_resnet26_cfg(backbone: str, stem_out_channels: int, **model_keys):
    """:func:`cpu_cfg` with ``backbone`` as ``MODEL.BACKBONE.NAME`` over a narrow ResNet-26 (BN,
    ``stem_out_channels``, 32 channels out of res2, 8 channels a group), then ``model_keys``:
    ``SECTION={KEY: value}`` set in ``MODEL.SECTION`` (e.g. ``HALO={"NUM_HEADS": 2}``)."""
    cfg = cpu_cfg()
    cfg.MODEL.BACKBONE.NAME = backbone
    cfg.MODEL.RESNETS.DEPTH = 26
    cfg.MODEL.RESNETS.NORM = "BN"
    cfg.MODEL.RESNETS.STEM_OUT_CHANNELS = stem_out_channels
    cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 32
    cfg.MODEL.RESNETS.WIDTH_PER_GROUP = 8
    for section, keys in model_keys.items():
        for key, value in keys.items():
            setattr(cfg.MODEL[section], key, value)
    return cfg
