"""Every config key aadet adds to Detectron2, with its meaning and the papers' default.

Call :func:`add_aadet_config` on a Detectron2 ``CfgNode`` before merging one of our YAML files,
then :func:`validate_aadet_config` once the config is final (``tools/train_net.py`` does both).

Papers:
  AA   -- Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019.
  SASA -- Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019.
"""
from detectron2.config import CfgNode as CN

__all__ = ["add_aadet_config", "validate_aadet_config", "ConfigValueError"]

# Norm names understood by detectron2.layers.get_norm (plus "" for none).
_NORMS = ("", "BN", "SyncBN", "FrozenBN", "GN", "nnSyncBN", "naiveSyncBN", "naiveSyncBN_N", "LN")
_POS_AA = ("relative", "none", "sine2d", "coordconv")
_POS_SASA = ("relative", "absolute", "none")
_SASA_IMPLS = ("auto", "neighborhood", "fused", "materialized")
_STAGES = ("res2", "res3", "res4", "res5")


class ConfigValueError(ValueError):
    """A config key holds a value outside its allowed range (the message names the key)."""


def add_aadet_config(cfg):
    """Add aadet's keys (with the papers' defaults) to a Detectron2 config, in place."""
    _C = cfg

    # ---------------------------------------------------------------- data recipe (both papers)
    # Training augmentation of the AA/SASA RetinaNet recipe (AA appendix A.1): resize so that the
    # longer side is uniform in LONG_SIDE_RANGE, crop to at most CROP_SIZE x CROP_SIZE (padding to
    # it), horizontal flip with FLIP_PROB. Implemented with Detectron2's ResizeScale,
    # FixedSizeCrop and RandomFlip. When disabled, Detectron2's INPUT.MIN_SIZE_TRAIN path is used.
    _C.INPUT.SCALE_JITTER = CN()
    _C.INPUT.SCALE_JITTER.ENABLED = True  # paper: on
    _C.INPUT.SCALE_JITTER.LONG_SIDE_RANGE = (512, 768)  # paper: [512, 768] pixels
    _C.INPUT.SCALE_JITTER.CROP_SIZE = 640  # paper: 640 (crop to at most 640x640, pad to it)
    _C.INPUT.SCALE_JITTER.FLIP_PROB = 0.5  # paper: 0.5
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

    # Keep the checkpoint with the best value of this metric (from the periodic evaluation);
    # "" disables it. Written as model_best.pth next to the periodic checkpoints.
    _C.SOLVER.BEST_CHECKPOINT_METRIC = "bbox/AP"
    # Iterations between metric writes (console, metrics.json, TensorBoard), and the smoothing
    # window of metrics.json. Detectron2 hard-codes 20; 1 records every iteration's raw losses.
    _C.SOLVER.LOG_PERIOD = 20

    # ---------------------------------------------------------------- RetinaNet / FPN
    # Where FPN's P6/P7 come from: "res5" (Detectron2's RetinaNet) or "p5" (the RetinaNet of the
    # AA paper's codebase, TF-TPU RetinaNet).
    _C.MODEL.FPN.P6P7_SOURCE = "p5"
    # Which layer makes FPN's output (3x3 after the merge) and P6/P7 (stride-2 3x3): "conv" or
    # "attention" (SASA's attentional FPN, uses MODEL.SASA.* for the attention layers).
    _C.MODEL.FPN.SPATIAL_LAYER = "conv"
    # With SPATIAL_LAYER "attention": also make P6/P7's stride-2 3x3 convs local attention. Off by
    # default: with it the all-attention RetinaNet has 1.2M fewer params than SASA's Table 2
    # (22.0M); without it we are within 0.35M (see aadet/modeling/attention_fpn.py).
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
    _C.MODEL.AA.KAPPA = 0.2
    _C.MODEL.AA.NU = 0.1
    _C.MODEL.AA.NUM_HEADS = 8  # paper: 8
    # "relative" (paper), "none", "sine2d", "coordconv" (paper's ablation, Tables 6-7).
    _C.MODEL.AA.POSITIONAL_ENCODING = "relative"
    # Stages where attention runs on a 3x3/2 average-pooled input, bilinearly upsampled back
    # (paper: only the first augmented stage). () = full resolution everywhere.
    _C.MODEL.AA.DOWNSAMPLE_STAGES = ("res3",)
    # Largest input side (pixels, after padding) the relative tables must cover: each layer holds
    # tables of 2 * ceil(MAX_INPUT_SIZE / stride) - 1 rows. A larger feature map is an error
    # unless CLIP_DISTANCES, which clips relative distances to the table (as in Shaw et al.).
    _C.MODEL.AA.MAX_INPUT_SIZE = 1024
    _C.MODEL.AA.CLIP_DISTANCES = False
    # Queries per chunk in the exact materialized fallback (CPU/no fused kernel): bounds peak
    # memory to about B*Nh*QUERY_CHUNK*H*W floats. 0 = all at once.
    _C.MODEL.AA.QUERY_CHUNK = 1024
    # Minimum key depth per head: dk = max(rounded kappa * Fout, MIN_DK_PER_HEAD * NUM_HEADS).
    # The paper states 20 for its CIFAR models, and its ImageNet parameter counts (Table 2, and
    # Table 9's per-layer numbers) only come out with 20; its COCO RetinaNet counts (Table 4:
    # 33.4M -> 33.1M, i.e. fewer params) come out without it. Detection configs use 1.
    _C.MODEL.AA.MIN_DK_PER_HEAD = 1

    # ---------------------------------------------------------------- Stand-Alone Self-Attention
    _C.MODEL.SASA = CN()
    _C.MODEL.SASA.KERNEL_SIZE = 7  # spatial extent k (paper: 7), odd
    _C.MODEL.SASA.NUM_HEADS = 8  # paper: 8
    # "relative" (paper), "absolute" (2D sine), "none": paper Table 5.
    _C.MODEL.SASA.POSITIONAL_ENCODING = "relative"
    # Stages whose spatial (3x3) convolution is replaced by local attention. Paper Table 1/2:
    # all four; Table 3 explores e.g. ("res4", "res5").
    _C.MODEL.SASA.STAGES = ("res2", "res3", "res4", "res5")
    # Stem: "conv" (ResNet 7x7/2 + maxpool) or "attention" (spatially-aware attention stem).
    _C.MODEL.SASA.STEM = "conv"
    # Attention stem (paper Section 3.2; its appendix with the exact values is not public):
    _C.MODEL.SASA.STEM_MIXTURES = 4  # m value matrices mixed per position
    _C.MODEL.SASA.STEM_NUM_HEADS = 1  # heads of the stem attention
    _C.MODEL.SASA.STEM_BLOCK_SIZE = 4  # attention within each 4x4 block, then 4x4 max pooling
    # How local attention is computed (all exact; only speed/memory differ, BENCHMARKS.md):
    # "neighborhood" (window offsets one at a time, stores the [k^2, H, W] attention matrix; the
    # fastest on CPU), "fused" (blocked with halos through a fused SDPA kernel, never stores the
    # attention matrix), "materialized" (blocked, explicit float32 softmax), or "auto": "fused"
    # on CUDA, "neighborhood" elsewhere.
    _C.MODEL.SASA.IMPL = "auto"
    # Query tile side of the blocked (halo) routes; only speed/memory depend on it.
    _C.MODEL.SASA.BLOCK_SIZE = 8

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


def _err(key, allowed, given):
    return ConfigValueError(f"Config key {key} must be {allowed}; got {given!r}.")


def _check_stages(key, value):
    bad = [s for s in value if s not in _STAGES]
    if bad:
        raise _err(key, f"a subset of {_STAGES}", tuple(value))


def validate_aadet_config(cfg):
    """Check every aadet key (and the Detectron2 keys our recipe relies on).

    Raises:
        ConfigValueError: naming the key, the allowed range and the given value.
    """
    for key in ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.RETINANET.NORM"):
        node, name = cfg, key.split(".")
        for n in name:
            node = node.get(n) if hasattr(node, "get") else None
        if node is not None and node not in _NORMS:
            raise _err(key, f"one of {_NORMS}", node)

    sj = cfg.INPUT.SCALE_JITTER
    lo_hi = tuple(sj.LONG_SIDE_RANGE)
    if len(lo_hi) != 2 or not (0 < lo_hi[0] <= lo_hi[1]):
        raise _err("INPUT.SCALE_JITTER.LONG_SIDE_RANGE", "(min, max) with 0 < min <= max", lo_hi)
    if int(sj.CROP_SIZE) <= 0:
        raise _err("INPUT.SCALE_JITTER.CROP_SIZE", "> 0", sj.CROP_SIZE)
    if not 0.0 <= float(sj.FLIP_PROB) <= 1.0:
        raise _err("INPUT.SCALE_JITTER.FLIP_PROB", "in [0, 1]", sj.FLIP_PROB)

    for key in ("BRIGHTNESS", "CONTRAST"):
        lo_hi = tuple(cfg.INPUT.PHOTOMETRIC[key])
        if len(lo_hi) != 2 or not (0 < lo_hi[0] <= lo_hi[1]):
            raise _err(f"INPUT.PHOTOMETRIC.{key}", "(min, max) with 0 < min <= max", lo_hi)

    s = cfg.SOLVER
    if s.EPOCHS < 0:
        raise _err("SOLVER.EPOCHS", ">= 0 (0 = use SOLVER.MAX_ITER)", s.EPOCHS)
    if s.EPOCHS == 0 and len(s.STEPS_EPOCHS):
        raise _err("SOLVER.STEPS_EPOCHS", "empty unless SOLVER.EPOCHS > 0", tuple(s.STEPS_EPOCHS))
    if s.EPOCHS > 0 and any(not (0 < e <= s.EPOCHS) for e in s.STEPS_EPOCHS):
        raise _err("SOLVER.STEPS_EPOCHS", f"values in (0, SOLVER.EPOCHS={s.EPOCHS}]", tuple(s.STEPS_EPOCHS))
    if s.LOG_PERIOD < 1:
        raise _err("SOLVER.LOG_PERIOD", ">= 1", s.LOG_PERIOD)
    if s.WARMUP_EPOCHS < 0:
        raise _err("SOLVER.WARMUP_EPOCHS", ">= 0", s.WARMUP_EPOCHS)
    if s.EPOCHS <= 0 and s.MAX_ITER <= 0:
        raise _err("SOLVER.MAX_ITER", "> 0 when SOLVER.EPOCHS is 0", s.MAX_ITER)

    if cfg.MODEL.FPN.P6P7_SOURCE not in ("res5", "p5"):
        raise _err("MODEL.FPN.P6P7_SOURCE", "'res5' or 'p5'", cfg.MODEL.FPN.P6P7_SOURCE)
    if cfg.MODEL.FPN.SPATIAL_LAYER not in ("conv", "attention"):
        raise _err("MODEL.FPN.SPATIAL_LAYER", "'conv' or 'attention'", cfg.MODEL.FPN.SPATIAL_LAYER)

    aa = cfg.MODEL.AA
    _check_stages("MODEL.AA.STAGES", aa.STAGES)
    _check_stages("MODEL.AA.DOWNSAMPLE_STAGES", aa.DOWNSAMPLE_STAGES)
    if not 0.0 < aa.KAPPA <= 1.0:
        raise _err("MODEL.AA.KAPPA", "in (0, 1]", aa.KAPPA)
    if not 0.0 < aa.NU < 1.0:
        raise _err("MODEL.AA.NU", "in (0, 1) (dv < Fout: some conv channels remain)", aa.NU)
    if aa.NUM_HEADS < 1:
        raise _err("MODEL.AA.NUM_HEADS", ">= 1", aa.NUM_HEADS)
    if aa.POSITIONAL_ENCODING not in _POS_AA:
        raise _err("MODEL.AA.POSITIONAL_ENCODING", f"one of {_POS_AA}", aa.POSITIONAL_ENCODING)
    if aa.MAX_INPUT_SIZE <= 0:
        raise _err("MODEL.AA.MAX_INPUT_SIZE", "> 0", aa.MAX_INPUT_SIZE)
    if aa.MIN_DK_PER_HEAD < 1:
        raise _err("MODEL.AA.MIN_DK_PER_HEAD", ">= 1", aa.MIN_DK_PER_HEAD)
    if aa.QUERY_CHUNK < 0:
        raise _err("MODEL.AA.QUERY_CHUNK", ">= 0", aa.QUERY_CHUNK)

    sa = cfg.MODEL.SASA
    _check_stages("MODEL.SASA.STAGES", sa.STAGES)
    if sa.KERNEL_SIZE < 1 or sa.KERNEL_SIZE % 2 == 0:
        raise _err("MODEL.SASA.KERNEL_SIZE", "an odd integer >= 1", sa.KERNEL_SIZE)
    if sa.NUM_HEADS < 1:
        raise _err("MODEL.SASA.NUM_HEADS", ">= 1", sa.NUM_HEADS)
    if sa.POSITIONAL_ENCODING not in _POS_SASA:
        raise _err("MODEL.SASA.POSITIONAL_ENCODING", f"one of {_POS_SASA}", sa.POSITIONAL_ENCODING)
    if sa.STEM not in ("conv", "attention"):
        raise _err("MODEL.SASA.STEM", "'conv' or 'attention'", sa.STEM)
    if sa.STEM_MIXTURES < 1:
        raise _err("MODEL.SASA.STEM_MIXTURES", ">= 1", sa.STEM_MIXTURES)
    if sa.STEM_NUM_HEADS < 1:
        raise _err("MODEL.SASA.STEM_NUM_HEADS", ">= 1", sa.STEM_NUM_HEADS)
    if sa.STEM_BLOCK_SIZE < 1:
        raise _err("MODEL.SASA.STEM_BLOCK_SIZE", ">= 1", sa.STEM_BLOCK_SIZE)
    if sa.BLOCK_SIZE < 1:
        raise _err("MODEL.SASA.BLOCK_SIZE", ">= 1", sa.BLOCK_SIZE)
    if sa.IMPL not in _SASA_IMPLS:
        raise _err("MODEL.SASA.IMPL", f"one of {_SASA_IMPLS}", sa.IMPL)
    return cfg
