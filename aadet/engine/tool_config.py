"""One config loader for the tools, YAML or LazyConfig, and what inference reads of either.

* :func:`load_any_config`: a ``.yaml`` file through :func:`~aadet.engine.defaults.load_config`
  (overrides ``KEY VALUE ...``), a ``.py`` LazyConfig through
  :func:`~aadet.engine.lazy.load_lazy_config` (overrides ``key=value ...``).
* :func:`inference_settings`: the facts the predictor, the export and the visualization tools use
  (input format, test-time resize, device, weights, EMA, datasets, inference thresholds, attention
  routes), read from either kind of config: for a LazyConfig from ``model``, ``train`` and
  ``dataloader``, as ``tools/lazyconfig_train_net.py`` uses them.
* :func:`build_inference_model` and :func:`build_train_mapper`: the model and the training mapper
  (augmentations) of either.
"""
from dataclasses import dataclass
from typing import Dict, Tuple

from detectron2.config import CfgNode
from detectron2.data import DatasetMapper
from detectron2.modeling import build_model

from ..config import config_keys
from ..layers import SpatiallyAwareAttentionStem
from ..data.augmentation import build_augmentation
from ..modeling.backbone import build_aa_resnet_backbone, build_ccnet_resnet_backbone, build_halo_resnet_backbone
from ..modeling.box_voting import bbox_vote_thresh
from .defaults import load_config
from .lazy import plain_containers, call_target, build, eval_dataset_names, load_lazy_config

__all__ = [
    "is_lazy_config",
    "load_any_config",
    "InferenceSettings",
    "inference_settings",
    "build_inference_model",
    "build_train_mapper",
]


def is_lazy_config(cfg_or_path) -> bool:
    """A LazyConfig file name (``.py``) or a loaded LazyConfig (not a YACS ``CfgNode``)."""
    if isinstance(cfg_or_path, str):
        return cfg_or_path.endswith(".py")
    return not isinstance(cfg_or_path, CfgNode)


def load_any_config(config_file: str, opts=()):
    """The config of ``config_file``: YAML with ``KEY VALUE`` overrides, or a LazyConfig ``.py``
    with ``key=value`` overrides (each with its own nearest-key errors)."""
    if is_lazy_config(config_file):
        return load_lazy_config(config_file, [str(o) for o in opts])
    return load_config(config_file, opts)


@dataclass(frozen=True)
class InferenceSettings:
    """What inference needs of a config, whichever kind it is."""

    input_format: str
    min_size_test: int
    max_size_test: int
    device: str
    weights: str
    ema_weights: bool
    train_datasets: Tuple[str, ...]
    test_datasets: Tuple[str, ...]
    num_classes: int
    score_thresh_test: float
    nms_thresh_test: float
    detections_per_image: int
    bbox_vote_thresh: float
    #: ``{config key: (kind, route)}`` of every attention route, kind "aa" (logit tables),
    #: "sasa" (local attention), "halo", "ccnet" (criss-cross) or "stem" (SASA's attention stem): what
    #: the export checks.
    attention_routes: Dict[str, Tuple[str, str]]


def inference_settings(cfg) -> InferenceSettings:
    """:class:`InferenceSettings` of a YACS config or a LazyConfig (returned as is if given one)."""
    if isinstance(cfg, InferenceSettings):
        return cfg
    if not is_lazy_config(cfg):
        return InferenceSettings(
            input_format=cfg.INPUT.FORMAT,
            min_size_test=cfg.INPUT.MIN_SIZE_TEST,
            max_size_test=cfg.INPUT.MAX_SIZE_TEST,
            device=cfg.MODEL.DEVICE,
            weights=cfg.MODEL.WEIGHTS,
            ema_weights=cfg.MODEL_EMA.ENABLED,
            train_datasets=tuple(cfg.DATASETS.TRAIN),
            test_datasets=tuple(cfg.DATASETS.TEST),
            num_classes=cfg.MODEL.RETINANET.NUM_CLASSES,
            score_thresh_test=cfg.MODEL.RETINANET.SCORE_THRESH_TEST,
            nms_thresh_test=cfg.MODEL.RETINANET.NMS_THRESH_TEST,
            detections_per_image=cfg.TEST.DETECTIONS_PER_IMAGE,
            bbox_vote_thresh=bbox_vote_thresh(cfg),
            attention_routes={
                "MODEL.AA.IMPL": ("aa", cfg.MODEL.AA.IMPL),
                "MODEL.SASA.IMPL": ("sasa", cfg.MODEL.SASA.IMPL),
                "MODEL.SASA.STEM_IMPL": ("stem", cfg.MODEL.SASA.STEM_IMPL),
                "MODEL.HALO.IMPL": ("halo", cfg.MODEL.HALO.IMPL),
                "MODEL.CCNET.IMPL": ("ccnet", cfg.MODEL.CCNET.IMPL),
            },
        )
    m, t = cfg.model, cfg.train
    resize = cfg.dataloader.test.mapper.augmentations[0]  # ResizeShortestEdge, as the recipe's
    short = resize.short_edge_length
    names = cfg.dataloader.train.dataset.names
    return InferenceSettings(
        input_format=m.input_format,
        min_size_test=int(short if isinstance(short, int) else min(short)),
        max_size_test=int(resize.max_size),
        device=t.device,
        weights=t.init_checkpoint,
        ema_weights=bool(t.get("model_ema", {}).get("enabled", False)),
        train_datasets=(names,) if isinstance(names, str) else tuple(names),
        test_datasets=tuple(eval_dataset_names(cfg)),
        num_classes=m.num_classes,
        score_thresh_test=m.test_score_thresh,
        nms_thresh_test=m.test_nms_thresh,
        detections_per_image=m.max_detections_per_image,
        bbox_vote_thresh=float(m.get("bbox_vote_thresh", 0.0)),
        attention_routes=_lazy_attention_routes(cfg),
    )


#: The backbone builders (and the attention stem) whose ``impl`` options name routes other than
#: local attention's.
_ROUTE_KINDS = {
    build_aa_resnet_backbone: "aa", build_halo_resnet_backbone: "halo", build_ccnet_resnet_backbone: "ccnet",
    SpatiallyAwareAttentionStem: "stem",
}


def _lazy_attention_routes(cfg) -> Dict[str, Tuple[str, str]]:
    """Every ``impl`` of the model's attention options: the AA-ResNet's are logit-table routes,
    the HaloNet-ResNet's halo-attention routes, CCNet's ResNet's criss-cross routes, the attention
    stem's its own (``STEM_IMPLS``), the
    others (SASA-ResNet, attentional FPN and head) local-attention routes."""
    tree = plain_containers(cfg.model)
    routes = {}
    for key in config_keys(tree, "model."):
        if not key.endswith(".impl"):
            continue
        value = cfg
        for name in key.split("."):
            value = value[name]  # resolves interpolations
        nested = key.endswith((".attention.impl", ".criss_cross.impl"))  # an options dict of the builder
        owner = key.rsplit(".", 2)[0] if nested else key.rsplit(".", 1)[0]
        node = tree
        for name in owner.split(".")[1:]:
            node = node[name]
        kind = _ROUTE_KINDS.get(call_target(node), "sasa")
        routes[key] = (kind, value)
    return routes


def build_inference_model(cfg):
    """The model of either kind of config, on its device (weights not loaded)."""
    if is_lazy_config(cfg):
        return build(cfg.model, "model").to(cfg.train.device)
    return build_model(cfg)


def build_train_mapper(cfg):
    """The training ``DatasetMapper`` (the recipe's augmentations) of either kind of config."""
    if is_lazy_config(cfg):
        return build(cfg.dataloader.train.mapper, "dataloader.train.mapper")
    return DatasetMapper(cfg, is_train=True, augmentations=build_augmentation(cfg, True))
