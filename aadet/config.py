"""Every config key aadet adds to Detectron2, with its meaning and the papers' value.

Call :func:`add_aadet_config` on a Detectron2 ``CfgNode`` before merging one of our YAML files,
then :func:`validate_aadet_config` once the config is final (``aadet.engine.load_config`` does
both). Each concern has its own pair of functions below (``add_*_config`` / ``check_*_config``).

One home per fact:

* the keys of a layer's arguments (``MODEL.AA.KAPPA``, ``MODEL.SASA.KERNEL_SIZE``, ...) take
  their defaults from the layer's signature and are checked with the layer's own rules and
  ranges (:mod:`aadet.layers`; the implementation routes from its registries), here, naming the
  key;
* keys whose allowed values belong to a model builder -- stage names, the SASA stem, the FPN's
  P6/P7 source, the names in the FPN and head registries, the box-vote threshold -- or to the
  engine -- ``SOLVER.OPTIMIZER`` (its registry), ``MODEL_EMA.DECAY`` -- are checked by their
  owner when it maps the config to its arguments (a ``from_config`` or ``build_*`` function),
  naming the key: this module sits below ``aadet.modeling`` and ``aadet.engine`` and imports
  neither;
* the keys no module owns (the data recipe, the schedule, EMA, compile) are defined and checked
  here.

Papers:
  AA   -- Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019.
  SASA -- Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019.
  Halo -- Vaswani et al., "Scaling Local Self-Attention for Parameter Efficient Visual
          Backbones" (HaloNet), CVPR 2021.
  CCNet -- Huang et al., "CCNet: Criss-Cross Attention for Semantic Segmentation", ICCV 2019 /
          TPAMI 2020.
"""
import difflib
import inspect
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

from detectron2.config import CfgNode as CN

from .layers import (
    STEM_IMPLS,
    AugmentedConv2d,
    HaloSelfAttention2d,
    LocalSelfAttention2d,
    RecurrentCrissCrossAttention,
    SpatiallyAwareAttentionStem,
)
from .layers.augmented_conv import KAPPA_RANGE, NU_RANGE
from .layers.augmented_conv import POSITIONAL_ENCODINGS as AA_POSITIONAL_ENCODINGS
from .layers.functional.checks import (
    Interval,
    check_bool,
    check_in,
    check_int,
    check_halo_size,
    check_kernel_size,
    check_one_of,
)
from .layers.functional.criss_cross import CRISS_CROSS_BACKENDS
from .layers.functional.halo_attention import HALO_ATTENTION_BACKENDS
from .layers.functional.local_attention import LOCAL_ATTENTION_BACKENDS, check_recompute
from .layers.functional.logit_tables import LOGIT_TABLE_BACKENDS
from .layers.halo_attention import POSITIONAL_ENCODINGS as HALO_POSITIONAL_ENCODINGS
from .layers.local_attention import POSITIONAL_ENCODINGS as SASA_POSITIONAL_ENCODINGS

__all__ = [
    "add_aadet_config",
    "validate_aadet_config",
    "ConfigValueError",
    "UnknownConfigKeyError",
    "config_keys",
    "similar_config_keys",
    "config_error",
    "layer_defaults",
    "NORMS",
    "COMPILE_MODES",
    "compile_backends",
    "check_aa_config",
    "check_sasa_config",
    "check_halo_config",
    "check_ccnet_config",
    "CCNET_STAGES",
    "check_compile_config",
    "check_recipe_values",
]

# Norm names understood by detectron2.layers.get_norm (plus "" for none).
NORMS = ("", "BN", "SyncBN", "FrozenBN", "GN", "nnSyncBN", "naiveSyncBN", "naiveSyncBN_N", "LN")
#: MODEL.COMPILE.MODE: torch.compile's modes ("default" = torch's mode=None; the others are
#: Inductor's, tests/engine/test_compile.py checks that torch knows them). MODEL.COMPILE.BACKEND
#: accepts :func:`compile_backends`.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_UNIT = Interval(0.0, 1.0, low_closed=True, high_closed=True)  # [0, 1]
_UNIT_OPEN_TOP = Interval(0.0, 1.0, low_closed=True)  # [0, 1)
_POSITIVE = Interval(0.0)  # > 0
_AT_LEAST_0 = Interval(0.0, low_closed=True)  # >= 0
_AT_LEAST_1 = Interval(1.0, low_closed=True)  # >= 1
#: MODEL.CCNET.STAGE: the ResNet stages the RCCA module may stand in (before the stage's last
#: block). Checked here when the config loads, before any model is built; the names are
#: aadet.modeling.backbone.resnet_stages.STAGE_NAMES, which this module sits below
#: (tests/layers/test_criss_cross.py checks that they agree).
CCNET_STAGES = ("res2", "res3", "res4", "res5")


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


def config_error(key: str, allowed: str, given) -> ConfigValueError:
    """The one error of a bad config value: names ``key``, the allowed range and the value (the
    ``error`` factory of the rules in :mod:`aadet.layers.functional.checks`)."""
    return ConfigValueError(f"Config key {key} must be {allowed}; got {given!r}.")


def config_keys(cfg, prefix: str = "") -> List[str]:
    """Every dotted key of ``cfg``, its sections included (``"MODEL"``, ``"MODEL.SASA"``, ...).
    ``cfg``: a YACS ``CfgNode``, or any nested mapping (a LazyConfig as plain containers)."""
    keys = []
    for name, value in cfg.items():
        keys.append(prefix + str(name))
        if isinstance(value, Mapping):
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


# ============================================================================ the keys
def add_aadet_config(cfg):
    """Add aadet's keys (with their defaults) to a Detectron2 config, in place."""
    for add in (
        add_input_config,
        add_solver_config,
        add_test_config,
        add_resnet_config,
        add_fpn_and_head_config,
        add_aa_config,
        add_sasa_config,
        add_halo_config,
        add_ccnet_config,
        add_compile_config,
        add_datasets_config,
    ):
        add(cfg)
    return cfg


def add_input_config(cfg):
    """``INPUT.*``: the training augmentation of the AA/SASA RetinaNet recipe
    (:mod:`aadet.data.augmentation`)."""
    # AA appendix A.1: resize so that the longer side is uniform in LONG_SIDE_RANGE, crop to at
    # most CROP_SIZE x CROP_SIZE (padding to it), horizontal flip with FLIP_PROB. Detectron2's
    # ResizeScale, FixedSizeCrop and RandomFlip. Disabled: Detectron2's INPUT.MIN_SIZE_TRAIN path.
    cfg.INPUT.SCALE_JITTER = CN()
    cfg.INPUT.SCALE_JITTER.ENABLED = True  # paper: on
    cfg.INPUT.SCALE_JITTER.LONG_SIDE_RANGE = (512, 768)  # paper: [512, 768] pixels
    cfg.INPUT.SCALE_JITTER.CROP_SIZE = 640  # paper: 640 (crop to at most 640x640, pad to it)
    # Paper: 0.5. 1.0 mirrors every image (the tree demo: its val image faces the other way).
    cfg.INPUT.SCALE_JITTER.FLIP_PROB = 0.5
    cfg.INPUT.SCALE_JITTER.PAD_VALUE = 128.0  # value of padded pixels (0-255, before normalization)
    # Photometric jitter (Detectron2's RandomBrightness / RandomContrast: factors drawn uniformly
    # from the ranges). Not in the papers' recipe, so off; the tree-crown demo turns it on (it
    # trains on one aerial image and validates on another, with other lighting).
    cfg.INPUT.PHOTOMETRIC = CN()
    cfg.INPUT.PHOTOMETRIC.ENABLED = False
    cfg.INPUT.PHOTOMETRIC.BRIGHTNESS = (0.75, 1.25)
    cfg.INPUT.PHOTOMETRIC.CONTRAST = (0.75, 1.25)


def add_solver_config(cfg):
    """``SOLVER.*`` (epoch schedule, optimizer, checkpoints, logging) and ``MODEL_EMA.*``."""
    # Epoch-based schedule (aadet.engine.schedule): when EPOCHS > 0, SOLVER.MAX_ITER and
    # SOLVER.STEPS are computed at start from the number of training images and
    # SOLVER.IMS_PER_BATCH: MAX_ITER = ceil(EPOCHS * images / batch), STEPS from STEPS_EPOCHS
    # likewise. EPOCHS = 0 keeps the iteration keys as given.
    cfg.SOLVER.EPOCHS = 0  # papers: 150 epochs from scratch
    cfg.SOLVER.STEPS_EPOCHS = ()  # LR decay points in epochs; RetinaNet recipe: (100, 133) of 150
    cfg.SOLVER.WARMUP_EPOCHS = 0.0  # if > 0, overrides SOLVER.WARMUP_ITERS
    # Optimizer, a name in aadet.engine.optimizer.OPTIMIZERS: "SGD" (papers' recipe; Detectron2's,
    # with SOLVER.MOMENTUM / NESTEROV) or "AdamW" (SOLVER.ADAMW_BETAS; decoupled
    # SOLVER.WEIGHT_DECAY). Both use Detectron2's parameter groups, LR schedule and clipping.
    cfg.SOLVER.OPTIMIZER = "SGD"
    cfg.SOLVER.ADAMW_BETAS = (0.9, 0.999)  # AdamW's (beta1, beta2), each in [0, 1)
    # Keep the checkpoint with the best value of this metric (from the periodic evaluation) as
    # model_best.pth next to the periodic checkpoints; "" disables it.
    cfg.SOLVER.BEST_CHECKPOINT_METRIC = "bbox/AP"
    # Iterations between metric writes (console, metrics.json, TensorBoard), and the smoothing
    # window of metrics.json. Detectron2 hard-codes 20; 1 records every iteration's raw losses.
    cfg.SOLVER.LOG_PERIOD = 20
    # Exponential moving average of the weights (aadet.engine.ema.ModelEMA), used for every
    # evaluation when ENABLED: the periodic and final ones in training, --eval-only, the predictor
    # and the tools built on it (demo, visualization, export) -- they load checkpoint["model_ema"].
    # Training is unchanged. Not in the papers, so off. The decay of update t is
    # min(DECAY, (1 + t) / (10 + t)) (TensorFlow's num_updates warm-up): in runs shorter than
    # ~(10 DECAY - 1) / (1 - DECAY) updates (4490 for 0.998) the warm-up term sets it.
    cfg.MODEL_EMA = CN()
    cfg.MODEL_EMA.ENABLED = False
    cfg.MODEL_EMA.DECAY = 0.998  # the average spans ~1 / (1 - DECAY) iterations (ema.DECAY_RANGE)


def add_test_config(cfg):
    """``TEST.*``: attention statistics in training, box voting at inference."""
    # Iterations between attention statistics in the training metrics (aadet.engine.hooks.
    # AttentionStatsHook): per attention layer, attn/<layer>/perplexity (effective number of keys
    # attended, on the first image of that iteration's batch) and keys (number available), and
    # attn/<layer>/{rel,rel_h,rel_w,query,value}_grad_ratio (||grad|| / ||weight||). Also at the
    # last iteration. 0 = off (not part of the papers' recipe).
    cfg.TEST.ATTENTION_STATS_PERIOD = 0
    # Box voting at inference (aadet.modeling.box_voting; Detectron's TEST.BBOX_VOTE, scoring "ID"):
    # each box NMS keeps becomes the score-weighted mean of the pre-NMS boxes of its class with IoU
    # >= VOTE_TH with it (itself included); scores unchanged. Applies wherever the model infers
    # (evaluation, TTA's merge, the predictor, exports). Not in the papers, so off.
    cfg.TEST.BBOX_VOTE = CN()
    cfg.TEST.BBOX_VOTE.ENABLED = False
    cfg.TEST.BBOX_VOTE.VOTE_TH = 0.8  # Detectron's default; range: box_voting.VOTE_THRESH_RANGE


def add_resnet_config(cfg):
    """``MODEL.RESNETS.*`` keys aadet adds to Detectron2's ResNet (all its ResNets use them)."""
    # Zero-initialise the scale of the last norm in every residual block, so each block starts
    # as the identity (Goyal et al. 2017; the TF-TPU ResNet of the papers' codebase does it,
    # Detectron2 does not: its ResNet notes that it hurt GN models trained from scratch). Needs a
    # norm with a learned scale. False = Detectron2's init; the COCO recipe (Base-RetinaNet-Scratch.yaml)
    # turns it on.
    cfg.MODEL.RESNETS.ZERO_INIT_RESIDUAL = False


def add_fpn_and_head_config(cfg):
    """``MODEL.FPN.*`` and ``MODEL.RETINANET.*`` keys of RetinaNet's FPN and head
    (:mod:`aadet.modeling.backbone.fpn`, :mod:`aadet.modeling.meta_arch.retinanet`)."""
    # Where FPN's P6/P7 come from: "res5" (Detectron2's RetinaNet) or "p5" (the RetinaNet of the
    # AA paper's codebase, TF-TPU RetinaNet).
    cfg.MODEL.FPN.P6P7_SOURCE = "p5"
    # What makes the FPN's outputs (3x3 after the merge) and P6/P7 (stride-2 3x3): a name in
    # FPN_SPATIAL_LAYER_REGISTRY: "conv" (Detectron2's FPN) or "attention" (SASA's attentional
    # FPN, with MODEL.SASA.*'s layer options).
    cfg.MODEL.FPN.SPATIAL_LAYER = "conv"
    # With SPATIAL_LAYER "attention": also make P6/P7's stride-2 3x3 convs local attention. Off:
    # with it the all-attention RetinaNet has 1.2M fewer params than SASA's Table 2 (22.0M);
    # without it we are within 0.35M (aadet/modeling/backbone/attention_fpn.py).
    cfg.MODEL.FPN.ATTENTION_TOP_BLOCK = False
    # The RetinaNet head, a name in RETINANET_HEAD_REGISTRY: "RetinaNetHead" (Detectron2's) or
    # "AttentionRetinaNetHead" (SASA: the towers' 3x3 convs are local attention).
    cfg.MODEL.RETINANET.HEAD_NAME = "RetinaNetHead"


def add_aa_config(cfg):
    """``MODEL.AA.*``: the Attention Augmented ResNet (:mod:`aadet.modeling.backbone.aa_resnet`)."""
    layer = layer_defaults(AugmentedConv2d)  # the layer keys' defaults: the layer's own
    aa = cfg.MODEL.AA = CN()
    # Stages whose 3x3 convolutions are augmented (paper: res3, res4, res5 = 28/14/7 on ImageNet).
    aa.STAGES = ("res3", "res4", "res5")
    # kappa = dk / Fout and nu = dv / Fout (paper: kappa = 2 nu = 0.2; ResNet-34 uses 0.25/0.25).
    # dk and dv are rounded to the nearest multiple of NUM_HEADS (at least NUM_HEADS).
    aa.KAPPA = layer["kappa"]
    aa.NU = layer["nu"]
    aa.NUM_HEADS = layer["num_heads"]  # paper: 8
    # A name in aadet.layers.AA_POSITIONAL_ENCODINGS: "relative" (paper), or the ablations of its
    # Tables 6-7.
    aa.POSITIONAL_ENCODING = layer["positional_encoding"]
    # Stages where attention runs on a 3x3/2 average-pooled input, bilinearly upsampled back
    # (paper: only the first augmented stage). () = full resolution everywhere.
    aa.DOWNSAMPLE_STAGES = ("res3",)
    # Largest input side (pixels, after padding) the relative tables must cover: each layer holds
    # tables of 2 * ceil(MAX_INPUT_SIZE / stride) - 1 rows. A larger feature map is an error
    # unless CLIP_DISTANCES, which clips relative distances to the table (as in Shaw et al.).
    aa.MAX_INPUT_SIZE = 1024
    aa.CLIP_DISTANCES = layer["clip_distances"]
    # Minimum key depth per head: dk = max(rounded kappa * Fout, MIN_DK_PER_HEAD * NUM_HEADS).
    # The paper states 20 for its CIFAR models, and its ImageNet parameter counts (Table 2, and
    # Table 9's per-layer numbers) only come out with 20; its COCO RetinaNet counts (Table 4:
    # 33.4M -> 33.1M, i.e. fewer params) come out without it. Detection configs use 1.
    aa.MIN_DK_PER_HEAD = layer["min_dk_per_head"]
    # How the global attention is computed: "auto" (aadet.layers.functional.logit_tables.
    # auto_logit_table_impl) or a route of LOGIT_TABLE_BACKENDS there (all exact, only speed and
    # memory differ; each route with its summary). Paper: its TF code materializes the logits.
    aa.IMPL = layer["impl"]


def add_sasa_config(cfg):
    """``MODEL.SASA.*``: the SASA-ResNet, attentional FPN and head
    (:mod:`aadet.modeling.backbone.sasa_resnet`)."""
    layer = layer_defaults(LocalSelfAttention2d)  # the layer keys' defaults: the layers' own
    stem = layer_defaults(SpatiallyAwareAttentionStem)
    sa = cfg.MODEL.SASA = CN()
    sa.KERNEL_SIZE = layer["kernel_size"]  # spatial extent k, odd (paper: 7)
    # Spatial extent of the attentional RetinaNet head's tower layers (AttentionRetinaNetHead),
    # odd; its other options are the keys here. Paper: 7, as every SASA layer.
    sa.HEAD_KERNEL_SIZE = layer["kernel_size"]
    sa.NUM_HEADS = layer["num_heads"]  # paper: 8
    # A name in aadet.layers.SASA_POSITIONAL_ENCODINGS: "relative" (paper), "sine2d" (the 2D sine
    # encoding, as MODEL.AA's), "none": paper Table 5.
    sa.POSITIONAL_ENCODING = layer["positional_encoding"]
    # Stages whose spatial (3x3) convolution is replaced by local attention. Paper Table 1/2:
    # all four; Table 3 explores e.g. ("res4", "res5").
    sa.STAGES = ("res2", "res3", "res4", "res5")
    # Stem: "conv" (ResNet 7x7/2 + maxpool) or "attention" (the spatially-aware attention stem).
    sa.STEM = "conv"
    # Attention stem (paper Section 3.2; its appendix with the exact values is not public):
    sa.STEM_MIXTURES = stem["num_mixtures"]  # m value matrices mixed per position (paper: 4)
    sa.STEM_NUM_HEADS = stem["num_heads"]  # heads of the stem attention
    sa.STEM_BLOCK_SIZE = stem["block_size"]  # attention in b x b blocks, b x b max pooling (paper: 4)
    # How the stem's attention is computed: a name in aadet.layers.STEM_IMPLS; "auto" (default)
    # picks by device (SpatiallyAwareAttentionStem.route). All exact, only speed and memory
    # differ; not in the paper.
    sa.STEM_IMPL = stem["impl"]
    # How local attention is computed: "auto" (aadet.layers.functional.local_attention.
    # auto_local_attention_impl) or a route of LOCAL_ATTENTION_BACKENDS there (all exact, only
    # speed and memory differ; each route with its summary).
    sa.IMPL = layer["impl"]
    # Query tile side of the blocked (halo) routes; only speed/memory depend on it.
    sa.BLOCK_SIZE = layer["block_size"]
    # True: keep no attention weights (k^2 per pixel and head) for backward but recompute them
    # there from one log-sum-exp per query (the C++ kernel's recompute mode, flash attention's
    # trick): the same result for less training memory and more time (the logits are computed
    # again in backward; BENCHMARKS.md has both). With IMPL "auto" it applies where auto takes the
    # C++ kernel (CPU); the other routes run as they do. IMPL naming a route without a recompute
    # mode ("neighborhood", "fused", "materialized") together with True is an error. Not in the
    # paper, so off.
    sa.RECOMPUTE_ATTENTION = layer["recompute_attention"]


def add_halo_config(cfg):
    """``MODEL.HALO.*``: the HaloNet-style ResNet (:mod:`aadet.modeling.backbone.halo_resnet`)."""
    layer = layer_defaults(HaloSelfAttention2d)  # the layer keys' defaults: the layer's own
    ha = cfg.MODEL.HALO = CN()
    # Stages whose spatial (3x3) convolution is replaced by blocked local attention (the SASA
    # backbone's default placement, so the two compare at equal placement).
    ha.STAGES = ("res2", "res3", "res4", "res5")
    # Query block side b: the map is cut into b x b blocks whose queries share one window
    # (paper: 8). A stage that downsamples needs b divisible by 2 (attention downsampling).
    ha.BLOCK_SIZE = layer["block_size"]
    # Halo h: rows/columns of keys around each block, the window is (b + 2h)^2 (paper: 3).
    ha.HALO_SIZE = layer["halo_size"]
    ha.NUM_HEADS = layer["num_heads"]  # paper: 8
    # A name in aadet.layers.HALO_POSITIONAL_ENCODINGS: "relative" (paper) or "none".
    ha.POSITIONAL_ENCODING = layer["positional_encoding"]
    # How the attention is computed: "auto" (aadet.layers.functional.halo_attention.
    # auto_halo_attention_impl) or a route of HALO_ATTENTION_BACKENDS there (all exact, only
    # speed and memory differ; each route with its summary).
    ha.IMPL = layer["impl"]


def add_ccnet_config(cfg):
    """``MODEL.CCNET.*``: CCNet's recurrent criss-cross attention module (RCCA,
    :class:`~aadet.layers.RecurrentCrissCrossAttention`) in a ResNet backbone."""
    layer = layer_defaults(RecurrentCrissCrossAttention)  # the layer keys' defaults: the layer's own
    cc = cfg.MODEL.CCNET = CN()
    # The stage whose last block the RCCA module is inserted before, a name in CCNET_STAGES
    # (paper, COCO Mask R-CNN: one RCCA before the last block of res4, where the non-local
    # network puts its block).
    cc.STAGE = "res4"
    # True: the module as a residual block, x + RCCA(x), starting as the identity (the scale of
    # its bottleneck's norm zeroed), the way the non-local network inserts its block into a
    # ResNet, which the paper's COCO experiment follows; False: RCCA's output replaces the
    # features, as in CCNet's segmentation head.
    cc.RESIDUAL = True
    # R: passes of the one shared criss-cross block, an integer >= 1 (paper: 2, which reaches
    # every pixel of the map; 1 reaches only each pixel's row and column).
    cc.RECURRENCE = layer["recurrence"]
    # Heads of the criss-cross block, dividing both C // REDUCTION and C (paper: 1).
    cc.NUM_HEADS = layer["num_heads"]
    # q and k get C // REDUCTION channels, v C (paper: 8, i.e. C/8).
    cc.REDUCTION = layer["reduction"]
    # Channels the module attends in (its 3x3 conv reduces to them), an integer >= 0; 0 = the
    # stage's channels // 4 (paper: in/4, 512 for 2048).
    cc.INTER_CHANNELS = 0
    # The kernel of the module's bottleneck conv (concat[x, attended] -> the stage's channels), an
    # odd integer >= 1 (paper's code: 3). Its widest conv: 1 cuts the module's conv FLOPs ~3.4x
    # (a departure from the paper).
    cc.BOTTLENECK_KERNEL_SIZE = layer["bottleneck_kernel_size"]
    # How the criss-cross attention is computed: "auto" (aadet.layers.functional.criss_cross.
    # auto_criss_cross_attention_impl) or a route of CRISS_CROSS_BACKENDS there (all exact, only
    # speed and memory differ; each route with its summary). Not a choice of the paper.
    cc.IMPL = layer["impl"]


def add_compile_config(cfg):
    """``MODEL.COMPILE.*``: running the model through ``torch.compile`` (:mod:`aadet.engine.compile`)."""
    # In tools/train_net.py's training and evaluation and tools/benchmark.py's cases (--compile
    # sets ENABLED in both): nn.Module.compile in place, so checkpoints keep their keys and load
    # into uncompiled models. Not in the papers, and the first iterations (and the first
    # evaluation) pay the compile time, so off. A backend
    # that cannot run here (Inductor without a C++ compiler on CPU, or without Triton on CUDA)
    # stops the build with an error naming ENABLED. The predictor, demo, visualization and export
    # tools run uncompiled.
    c = cfg.MODEL.COMPILE = CN()
    c.ENABLED = False
    c.BACKEND = "inductor"  # torch.compile's backend (compile_backends())
    # torch.compile's mode (COMPILE_MODES): "default", "reduce-overhead" (CUDA graphs),
    # "max-autotune", "max-autotune-no-cudagraphs"; Inductor's, other backends ignore it.
    c.MODE = "default"
    # torch.compile's dynamic: compile shape-generic graphs from the start. Detection shapes
    # change every iteration (the number of boxes per image; the image size in evaluation and
    # without SCALE_JITTER), and a graph per shape would recompile most iterations. False: static
    # graphs, one per shape, up to torch._dynamo.config.recompile_limit per frame (then eager).
    c.DYNAMIC = True


def add_datasets_config(cfg):
    """``DATASETS.REGISTER_COCO``: your own data, named in the config alone."""
    # COCO-format detection datasets to register by name before DATASETS.TRAIN / DATASETS.TEST are
    # read: a list of [name, json_file, image_root] triples (paths absolute or relative to the
    # working directory), e.g.
    #   REGISTER_COCO: [["cells_train", "cells/train.json", "cells/images"],
    #                   ["cells_val", "cells/val.json", "cells/images"]]
    # or on the command line: DATASETS.REGISTER_COCO "[['cells_train', 'a.json', 'img']]".
    # Checked and registered by aadet.data.datasets.register_coco_from_config (called by
    # aadet.engine.load_config): a missing file, a name registered with other paths or an entry
    # that is not a triple of strings stops with an error naming the entry. () = none.
    cfg.DATASETS.REGISTER_COCO = ()


# ============================================================================ the checks
def validate_aadet_config(cfg):
    """Check the keys this module owns and the layer keys (see the module docstring for the keys
    the model builders and the engine check when they map them).

    Raises:
        ConfigValueError: naming the key, the allowed range and the given value.
    """
    for check in (
        check_norm_config,
        check_input_config,
        check_solver_config,
        check_test_config,
        check_compile_config,
        check_aa_config,
        check_sasa_config,
        check_halo_config,
        check_ccnet_config,
    ):
        check(cfg)
    return cfg


def _check_range_pair(key: str, value, error=config_error):
    lo_hi = tuple(value)
    if len(lo_hi) != 2 or not (0 < lo_hi[0] <= lo_hi[1]):
        raise error(key, "(min, max) with 0 < min <= max", lo_hi)


def check_recipe_values(long_side_range, crop_size, flip_prob, brightness=None, contrast=None,
                        name=lambda arg: f"INPUT.SCALE_JITTER.{arg.upper()}", error=config_error):
    """The recipe's augmentation values (``INPUT.SCALE_JITTER.*``, ``INPUT.PHOTOMETRIC.*``), each
    named by ``name(argument)`` in the error: the config keys here, the arguments of
    :func:`aadet.data.augmentation.recipe_augmentation` when it checks its own."""
    _check_range_pair(name("long_side_range"), long_side_range, error)
    check_in(crop_size, _POSITIVE, name("crop_size"), error)
    check_in(flip_prob, _UNIT, name("flip_prob"), error)
    for arg, value in (("brightness", brightness), ("contrast", contrast)):
        if value is not None:
            _check_range_pair(name(arg), value, error)


def check_norm_config(cfg):
    """The Detectron2 norm keys our recipe relies on are names ``get_norm`` knows."""
    for key in ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.RETINANET.NORM"):
        node = cfg
        for name in key.split("."):
            node = node.get(name) if hasattr(node, "get") else None
        if node is not None:
            check_one_of(node, NORMS, key, config_error)


def check_input_config(cfg):
    """``INPUT.SCALE_JITTER.*`` and ``INPUT.PHOTOMETRIC.*``."""
    sj, ph = cfg.INPUT.SCALE_JITTER, cfg.INPUT.PHOTOMETRIC
    photometric = ("brightness", "contrast")
    check_recipe_values(
        sj.LONG_SIDE_RANGE, sj.CROP_SIZE, sj.FLIP_PROB, ph.BRIGHTNESS, ph.CONTRAST,
        name=lambda arg: f"INPUT.{'PHOTOMETRIC' if arg in photometric else 'SCALE_JITTER'}.{arg.upper()}",
    )


def check_solver_config(cfg):
    """``SOLVER.*`` aadet adds or relies on (``MODEL_EMA.DECAY``'s range is the EMA's:
    :func:`aadet.engine.ema.build_model_ema` checks it)."""
    s = cfg.SOLVER
    if s.EPOCHS < 0:
        raise config_error("SOLVER.EPOCHS", ">= 0 (0 = use SOLVER.MAX_ITER)", s.EPOCHS)
    if s.EPOCHS == 0 and len(s.STEPS_EPOCHS):
        raise config_error("SOLVER.STEPS_EPOCHS", "empty unless SOLVER.EPOCHS > 0", tuple(s.STEPS_EPOCHS))
    if s.EPOCHS > 0 and any(not (0 < e <= s.EPOCHS) for e in s.STEPS_EPOCHS):
        raise config_error(
            "SOLVER.STEPS_EPOCHS", f"values in (0, SOLVER.EPOCHS={s.EPOCHS}]", tuple(s.STEPS_EPOCHS)
        )
    check_in(s.WARMUP_EPOCHS, _AT_LEAST_0, "SOLVER.WARMUP_EPOCHS", config_error)
    if s.EPOCHS <= 0 and s.MAX_ITER <= 0:
        raise config_error("SOLVER.MAX_ITER", "> 0 when SOLVER.EPOCHS is 0", s.MAX_ITER)
    check_in(s.LOG_PERIOD, _AT_LEAST_1, "SOLVER.LOG_PERIOD", config_error)
    if len(s.ADAMW_BETAS) != 2 or not all(float(b) in _UNIT_OPEN_TOP for b in s.ADAMW_BETAS):
        raise config_error("SOLVER.ADAMW_BETAS", f"two values {_UNIT_OPEN_TOP}", tuple(s.ADAMW_BETAS))


def check_test_config(cfg):
    """``TEST.ATTENTION_STATS_PERIOD`` and Detectron2's ``TEST.AUG`` (read by
    :class:`aadet.modeling.RetinaNetWithTTA`)."""
    check_in(cfg.TEST.ATTENTION_STATS_PERIOD, _AT_LEAST_0, "TEST.ATTENTION_STATS_PERIOD", config_error)
    aug = cfg.TEST.AUG
    if aug.ENABLED:
        if not len(aug.MIN_SIZES) or any(int(m) <= 0 for m in aug.MIN_SIZES):
            raise config_error(
                "TEST.AUG.MIN_SIZES", "one or more sizes > 0 when TEST.AUG.ENABLED", tuple(aug.MIN_SIZES)
            )
        check_in(aug.MAX_SIZE, _AT_LEAST_1, "TEST.AUG.MAX_SIZE", config_error)


def check_compile_config(cfg):
    """``MODEL.COMPILE.*``, whether or not compiling is enabled. Whether the backend can run on
    this machine is checked when the model is compiled (:func:`aadet.engine.compile.maybe_compile`)."""
    c = cfg.MODEL.COMPILE
    check_one_of(
        c.BACKEND, compile_backends(), "MODEL.COMPILE.BACKEND", config_error,
        " (torch.compile's backends: aadet.config.compile_backends())",
    )
    check_one_of(c.MODE, COMPILE_MODES, "MODEL.COMPILE.MODE", config_error)


def check_aa_config(cfg):
    """``MODEL.AA.*`` with :class:`~aadet.layers.AugmentedConv2d`'s rules (``STAGES``,
    ``DOWNSAMPLE_STAGES`` and ``MAX_INPUT_SIZE`` belong to the AA-ResNet builder)."""
    aa = cfg.MODEL.AA
    check_in(aa.KAPPA, KAPPA_RANGE, "MODEL.AA.KAPPA", config_error)
    check_in(aa.NU, NU_RANGE, "MODEL.AA.NU", config_error, " (dv < Fout: some conv channels remain)")
    check_int(aa.NUM_HEADS, "MODEL.AA.NUM_HEADS", 1, config_error)
    check_one_of(aa.POSITIONAL_ENCODING, AA_POSITIONAL_ENCODINGS, "MODEL.AA.POSITIONAL_ENCODING", config_error)
    check_int(aa.MIN_DK_PER_HEAD, "MODEL.AA.MIN_DK_PER_HEAD", 1, config_error)
    LOGIT_TABLE_BACKENDS.check(aa.IMPL, "MODEL.AA.IMPL", config_error)


def check_sasa_config(cfg):
    """``MODEL.SASA.*`` with :class:`~aadet.layers.LocalSelfAttention2d`'s and the stem's rules
    (``STAGES`` and ``STEM`` belong to the SASA-ResNet builder; the heads' divisibility of each
    stage's width is checked when it is built)."""
    sa = cfg.MODEL.SASA
    check_kernel_size(sa.KERNEL_SIZE, "MODEL.SASA.KERNEL_SIZE", config_error)
    check_kernel_size(sa.HEAD_KERNEL_SIZE, "MODEL.SASA.HEAD_KERNEL_SIZE", config_error)
    check_int(sa.NUM_HEADS, "MODEL.SASA.NUM_HEADS", 1, config_error)
    check_one_of(sa.POSITIONAL_ENCODING, SASA_POSITIONAL_ENCODINGS, "MODEL.SASA.POSITIONAL_ENCODING", config_error)
    for key in ("STEM_MIXTURES", "STEM_NUM_HEADS", "STEM_BLOCK_SIZE", "BLOCK_SIZE"):
        check_int(sa[key], f"MODEL.SASA.{key}", 1, config_error)
    check_one_of(sa.STEM_IMPL, STEM_IMPLS, "MODEL.SASA.STEM_IMPL", config_error)
    LOCAL_ATTENTION_BACKENDS.check(sa.IMPL, "MODEL.SASA.IMPL", config_error)
    check_recompute(
        sa.RECOMPUTE_ATTENTION, sa.IMPL, "MODEL.SASA.RECOMPUTE_ATTENTION", "MODEL.SASA.IMPL", config_error
    )


def check_halo_config(cfg):
    """``MODEL.HALO.*`` with :class:`~aadet.layers.HaloSelfAttention2d`'s rules (``STAGES``
    belongs to the HaloNet-ResNet builder, which also checks each stage's width against
    ``NUM_HEADS`` and a downsampling stage's ``BLOCK_SIZE``)."""
    ha = cfg.MODEL.HALO
    check_int(ha.BLOCK_SIZE, "MODEL.HALO.BLOCK_SIZE", 1, config_error)
    check_halo_size(ha.HALO_SIZE, "MODEL.HALO.HALO_SIZE", config_error)
    check_int(ha.NUM_HEADS, "MODEL.HALO.NUM_HEADS", 1, config_error)
    check_one_of(ha.POSITIONAL_ENCODING, HALO_POSITIONAL_ENCODINGS, "MODEL.HALO.POSITIONAL_ENCODING", config_error)
    HALO_ATTENTION_BACKENDS.check(ha.IMPL, "MODEL.HALO.IMPL", config_error)


def check_ccnet_config(cfg):
    """``MODEL.CCNET.*`` with :class:`~aadet.layers.RecurrentCrissCrossAttention`'s rules (the
    heads' and the reduction's fit to the stage's width is checked when the module is built)."""
    cc = cfg.MODEL.CCNET
    check_one_of(cc.STAGE, CCNET_STAGES, "MODEL.CCNET.STAGE", config_error)
    check_bool(cc.RESIDUAL, "MODEL.CCNET.RESIDUAL", config_error)
    check_int(cc.RECURRENCE, "MODEL.CCNET.RECURRENCE", 1, config_error)
    check_int(cc.NUM_HEADS, "MODEL.CCNET.NUM_HEADS", 1, config_error)
    check_int(cc.REDUCTION, "MODEL.CCNET.REDUCTION", 1, config_error)
    check_int(cc.INTER_CHANNELS, "MODEL.CCNET.INTER_CHANNELS", 0, config_error, " (0 = the stage's channels // 4)")
    check_kernel_size(cc.BOTTLENECK_KERNEL_SIZE, "MODEL.CCNET.BOTTLENECK_KERNEL_SIZE", config_error)
    CRISS_CROSS_BACKENDS.check(cc.IMPL, "MODEL.CCNET.IMPL", config_error)
