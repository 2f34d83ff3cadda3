"""Every config key aadet adds to Detectron2, with its meaning and the papers' default.

Call :func:`add_aadet_config` on a Detectron2 ``CfgNode`` before merging one of our YAML files,
then :func:`validate_aadet_config` once the config is final (``tools/train_net.py`` does both).

Papers:
  AA   -- Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019.
  SASA -- Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019.
"""
import difflib
import inspect
from typing import Any, Dict, List, Optional

from detectron2.config import CfgNode as CN
from detectron2.utils.registry import Registry

from .layers import (
    AA_POSITIONAL_ENCODINGS,
    LOCAL_ATTENTION_BACKENDS,
    LOGIT_TABLE_BACKENDS,
    SASA_POSITIONAL_ENCODINGS,
    AugmentedConv2d,
    LocalSelfAttention2d,
    SpatiallyAwareAttentionStem,
    check_kernel_size,
)
from .layers.augmented_conv import KAPPA_RANGE, NU_RANGE
from .layers.functional.checks import check_in
from .utils.d2compat import NamedRegistry

__all__ = [
    "add_aadet_config",
    "validate_aadet_config",
    "ConfigValueError",
    "UnknownConfigKeyError",
    "config_keys",
    "similar_config_keys",
    "config_error",
    "layer_defaults",
    "check_one_of",
    "check_subset",
    "check_aa_config",
    "check_sasa_config",
    "STAGE_NAMES",
    "NORMS",
    "P6P7_SOURCES",
    "SASA_STEMS",
    "OPTIMIZER_NAMES",
    "COMPILE_MODES",
    "compile_backends",
    "check_compile_config",
    "VOTE_THRESH_ALLOWED",
    "is_valid_vote_thresh",
    "FPN_SPATIAL_LAYER_REGISTRY",
    "RETINANET_HEAD_REGISTRY",
]

# The allowed values of aadet's keys that no layer owns (the layers' own lists and ranges --
# positional encodings, kappa's and nu's ranges, the implementation routes -- are imported above:
# one definition each).
STAGE_NAMES = ("res2", "res3", "res4", "res5")  # ResNet stages a key may name
# Norm names understood by detectron2.layers.get_norm (plus "" for none).
NORMS = ("", "BN", "SyncBN", "FrozenBN", "GN", "nnSyncBN", "naiveSyncBN", "naiveSyncBN_N", "LN")
P6P7_SOURCES = ("res5", "p5")  # MODEL.FPN.P6P7_SOURCE
SASA_STEMS = ("conv", "attention")  # MODEL.SASA.STEM
#: SOLVER.OPTIMIZER; aadet.engine.optimizer.OPTIMIZERS builds each
#: (tests/engine/test_optimizer.py checks that it has exactly these).
OPTIMIZER_NAMES = ("SGD", "AdamW")
#: MODEL.COMPILE.MODE: torch.compile's modes ("default" = torch's mode=None; the others are
#: Inductor's, tests/engine/test_compile.py checks that torch knows them). MODEL.COMPILE.BACKEND
#: accepts :func:`compile_backends`.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: The allowed IoU thresholds of a box vote (TEST.BBOX_VOTE.VOTE_TH, aadet.modeling.box_voting),
#: in words (error messages).
VOTE_THRESH_ALLOWED = "in (0, 1]"


def layer_defaults(layer) -> Dict[str, Any]:
    """``{argument: default}`` of ``layer``'s signature: where the keys of its arguments take
    their defaults (so each default is written once, in the layer)."""
    return {
        name: p.default
        for name, p in inspect.signature(layer).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def compile_backends() -> List[str]:
    """The allowed values of MODEL.COMPILE.BACKEND: the backends torch.compile knows
    (``torch._dynamo.list_backends(exclude_tags=())``: ``inductor``, and the debugging ones such
    as ``eager`` and ``aot_eager``), but for those of PyTorch's own tests (``*_TESTING_ONLY``)."""
    import torch._dynamo

    return sorted(b for b in torch._dynamo.list_backends(exclude_tags=()) if not b.endswith("_TESTING_ONLY"))


def is_valid_vote_thresh(value) -> bool:
    """Whether ``value`` is an allowed vote IoU threshold (:data:`VOTE_THRESH_ALLOWED`)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value <= 1.0


# Keys whose value names an implementation: the config accepts exactly the names registered here.
# aadet.modeling registers the implementations (importing aadet does), and builds from these.
FPN_SPATIAL_LAYER_REGISTRY = NamedRegistry("FPN_SPATIAL_LAYER")  # MODEL.FPN.SPATIAL_LAYER
FPN_SPATIAL_LAYER_REGISTRY.__doc__ = """
Converters ``fn(fpn: FPN, cfg) -> FPN`` that replace the spatial layers of a built FPN (its 3x3
output convs and the P6/P7 convs), registered with ``register("<MODEL.FPN.SPATIAL_LAYER value>")``
(aadet/modeling/backbone/fpn.py, attention_fpn.py). ``validate_aadet_config`` accepts exactly the
registered names.
"""
RETINANET_HEAD_REGISTRY = Registry("RETINANET_HEAD")  # MODEL.RETINANET.HEAD_NAME
RETINANET_HEAD_REGISTRY.__doc__ = """
RetinaNet heads, called as ``cls(cfg, feature_shapes)`` (``@configurable`` classes), returning
per-level ``(logits, bbox_reg)`` lists like Detectron2's ``RetinaNetHead`` (registered in
aadet/modeling/meta_arch/retinanet.py, attention_head.py). ``validate_aadet_config`` accepts exactly
the registered names.
"""


class ConfigValueError(ValueError):
    """A config key holds a value outside its allowed range (the message names the key)."""


class UnknownConfigKeyError(KeyError):
    """A config key that does not exist, named with where it was set (``source``: a YAML file, or
    ``None`` for the command line) and the nearest existing keys. A ``KeyError``, as yacs' own
    error for it from a file is."""

    def __init__(self, key: str, source: Optional[str], suggestions=()):
        self.key, self.source, self.suggestions = key, source, tuple(suggestions)
        where = f"in config file {source}" if source else "on the command line"
        if self.suggestions:
            best, *others = self.suggestions
            hint = f"did you mean {best}?" + (f" (also close: {', '.join(others)})" if others else "")
        else:
            hint = "no existing key is close (aadet's keys: aadet/config.py, add_aadet_config)"
        super().__init__(f"Unknown config key {key} {where}; {hint}")

    def __str__(self):  # KeyError's own would quote the message
        return self.args[0]


def config_keys(cfg, prefix: str = "") -> List[str]:
    """Every dotted key of ``cfg``, its sections included (``"MODEL"``, ``"MODEL.SASA"``, ...)."""
    keys = []
    for name, value in cfg.items():
        keys.append(prefix + name)
        if isinstance(value, CN):
            keys += config_keys(value, f"{prefix}{name}.")
    return keys


def similar_config_keys(cfg, key: str, n: int = 3) -> List[str]:
    """Up to ``n`` existing keys of ``cfg`` nearest to ``key`` (``difflib``, case ignored), best
    first: the keys of ``key``'s own section nearest to its last name, then the nearest full keys
    (``key``'s own sections left out: ``SOLVER.LR`` is not a misspelt ``SOLVER``)."""
    wanted = key.upper()
    keys = {k.upper(): k for k in config_keys(cfg) if not wanted.startswith(k.upper() + ".")}
    parent, _, name = wanted.rpartition(".")
    section = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    found = [section[m] for m in difflib.get_close_matches(name, section, n)]
    found += difflib.get_close_matches(wanted, keys, n)
    return [keys[k] for k in dict.fromkeys(found)][:n]


def add_aadet_config(cfg):
    """Add aadet's keys (with the papers' defaults) to a Detectron2 config, in place.

    The keys of a layer's arguments take their defaults from the layer's signature."""
    _C = cfg
    aa_layer = layer_defaults(AugmentedConv2d)
    sasa_layer = layer_defaults(LocalSelfAttention2d)
    stem = layer_defaults(SpatiallyAwareAttentionStem)

    # ---------------------------------------------------------------- data recipe (both papers)
    # Training augmentation of the AA/SASA RetinaNet recipe (AA appendix A.1): resize so that the
    # longer side is uniform in LONG_SIDE_RANGE, crop to at most CROP_SIZE x CROP_SIZE (padding to
    # it), horizontal flip with FLIP_PROB. Implemented with Detectron2's ResizeScale,
    # FixedSizeCrop and RandomFlip. When disabled, Detectron2's INPUT.MIN_SIZE_TRAIN path is used.
    _C.INPUT.SCALE_JITTER = CN()
    _C.INPUT.SCALE_JITTER.ENABLED = True  # paper: on
    _C.INPUT.SCALE_JITTER.LONG_SIDE_RANGE = (512, 768)  # paper: [512, 768] pixels
    _C.INPUT.SCALE_JITTER.CROP_SIZE = 640  # paper: 640 (crop to at most 640x640, pad to it)
    _C.INPUT.SCALE_JITTER.FLIP_PROB = 0.5  # paper: 0.5. 1.0 mirrors every image (tree demo: its val
    # image faces the other way, README "What the demo measured")
    _C.INPUT.SCALE_JITTER.PAD_VALUE = 128.0  # value of padded pixels (0-255, before normalization)
    # Photometric jitter (Detectron2's RandomBrightness / RandomContrast: factors drawn uniformly
    # from the ranges). NOT part of the papers' recipe, so off by default; the tree-crown demo turns
    # it on, because it trains on one aerial image and validates on another with other lighting.
    _C.INPUT.PHOTOMETRIC = CN()
    _C.INPUT.PHOTOMETRIC.ENABLED = False
    _C.INPUT.PHOTOMETRIC.BRIGHTNESS = (0.75, 1.25)
    _C.INPUT.PHOTOMETRIC.CONTRAST = (0.75, 1.25)

    # ---------------------------------------------------------------- epoch-based schedule
    # When EPOCHS > 0, SOLVER.MAX_ITER and SOLVER.STEPS are computed at start from the number of
    # training images and SOLVER.IMS_PER_BATCH: MAX_ITER = ceil(EPOCHS * images / batch), and
    # STEPS from STEPS_EPOCHS likewise. EPOCHS = 0 keeps the iteration keys as given.
    _C.SOLVER.EPOCHS = 0  # papers: 150 epochs from scratch
    _C.SOLVER.STEPS_EPOCHS = ()  # LR decay points in epochs; RetinaNet recipe: 2/3, 8/9 -> (100, 133)
    _C.SOLVER.WARMUP_EPOCHS = 0.0  # if > 0, overrides SOLVER.WARMUP_ITERS

    # Optimizer (OPTIMIZER_NAMES, built by aadet.engine.optimizer): "SGD" (papers' recipe;
    # Detectron2's, with SOLVER.MOMENTUM / NESTEROV) or "AdamW" (SOLVER.ADAMW_BETAS; decoupled
    # SOLVER.WEIGHT_DECAY).
    # Both use Detectron2's parameter groups, LR schedule and gradient clipping.
    _C.SOLVER.OPTIMIZER = "SGD"
    _C.SOLVER.ADAMW_BETAS = (0.9, 0.999)  # AdamW's (beta1, beta2), each in [0, 1)

    # Keep the checkpoint with the best value of this metric (from the periodic evaluation);
    # "" disables it. Written as model_best.pth next to the periodic checkpoints.
    _C.SOLVER.BEST_CHECKPOINT_METRIC = "bbox/AP"
    # Iterations between metric writes (console, metrics.json, TensorBoard), and the smoothing
    # window of metrics.json. Detectron2 hard-codes 20; 1 records every iteration's raw losses.
    _C.SOLVER.LOG_PERIOD = 20
    # Iterations between attention statistics in the training metrics (aadet.engine.hooks.
    # AttentionStatsHook): per attention layer, attn/<layer>/perplexity (effective number of keys
    # attended, on the first image of that iteration's batch) and keys (number available), and
    # attn/<layer>/{rel,rel_h,rel_w,query,value}_grad_ratio (||grad|| / ||weight||). Also at the
    # last iteration. 0 = off (default; not part of the papers' recipe).
    _C.TEST.ATTENTION_STATS_PERIOD = 0
    # Exponential moving average of the weights (aadet.engine.ema.ModelEMA), used for every
    # evaluation when ENABLED: the periodic and final ones in training, --eval-only, the predictor
    # and the tools built on it (demo, visualization, export) -- they load checkpoint["model_ema"].
    # Training is unchanged. Not in the papers, so off by default (on the conv tree-crown demo it
    # gave +0.3 AP50: its LR decay already settles the weights; README "What the demo measured").
    # The decay of update t is min(DECAY, (1 + t) / (10 + t)) (TensorFlow's num_updates warm-up):
    # in runs shorter than ~(10 DECAY - 1) / (1 - DECAY) updates (4490 for 0.998) the warm-up term
    # sets it, averaging roughly the last tenth of training.
    # Box voting at inference (aadet.modeling.box_voting; Detectron's TEST.BBOX_VOTE, scoring "ID"):
    # each box NMS keeps becomes the score-weighted mean of the pre-NMS boxes of its class with IoU
    # >= VOTE_TH with it (itself included); scores unchanged. Applies wherever the model infers
    # (evaluation, TTA's merge, the predictor, exports). Not in the papers, so off by default.
    _C.TEST.BBOX_VOTE = CN()
    _C.TEST.BBOX_VOTE.ENABLED = False
    _C.TEST.BBOX_VOTE.VOTE_TH = 0.8  # in (0, 1]; Detectron's default
    _C.MODEL_EMA = CN()
    _C.MODEL_EMA.ENABLED = False
    _C.MODEL_EMA.DECAY = 0.998  # in [0, 1); the average spans ~1 / (1 - DECAY) iterations

    # ---------------------------------------------------------------- ResNet
    # Zero-initialise the scale of the last norm in every residual block (conv, AA and SASA
    # ResNets built by aadet), so each block starts as the identity (Goyal et al. 2017; the TF-TPU
    # ResNet of the papers' codebase does it, Detectron2 does not: its ResNet notes that it hurt GN
    # models trained from scratch). Needs a norm with a learned scale. False = Detectron2's init.
    _C.MODEL.RESNETS.ZERO_INIT_RESIDUAL = False

    # ---------------------------------------------------------------- RetinaNet / FPN
    # Where FPN's P6/P7 come from: "res5" (Detectron2's RetinaNet) or "p5" (the RetinaNet of the
    # AA paper's codebase, TF-TPU RetinaNet).
    _C.MODEL.FPN.P6P7_SOURCE = "p5"
    # Which layer makes FPN's output (3x3 after the merge) and P6/P7 (stride-2 3x3): a name in
    # FPN_SPATIAL_LAYER_REGISTRY (above; filled by aadet/modeling/backbone/): "conv" (Detectron2's
    # FPN) or "attention" (SASA's attentional FPN, uses MODEL.SASA.* for the attention layers).
    _C.MODEL.FPN.SPATIAL_LAYER = "conv"
    # With SPATIAL_LAYER "attention": also make P6/P7's stride-2 3x3 convs local attention. Off by
    # default: with it the all-attention RetinaNet has 1.2M fewer params than SASA's Table 2
    # (22.0M); without it we are within 0.35M (see aadet/modeling/backbone/attention_fpn.py).
    _C.MODEL.FPN.ATTENTION_TOP_BLOCK = False
    # The RetinaNet head, from aadet's RETINANET_HEAD_REGISTRY: "RetinaNetHead" (Detectron2's) or
    # "AttentionRetinaNetHead" (SASA: the towers' 3x3 convs are local attention).
    _C.MODEL.RETINANET.HEAD_NAME = "RetinaNetHead"

    # ---------------------------------------------------------------- Attention Augmentation (AA)
    _C.MODEL.AA = CN()
    # Stages whose 3x3 convolutions are augmented (paper: res3, res4, res5 = 28/14/7 on ImageNet).
    _C.MODEL.AA.STAGES = ("res3", "res4", "res5")
    # kappa = dk / Fout and nu = dv / Fout (paper: kappa = 2 nu = 0.2; ResNet-34 uses 0.25/0.25).
    # dk and dv are rounded to the nearest multiple of NUM_HEADS (at least NUM_HEADS).
    _C.MODEL.AA.KAPPA = aa_layer["kappa"]
    _C.MODEL.AA.NU = aa_layer["nu"]
    _C.MODEL.AA.NUM_HEADS = aa_layer["num_heads"]  # paper: 8
    # A name in aadet.layers.AA_POSITIONAL_ENCODINGS: "relative" (paper), or the ablations of its
    # Tables 6-7.
    _C.MODEL.AA.POSITIONAL_ENCODING = aa_layer["positional_encoding"]
    # Stages where attention runs on a 3x3/2 average-pooled input, bilinearly upsampled back
    # (paper: only the first augmented stage). () = full resolution everywhere.
    _C.MODEL.AA.DOWNSAMPLE_STAGES = ("res3",)
    # Largest input side (pixels, after padding) the relative tables must cover: each layer holds
    # tables of 2 * ceil(MAX_INPUT_SIZE / stride) - 1 rows. A larger feature map is an error
    # unless CLIP_DISTANCES, which clips relative distances to the table (as in Shaw et al.).
    _C.MODEL.AA.MAX_INPUT_SIZE = 1024
    _C.MODEL.AA.CLIP_DISTANCES = aa_layer["clip_distances"]
    # Minimum key depth per head: dk = max(rounded kappa * Fout, MIN_DK_PER_HEAD * NUM_HEADS).
    # The paper states 20 for its CIFAR models, and its ImageNet parameter counts (Table 2, and
    # Table 9's per-layer numbers) only come out with 20; its COCO RetinaNet counts (Table 4:
    # 33.4M -> 33.1M, i.e. fewer params) come out without it. Detection configs use 1.
    _C.MODEL.AA.MIN_DK_PER_HEAD = aa_layer["min_dk_per_head"]
    # How the global attention is computed: "auto" (aadet.layers.functional.logit_tables.
    # auto_logit_table_impl) or a route of LOGIT_TABLE_BACKENDS there (all exact, only speed and
    # memory differ; each route with its summary). Paper: its TF code materializes the logits.
    _C.MODEL.AA.IMPL = aa_layer["impl"]

    # ---------------------------------------------------------------- Stand-Alone Self-Attention
    _C.MODEL.SASA = CN()
    _C.MODEL.SASA.KERNEL_SIZE = sasa_layer["kernel_size"]  # spatial extent k, odd (paper: 7)
    _C.MODEL.SASA.NUM_HEADS = sasa_layer["num_heads"]  # paper: 8
    # A name in aadet.layers.SASA_POSITIONAL_ENCODINGS: "relative" (paper), "sine2d" (the 2D sine
    # encoding, as MODEL.AA's), "none": paper Table 5.
    _C.MODEL.SASA.POSITIONAL_ENCODING = sasa_layer["positional_encoding"]
    # Stages whose spatial (3x3) convolution is replaced by local attention. Paper Table 1/2:
    # all four; Table 3 explores e.g. ("res4", "res5").
    _C.MODEL.SASA.STAGES = ("res2", "res3", "res4", "res5")
    # Stem: "conv" (ResNet 7x7/2 + maxpool) or "attention" (spatially-aware attention stem).
    _C.MODEL.SASA.STEM = "conv"
    # Attention stem (paper Section 3.2; its appendix with the exact values is not public):
    _C.MODEL.SASA.STEM_MIXTURES = stem["num_mixtures"]  # m value matrices mixed per position (paper: 4)
    _C.MODEL.SASA.STEM_NUM_HEADS = stem["num_heads"]  # heads of the stem attention
    _C.MODEL.SASA.STEM_BLOCK_SIZE = stem["block_size"]  # attention in b x b blocks, b x b max pooling (paper: 4)
    # How local attention is computed: "auto" (aadet.layers.functional.local_attention.
    # auto_local_attention_impl) or a route of LOCAL_ATTENTION_BACKENDS there (all exact, only
    # speed and memory differ; each route with its summary).
    _C.MODEL.SASA.IMPL = sasa_layer["impl"]
    # Query tile side of the blocked (halo) routes; only speed/memory depend on it.
    _C.MODEL.SASA.BLOCK_SIZE = sasa_layer["block_size"]

    # ---------------------------------------------------------------- compiled models
    # Run the model through torch.compile in tools/train_net.py's training and evaluation
    # (--compile sets ENABLED; aadet.engine.compile.maybe_compile): nn.Module.compile in place,
    # so checkpoints keep their keys and load into uncompiled models. Not in the papers, and the
    # first iterations (and the first evaluation) pay the compile time, so off by default. A
    # backend that cannot run here (Inductor without a C++ compiler on CPU, or without Triton on
    # CUDA) stops the build with an error naming ENABLED. The predictor, demo, visualization and
    # export tools run uncompiled.
    _C.MODEL.COMPILE = CN()
    _C.MODEL.COMPILE.ENABLED = False
    _C.MODEL.COMPILE.BACKEND = "inductor"  # torch.compile's backend (config.compile_backends())
    # torch.compile's mode (COMPILE_MODES): "default", "reduce-overhead" (CUDA graphs),
    # "max-autotune", "max-autotune-no-cudagraphs"; Inductor's, other backends ignore it.
    _C.MODEL.COMPILE.MODE = "default"
    # torch.compile's dynamic: compile shape-generic graphs from the start. Detection shapes
    # change every iteration (the number of boxes per image; the image size in evaluation and
    # without SCALE_JITTER), and a graph per shape would recompile most iterations. False: static
    # graphs, one per shape, up to torch._dynamo.config.recompile_limit per frame (then eager).
    _C.MODEL.COMPILE.DYNAMIC = True

    # ---------------------------------------------------------------- your own data
    # COCO-format detection datasets to register by name before DATASETS.TRAIN / DATASETS.TEST are
    # read, so a config alone trains on your data: a list of [name, json_file, image_root]
    # triples (paths absolute or relative to the working directory), e.g.
    #   REGISTER_COCO: [["cells_train", "cells/train.json", "cells/images"],
    #                   ["cells_val", "cells/val.json", "cells/images"]]
    # or on the command line: DATASETS.REGISTER_COCO "[['cells_train', 'a.json', 'img']]".
    # Checked and registered by aadet.data.datasets.register_coco_from_config (called by
    # aadet.engine.load_config): a missing file, a name registered with other paths or an entry
    # that is not a triple of strings stops with an error naming the entry. () = none.
    _C.DATASETS.REGISTER_COCO = ()
    return cfg


def config_error(key: str, allowed: str, given) -> ConfigValueError:
    """The one error of a bad config value: names ``key``, the allowed range and the value."""
    return ConfigValueError(f"Config key {key} must be {allowed}; got {given!r}.")


def check_one_of(key: str, value, allowed, note: str = ""):
    """Raise :class:`ConfigValueError` unless ``value in allowed``."""
    if value not in allowed:
        raise config_error(key, f"one of {tuple(allowed)}{note}", value)


def check_subset(key: str, values, allowed):
    """Raise :class:`ConfigValueError` unless every element of ``values`` is in ``allowed``."""
    if any(v not in allowed for v in values):
        raise config_error(key, f"a subset of {tuple(allowed)}", tuple(values))


def _check_min(key: str, value, minimum):
    if value < minimum:
        raise config_error(key, f">= {minimum}", value)


def _check_range_pair(key: str, value):
    lo_hi = tuple(value)
    if len(lo_hi) != 2 or not (0 < lo_hi[0] <= lo_hi[1]):
        raise config_error(key, "(min, max) with 0 < min <= max", lo_hi)


def check_aa_config(cfg):
    """Check the ``MODEL.AA.*`` keys (called by :func:`validate_aadet_config` and by the AA-ResNet
    builder, so a backbone built without validation fails the same way)."""
    aa = cfg.MODEL.AA
    check_subset("MODEL.AA.STAGES", aa.STAGES, STAGE_NAMES)
    check_subset("MODEL.AA.DOWNSAMPLE_STAGES", aa.DOWNSAMPLE_STAGES, STAGE_NAMES)
    check_in(aa.KAPPA, KAPPA_RANGE, "MODEL.AA.KAPPA", config_error)
    check_in(aa.NU, NU_RANGE, "MODEL.AA.NU", config_error, " (dv < Fout: some conv channels remain)")
    _check_min("MODEL.AA.NUM_HEADS", aa.NUM_HEADS, 1)
    check_one_of("MODEL.AA.POSITIONAL_ENCODING", aa.POSITIONAL_ENCODING, AA_POSITIONAL_ENCODINGS)
    if aa.MAX_INPUT_SIZE <= 0:
        raise config_error("MODEL.AA.MAX_INPUT_SIZE", "> 0", aa.MAX_INPUT_SIZE)
    _check_min("MODEL.AA.MIN_DK_PER_HEAD", aa.MIN_DK_PER_HEAD, 1)
    LOGIT_TABLE_BACKENDS.check(aa.IMPL, "MODEL.AA.IMPL", config_error)


def check_sasa_config(cfg):
    """Check the ``MODEL.SASA.*`` keys (called by :func:`validate_aadet_config`, the SASA-ResNet
    builder and :func:`aadet.modeling.attention_layers.sasa_layer_kwargs`)."""
    sa = cfg.MODEL.SASA
    check_subset("MODEL.SASA.STAGES", sa.STAGES, STAGE_NAMES)
    check_kernel_size(sa.KERNEL_SIZE, name="MODEL.SASA.KERNEL_SIZE", error=config_error)
    _check_min("MODEL.SASA.NUM_HEADS", sa.NUM_HEADS, 1)
    check_one_of("MODEL.SASA.POSITIONAL_ENCODING", sa.POSITIONAL_ENCODING, SASA_POSITIONAL_ENCODINGS)
    check_one_of("MODEL.SASA.STEM", sa.STEM, SASA_STEMS)
    _check_min("MODEL.SASA.STEM_MIXTURES", sa.STEM_MIXTURES, 1)
    _check_min("MODEL.SASA.STEM_NUM_HEADS", sa.STEM_NUM_HEADS, 1)
    _check_min("MODEL.SASA.STEM_BLOCK_SIZE", sa.STEM_BLOCK_SIZE, 1)
    _check_min("MODEL.SASA.BLOCK_SIZE", sa.BLOCK_SIZE, 1)
    LOCAL_ATTENTION_BACKENDS.check(sa.IMPL, "MODEL.SASA.IMPL", config_error)


def check_compile_config(cfg):
    """Check the ``MODEL.COMPILE.*`` keys (called by :func:`validate_aadet_config`), whether or
    not compiling is enabled. Whether the backend can run on this machine is checked when the
    model is compiled (:func:`aadet.engine.compile.maybe_compile`)."""
    c = cfg.MODEL.COMPILE
    check_one_of(
        "MODEL.COMPILE.BACKEND", c.BACKEND, compile_backends(),
        " (torch.compile's backends: aadet.config.compile_backends())",
    )
    check_one_of("MODEL.COMPILE.MODE", c.MODE, COMPILE_MODES)


def _check_fpn_and_head(cfg):
    # The registries are filled when aadet.modeling is imported (aadet/__init__.py does).
    check_one_of("MODEL.FPN.P6P7_SOURCE", cfg.MODEL.FPN.P6P7_SOURCE, P6P7_SOURCES)
    check_one_of(
        "MODEL.FPN.SPATIAL_LAYER",
        cfg.MODEL.FPN.SPATIAL_LAYER,
        sorted(name for name, _ in FPN_SPATIAL_LAYER_REGISTRY),
        " (names in FPN_SPATIAL_LAYER_REGISTRY)",
    )
    check_one_of(
        "MODEL.RETINANET.HEAD_NAME",
        cfg.MODEL.RETINANET.HEAD_NAME,
        sorted(name for name, _ in RETINANET_HEAD_REGISTRY),
        " (names in RETINANET_HEAD_REGISTRY)",
    )


def validate_aadet_config(cfg):
    """Check every aadet key (and the Detectron2 keys our recipe relies on): the one place where
    allowed ranges are checked; backbones call its ``check_*`` helpers for their keys.

    Raises:
        ConfigValueError: naming the key, the allowed range and the given value.
    """
    for key in ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.RETINANET.NORM"):
        node = cfg
        for name in key.split("."):
            node = node.get(name) if hasattr(node, "get") else None
        if node is not None:
            check_one_of(key, node, NORMS)

    sj = cfg.INPUT.SCALE_JITTER
    _check_range_pair("INPUT.SCALE_JITTER.LONG_SIDE_RANGE", sj.LONG_SIDE_RANGE)
    if int(sj.CROP_SIZE) <= 0:
        raise config_error("INPUT.SCALE_JITTER.CROP_SIZE", "> 0", sj.CROP_SIZE)
    if not 0.0 <= float(sj.FLIP_PROB) <= 1.0:
        raise config_error("INPUT.SCALE_JITTER.FLIP_PROB", "in [0, 1]", sj.FLIP_PROB)
    for key in ("BRIGHTNESS", "CONTRAST"):
        _check_range_pair(f"INPUT.PHOTOMETRIC.{key}", cfg.INPUT.PHOTOMETRIC[key])

    s = cfg.SOLVER
    if s.EPOCHS < 0:
        raise config_error("SOLVER.EPOCHS", ">= 0 (0 = use SOLVER.MAX_ITER)", s.EPOCHS)
    if s.EPOCHS == 0 and len(s.STEPS_EPOCHS):
        raise config_error("SOLVER.STEPS_EPOCHS", "empty unless SOLVER.EPOCHS > 0", tuple(s.STEPS_EPOCHS))
    if s.EPOCHS > 0 and any(not (0 < e <= s.EPOCHS) for e in s.STEPS_EPOCHS):
        raise config_error(
            "SOLVER.STEPS_EPOCHS", f"values in (0, SOLVER.EPOCHS={s.EPOCHS}]", tuple(s.STEPS_EPOCHS)
        )
    _check_min("SOLVER.LOG_PERIOD", s.LOG_PERIOD, 1)
    check_one_of("SOLVER.OPTIMIZER", s.OPTIMIZER, OPTIMIZER_NAMES)
    if len(s.ADAMW_BETAS) != 2 or not all(0.0 <= float(b) < 1.0 for b in s.ADAMW_BETAS):
        raise config_error("SOLVER.ADAMW_BETAS", "two values in [0, 1)", tuple(s.ADAMW_BETAS))
    _check_min("TEST.ATTENTION_STATS_PERIOD", cfg.TEST.ATTENTION_STATS_PERIOD, 0)
    if not 0.0 <= float(cfg.MODEL_EMA.DECAY) < 1.0:
        raise config_error("MODEL_EMA.DECAY", "in [0, 1)", cfg.MODEL_EMA.DECAY)
    if not is_valid_vote_thresh(cfg.TEST.BBOX_VOTE.VOTE_TH):
        raise config_error("TEST.BBOX_VOTE.VOTE_TH", VOTE_THRESH_ALLOWED, cfg.TEST.BBOX_VOTE.VOTE_TH)
    aug = cfg.TEST.AUG  # Detectron2's keys; aadet.modeling.RetinaNetWithTTA reads them
    if aug.ENABLED:
        if not len(aug.MIN_SIZES) or any(int(m) <= 0 for m in aug.MIN_SIZES):
            raise config_error(
                "TEST.AUG.MIN_SIZES", "one or more sizes > 0 when TEST.AUG.ENABLED", tuple(aug.MIN_SIZES)
            )
        _check_min("TEST.AUG.MAX_SIZE", aug.MAX_SIZE, 1)
    _check_min("SOLVER.WARMUP_EPOCHS", s.WARMUP_EPOCHS, 0)
    if s.EPOCHS <= 0 and s.MAX_ITER <= 0:
        raise config_error("SOLVER.MAX_ITER", "> 0 when SOLVER.EPOCHS is 0", s.MAX_ITER)

    check_compile_config(cfg)
    _check_fpn_and_head(cfg)
    check_aa_config(cfg)
    check_sasa_config(cfg)
    return cfg
