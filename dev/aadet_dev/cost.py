"""What reproducing the COCO configs costs: GPU-hours of each config's 150-epoch schedule on one
8-GPU node, memory per GPU at 8 images, and the batch / LR rule on fewer GPUs.

Every number comes from one of two routes, and the table says which (``Source``):

* **measured**: ``docs/benchmarks_cuda.json`` (``make gpu-check``; schema in
  ``dev/aadet_dev/gpu_report.py``) holds the config's training step at 8 images of 640x640 on one
  GPU (``train_ms``, forward + backward + SGD step on a synthetic batch) and its peak memory
  (``train_peak_mib``). One iteration of the 8-GPU run (64 images) = that step x
  :data:`DDP_OVERHEAD` (gradient all-reduce, SyncBN's all-reduces, data loading, evaluation
  pauses: not in the single-GPU benchmark).
* **estimated**: scaled from a public measurement of the conv RetinaNet R50-FPN
  (:data:`REFERENCES`: Detectron2's model zoo on V100, torchvision's reference training on A100),
  by FLOPs counted as in ``docs/model_table.md`` (:mod:`aadet.analysis.flops`, 2 FLOPs per
  multiply-add, at 640x640)::

      seconds per image = work / (F_ref * r) * recipe / images_per_s
      work              = (F - A) + kappa * A        (F: the config's GFLOPs, A: its attention's)

  ``F_ref`` is our count of the conv R50 at 640x640 (the reference's model differs by a few %),
  ``r`` the reference's pixels per image over 640x640 (:data:`PIXEL_RATIO`), ``recipe`` the
  from-scratch recipe's extra cost over the reference's (:data:`RECIPE_OVERHEAD`) and ``kappa`` how
  many convolution FLOPs one attention FLOP costs in time (:data:`ATTENTION_COST`, per kind of
  attention: attention runs far from the GPU's peak, convolutions close to it). An iteration on 8
  GPUs is 8 images per GPU. Each factor is a (low, nominal, high) :class:`Range`; the low and high
  estimates combine the optimistic and the pessimistic ends of every factor.

Memory (estimated): ``16 bytes x params`` (weights, gradients, momentum, DDP's gradient buckets,
fp32) + activations, scaled from the reference's (its peak minus its own 16 bytes x params, at 2
images of ``r`` x 640 x 640 pixels) by images, pixels and FLOPs, x :data:`RECIPE_MEMORY`. For the
attention configs it is a lower bound: attention keeps more per FLOP (softmax maps, neighbourhoods).

The cost model is a pure function of numbers; :func:`render_block` reads the COCO configs for it
and makes the generated block of ``docs/reproduce_coco.md`` (``dev/coco_cost.py`` prints it,
``dev/update_docs.py`` keeps the doc up to date); ``dev/tests/test_coco_cost.py`` checks both.
"""
import glob
import math
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

__all__ = [
    "COCO_TRAIN_IMAGES",
    "NODE_GPUS",
    "Range",
    "Reference",
    "REFERENCES",
    "PIXEL_RATIO",
    "RECIPE_OVERHEAD",
    "RECIPE_MEMORY",
    "ATTENTION_COST",
    "DDP_OVERHEAD",
    "ConfigFacts",
    "CostRow",
    "schedule_iterations",
    "auto_scale",
    "read_model_table",
    "bench_unusable",
    "measured_step",
    "estimate_row",
    "measured_row",
    "cost_rows",
    "render_cost_table",
    "render_scaling_table",
    "render_assumptions",
    "BEGIN",
    "END",
    "COMMAND",
    "REFERENCE_CONFIG",
    "coco_configs",
    "config_facts",
    "count_flops",
    "render_block",
    "replace_block",
]

#: COCO train2017 images with at least one annotation: what Detectron2's loader samples from
#: (``DATALOADER.FILTER_EMPTY_ANNOTATIONS``); 118,287 images in all.
COCO_TRAIN_IMAGES = 117_266
#: GPUs of the node the table is for.
NODE_GPUS = 8
_GIB = 2 ** 30


class Range(NamedTuple):
    """A factor known to within a range: ``nominal`` is the best guess."""

    low: float
    nominal: float
    high: float


class Reference(NamedTuple):
    """A public training-speed measurement of the conv RetinaNet R50-FPN."""

    gpu: str
    images_per_s_per_gpu: Range  # low .. high throughput (the *fast* end is ``high``)
    peak_gib: Optional[float]  # max memory allocated per GPU, at ``images_per_gpu``
    images_per_gpu: int
    params_m: Optional[float]  # of the reference model (for its static memory)
    source: str


#: The measurements the estimates are scaled from (fp32 / TF32, 800 px shorter side, at most 1333).
REFERENCES: Dict[str, Reference] = {
    "V100": Reference(
        "V100", Range(16 / 0.205 / 8, 16 / 0.205 / 8, 16 / 0.205 / 8), 4.1, 2, 37.9,
        "Detectron2 MODEL_ZOO.md, retinanet_R_50_FPN_1x: 0.205 s/iter for 16 images on 8 V100 "
        "(NVLink, fp32), train mem 4.1 GB (max memory allocated per GPU, 2 images), FrozenBN "
        "ImageNet backbone with stem and res2 frozen; 37.9M parameters (ResNet-50 23.5M, FPN with P6 "
        "from C5 8.0M, head 6.5M)"),
    "A100": Reference(
        "A100", Range(19.0, 21.5, 24.0), None, 2, None,
        "torchvision detection reference training of retinanet_resnet50_fpn: about 19-24 images/s "
        "per A100 (fp32/TF32), FrozenBN ImageNet backbone; throughput only (memory from the V100 "
        "reference)"),
}
#: Pixels per training image of the references over 640 x 640: a 4:3 COCO image at shorter side
#: 800 is 800 x 1067 (2.08); padding to the batch's largest image and the 1333 cap raise it (2.6
#: for 800 x 1333).
PIXEL_RATIO = Range(2.08, 2.2, 2.6)
#: Time of our recipe over the reference's at equal FLOPs: SyncBN in backbone, FPN and head (extra
#: kernels and all-reduces) and nothing frozen (the reference computes no weight gradients for
#: its stem and res2).
RECIPE_OVERHEAD = Range(1.0, 1.1, 1.25)
#: Activation memory of our recipe over the reference's at equal FLOPs: stem and res2 (the
#: largest maps) keep their activations for weight gradients, BatchNorm its inputs.
RECIPE_MEMORY = Range(1.0, 1.25, 1.5)
#: Time of one attention FLOP in convolution FLOPs (``kappa``). ``global`` (AA: every position
#: attends to all of its map; fused scaled-dot-product kernels run near matmul speed, the relative
#: logits around them do not); ``local`` (SASA layer and stem: k x k neighbourhoods, memory-bound:
#: a fused kernel reaches a few times below a convolution's speed, an unfold-based route tens).
ATTENTION_COST: Dict[str, Range] = {"global": Range(1.0, 2.0, 4.0), "local": Range(4.0, 15.0, 50.0)}
#: An 8-GPU iteration over the single-GPU benchmark step at the same per-GPU batch.
DDP_OVERHEAD = Range(1.05, 1.1, 1.25)


class ConfigFacts(NamedTuple):
    """What the table needs of one config (from the config file and ``docs/model_table.md``)."""

    name: str  # config name without .yaml
    gflops: float  # per 640 x 640 image, the papers' FLOPs
    attention_gflops: float
    params_m: float
    attention: Optional[str]  # None, "global" or "local"
    ims_per_batch: int
    epochs: float
    precision: str = "fp32"


class CostRow(NamedTuple):
    name: str
    source: str  # "measured" or "estimated"
    gpu: str
    iterations: int
    s_per_iter: Range
    memory_gib: Range
    memory_source: str  # "measured" or "estimated"

    @property
    def wall_h(self) -> Range:
        return Range(*(self.iterations * s / 3600 for s in self.s_per_iter))

    @property
    def gpu_hours(self) -> Range:
        return Range(*(NODE_GPUS * h for h in self.wall_h))


def schedule_iterations(epochs: float, num_images: int, ims_per_batch: int) -> int:
    """``ceil(epochs * num_images / ims_per_batch)``: the iterations of an epoch schedule (the
    conversion :func:`aadet.engine.schedule.epochs_to_iters` makes at the start of training)."""
    return int(math.ceil(epochs * num_images / ims_per_batch))


def auto_scale(solver: Dict[str, object], num_gpus: int) -> Dict[str, object]:
    """Detectron2's ``DefaultTrainer.auto_scale_workers`` on a dict of ``SOLVER`` values
    (``IMS_PER_BATCH``, ``BASE_LR``, ``MAX_ITER``, ``WARMUP_ITERS``, ``STEPS``,
    ``CHECKPOINT_PERIOD``, ``REFERENCE_WORLD_SIZE``): with ``REFERENCE_WORLD_SIZE`` R > 0 and
    ``num_gpus`` N != R, batch and LR x N/R, iterations / (N/R); with R = 0, unchanged."""
    out = dict(solver)
    ref = int(solver["REFERENCE_WORLD_SIZE"])
    if ref == 0 or ref == num_gpus:
        return out
    if int(solver["IMS_PER_BATCH"]) % ref:
        raise ValueError(f"SOLVER.IMS_PER_BATCH {solver['IMS_PER_BATCH']} is not a multiple of "
                         f"SOLVER.REFERENCE_WORLD_SIZE {ref}")
    scale = num_gpus / ref
    out["IMS_PER_BATCH"] = int(round(int(solver["IMS_PER_BATCH"]) * scale))
    out["BASE_LR"] = float(solver["BASE_LR"]) * scale
    for key in ("MAX_ITER", "WARMUP_ITERS", "CHECKPOINT_PERIOD"):
        out[key] = int(round(int(solver[key]) / scale))
    out["STEPS"] = tuple(int(round(s / scale)) for s in solver["STEPS"])
    out["REFERENCE_WORLD_SIZE"] = num_gpus
    return out


# ----------------------------------------------------------------------------- inputs
def read_model_table(text: str) -> Dict[str, Dict[str, float]]:
    """``{config name: {"gflops", "attention_gflops", "params_m", "input"}}`` from the model table
    of ``docs/model_table.md`` (columns found by their header: Config, Input, Params (M), GFLOPs,
    Attention GFLOPs; other columns may come and go)."""
    rows = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if not rows:
        raise ValueError("no markdown table found (expected docs/model_table.md's)")
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    need = ("Config", "Input", "Params (M)", "GFLOPs", "Attention GFLOPs")
    missing = [c for c in need if c not in header]
    if missing:
        raise ValueError(f"model table has no column(s) {missing}; its header: {header}")
    col = {c: header.index(c) for c in need}
    out = {}
    for ln in rows[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        name = cells[col["Config"]].strip("`").split("/")[-1]
        out[name] = {
            "gflops": float(cells[col["GFLOPs"]]),
            "attention_gflops": float(cells[col["Attention GFLOPs"]]),
            "params_m": float(cells[col["Params (M)"]]),
            "input": cells[col["Input"]],
        }
    return out


def bench_unusable(bench: Optional[dict]) -> Optional[str]:
    """Why ``docs/benchmarks_cuda.json`` cannot give measured rows (None: it can)."""
    if bench is None:
        return "docs/benchmarks_cuda.json does not exist"
    if list(bench.get("size") or []) != [640, 640] or bench.get("batch") != 8:
        return (f"docs/benchmarks_cuda.json was measured at {bench.get('size')}, batch "
                f"{bench.get('batch')}; the table needs 640 x 640, 8 images a GPU")
    return None


def measured_step(bench: Optional[dict], config: str, precision: str) -> Optional[Tuple[float, Optional[float], str]]:
    """``(train_ms, train_peak_mib, device_name)`` of ``config`` in ``precision`` from
    ``docs/benchmarks_cuda.json``; None when it is not there (or :func:`bench_unusable`)."""
    if bench_unusable(bench) is not None:
        return None
    for r in bench.get("configs", []):
        if r.get("config") == config and r.get("precision") == precision and r.get("train_ms"):
            return r["train_ms"], r.get("train_peak_mib"), bench.get("device_name", "?")
    return None


# ----------------------------------------------------------------------------- rows
def _combine(*factors: Range) -> Range:
    """Product of factors, each oriented so that ``high`` is the pessimistic end."""
    out = [1.0, 1.0, 1.0]
    for f in factors:
        out = [o * v for o, v in zip(out, f)]
    return Range(*out)


def _inverse(r: Range) -> Range:
    """``1 / r`` with the ends swapped: a large throughput is the optimistic (low-time) end."""
    return Range(1 / r.high, 1 / r.nominal, 1 / r.low)


def estimate_row(
    facts: ConfigFacts,
    reference_gflops: float,
    gpu: str = "A100",
    *,
    images_per_gpu: int = 8,
    num_images: int = COCO_TRAIN_IMAGES,
) -> CostRow:
    """The estimated row of one config (see the module docstring for the formula)."""
    if gpu not in REFERENCES:
        raise ValueError(f"no reference measurement for GPU {gpu!r}; known: {sorted(REFERENCES)}")
    ref = REFERENCES[gpu]
    kappa = ATTENTION_COST[facts.attention] if facts.attention else Range(1.0, 1.0, 1.0)
    conv = facts.gflops - facts.attention_gflops
    work = Range(*(conv + k * facts.attention_gflops for k in kappa))
    per_image = _combine(
        Range(*(w / reference_gflops for w in work)), _inverse(PIXEL_RATIO), RECIPE_OVERHEAD,
        _inverse(ref.images_per_s_per_gpu))
    step = Range(*(images_per_gpu * s for s in per_image))
    return CostRow(
        facts.name, "estimated", gpu, schedule_iterations(facts.epochs, num_images, facts.ims_per_batch),
        step, estimate_memory(facts, reference_gflops, images_per_gpu), "estimated")


def estimate_memory(facts: ConfigFacts, reference_gflops: float, images_per_gpu: int = 8) -> Range:
    """GiB per GPU at ``images_per_gpu`` images of 640 x 640 (module docstring: the method)."""
    ref = REFERENCES["V100"]  # the reference whose memory is published
    static_ref = 16 * ref.params_m * 1e6 / _GIB
    act_ref = ref.peak_gib - static_ref  # at ref.images_per_gpu images of r x 640 x 640 pixels
    per = act_ref / ref.images_per_gpu * images_per_gpu * facts.gflops / reference_gflops
    act = _combine(Range(per, per, per), _inverse(PIXEL_RATIO), RECIPE_MEMORY)
    static = 16 * facts.params_m * 1e6 / _GIB
    return Range(*(static + a for a in act))


def measured_row(facts: ConfigFacts, train_ms: float, peak_mib: Optional[float], device: str,
                 fallback_memory: Range, *, num_images: int = COCO_TRAIN_IMAGES) -> CostRow:
    """The measured row: the benchmark's step x :data:`DDP_OVERHEAD`; its peak memory."""
    step = Range(*(train_ms / 1e3 * f for f in DDP_OVERHEAD))
    if peak_mib:
        g = peak_mib / 1024
        memory, memory_source = Range(g, g, g), "measured"
    else:
        memory, memory_source = fallback_memory, "estimated"
    return CostRow(facts.name, "measured", device,
                   schedule_iterations(facts.epochs, num_images, facts.ims_per_batch), step, memory,
                   memory_source)


def cost_rows(configs: Sequence[ConfigFacts], reference_config: str, bench: Optional[dict] = None,
              gpu: str = "A100") -> List[CostRow]:
    """One row per config: measured where ``bench`` has the config, else estimated for ``gpu``.
    ``reference_config`` names the conv R50 whose FLOPs scale the references."""
    by_name = {c.name: c for c in configs}
    if reference_config not in by_name:
        raise ValueError(f"reference config {reference_config!r} not among {sorted(by_name)}")
    ref_gflops = by_name[reference_config].gflops
    rows = []
    for c in configs:
        est = estimate_row(c, ref_gflops, gpu)
        measured = measured_step(bench, c.name, c.precision)
        rows.append(est if measured is None else measured_row(c, *measured, est.memory_gib))
    return rows


# ----------------------------------------------------------------------------- markdown
def _r(r: Range, fmt: str) -> str:
    if r.low == r.high:
        return format(r.nominal, fmt)
    return f"{format(r.nominal, fmt)} ({format(r.low, fmt)}–{format(r.high, fmt)})"


COST_COLUMNS = ("Config", "Source", "GPU", "GFLOPs (attention)", "s / iter", "Iterations",
                "Wall-clock h", "GPU-hours", "GiB / GPU at 8 images")


def render_cost_table(rows: Sequence[CostRow], configs: Sequence[ConfigFacts]) -> str:
    """The cost table: nominal (low–high) for every range."""
    facts = {c.name: c for c in configs}
    lines = ["| " + " | ".join(COST_COLUMNS) + " |", "|:---|:---|:---|" + "---:|" * 6]
    for r in rows:
        f = facts[r.name]
        lines.append("| " + " | ".join([
            f"`{r.name}`", r.source, r.gpu, f"{f.gflops:.1f} ({f.attention_gflops:.2f})",
            _r(r.s_per_iter, ".3f"), f"{r.iterations:,}", _r(r.wall_h, ".1f"), _r(r.gpu_hours, ".0f"),
            _r(r.memory_gib, ".1f") + ("" if r.memory_source == r.source else f" ({r.memory_source})"),
        ]) + " |")
    return "\n".join(lines) + "\n"


def render_scaling_table(solver: Dict[str, object], gpu_counts: Sequence[int] = (1, 2, 4, 8, 16)) -> str:
    """Batch, LR and schedule on ``gpu_counts`` GPUs, as the config is (its own
    ``REFERENCE_WORLD_SIZE``) and with ``SOLVER.REFERENCE_WORLD_SIZE 8`` (Detectron2 rescales)."""
    lines = ["| GPUs | REFERENCE_WORLD_SIZE | IMS_PER_BATCH | images / GPU | BASE_LR | MAX_ITER | "
             "WARMUP_ITERS | STEPS | wall-clock vs 8 GPUs |",
             "|---:|---:|---:|---:|---:|---:|---:|:---|---:|"]
    for ref in sorted({int(solver["REFERENCE_WORLD_SIZE"]), NODE_GPUS}):
        for n in gpu_counts:
            s = auto_scale(dict(solver, REFERENCE_WORLD_SIZE=ref), n)
            per_gpu = s["IMS_PER_BATCH"] / n
            # Per-GPU throughput taken as constant: time ~ iterations x images per GPU.
            rel = s["MAX_ITER"] * per_gpu / (int(solver["MAX_ITER"]) * int(solver["IMS_PER_BATCH"]) / NODE_GPUS)
            lines.append(
                f"| {n} | {ref} | {s['IMS_PER_BATCH']} | {per_gpu:g} | {s['BASE_LR']:g} | "
                f"{s['MAX_ITER']:,} | {s['WARMUP_ITERS']:,} | {', '.join(f'{x:,}' for x in s['STEPS'])} | "
                f"{rel:.2f}x |")
    return "\n".join(lines) + "\n"


def render_assumptions(gpu: str) -> str:
    """The constants the estimates use, one line each (for the doc, printed by the tool)."""
    ref = REFERENCES[gpu]
    lines = [
        f"* training images: {COCO_TRAIN_IMAGES:,} (COCO train2017 with annotations)",
        f"* reference ({gpu}): {ref.images_per_s_per_gpu.low:.2f}–{ref.images_per_s_per_gpu.high:.2f} "
        f"images/s per GPU; {ref.source}",
        f"* memory reference (V100): {REFERENCES['V100'].peak_gib} GB at "
        f"{REFERENCES['V100'].images_per_gpu} images/GPU, {REFERENCES['V100'].params_m}M params",
        f"* pixel ratio r (reference image / 640x640): {PIXEL_RATIO.nominal} ({PIXEL_RATIO.low}–{PIXEL_RATIO.high})",
        f"* recipe time factor (SyncBN, nothing frozen): {RECIPE_OVERHEAD.nominal} "
        f"({RECIPE_OVERHEAD.low}–{RECIPE_OVERHEAD.high}); memory factor {RECIPE_MEMORY.nominal} "
        f"({RECIPE_MEMORY.low}–{RECIPE_MEMORY.high})",
    ]
    lines += [f"* attention cost kappa, {k}: {v.nominal:g} ({v.low:g}–{v.high:g}) convolution FLOPs per attention FLOP"
              for k, v in ATTENTION_COST.items()]
    lines.append(f"* measured rows: 8-GPU iteration = single-GPU benchmark step x {DDP_OVERHEAD.nominal} "
                 f"({DDP_OVERHEAD.low}–{DDP_OVERHEAD.high})")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the doc's block
#: The markers of the generated block in ``docs/reproduce_coco.md``.
BEGIN, END = "<!-- coco-cost:begin -->", "<!-- coco-cost:end -->"
COMMAND = "python dev/coco_cost.py"
#: The config the estimates are scaled from (the conv R50, as the public references).
REFERENCE_CONFIG = "retinanet_R_50_FPN_scratch_150ep"


def coco_configs(repo: str) -> List[str]:
    """The COCO configs of the checkout ``repo``, sorted."""
    return sorted(glob.glob(os.path.join(repo, "configs", "COCO-Detection", "*.yaml")))


def _attention_kind(cfg) -> Optional[str]:
    name = cfg.MODEL.BACKBONE.NAME
    if "sasa" in name:
        return "local"
    if "_aa_" in name:
        return "global"
    return None


def config_facts(config_file: str, flops: Dict[str, Dict[str, float]]):
    """``(ConfigFacts, cfg)`` of ``config_file``, its FLOPs from ``flops`` (a model table read by
    :func:`read_model_table`, or :func:`count_flops`).

    Raises:
        ValueError: the config is not in ``flops``, or not counted at 640x640.
    """
    from aadet.engine import load_config

    cfg = load_config(config_file, ["MODEL.DEVICE", "cpu"])
    name = os.path.splitext(os.path.basename(config_file))[0]
    if name not in flops:
        raise ValueError(f"{name} is not in the model table: run `make docs` or pass --count-flops")
    f = flops[name]
    if f["input"].split()[0] != "640":
        raise ValueError(f"{name}: model table FLOPs are at {f['input']}, the table needs 640")
    return ConfigFacts(
        name=name, gflops=f["gflops"], attention_gflops=f["attention_gflops"], params_m=f["params_m"],
        attention=_attention_kind(cfg), ims_per_batch=cfg.SOLVER.IMS_PER_BATCH, epochs=cfg.SOLVER.EPOCHS,
        precision="fp32" if not cfg.SOLVER.AMP.ENABLED else "bf16",
    ), cfg


def count_flops(config_files: Sequence[str]) -> Dict[str, Dict[str, float]]:
    """What :func:`read_model_table` reads, counted by building each model (minutes)."""
    from aadet.analysis.model_stats import analyze_config

    out = {}
    for path in config_files:
        row = analyze_config(path, (640, 640))
        out[os.path.splitext(os.path.basename(path))[0]] = {
            "gflops": 2 * row.flops["total"] / 1e9, "attention_gflops": 2 * row.flops["attention"] / 1e9,
            "params_m": row.params["total"] / 1e6, "input": "640"}
    return out


def _solver_values(cfg) -> Dict[str, object]:
    from aadet.engine import epochs_to_iters

    s = cfg.SOLVER
    return {
        "IMS_PER_BATCH": s.IMS_PER_BATCH, "BASE_LR": s.BASE_LR, "WARMUP_ITERS": s.WARMUP_ITERS,
        "MAX_ITER": epochs_to_iters(s.EPOCHS, COCO_TRAIN_IMAGES, s.IMS_PER_BATCH),
        "STEPS": tuple(epochs_to_iters(e, COCO_TRAIN_IMAGES, s.IMS_PER_BATCH) for e in s.STEPS_EPOCHS),
        "CHECKPOINT_PERIOD": s.CHECKPOINT_PERIOD, "REFERENCE_WORLD_SIZE": s.REFERENCE_WORLD_SIZE,
    }


def render_block(config_files: Sequence[str], flops: Dict[str, Dict[str, float]], flops_from: str,
                 bench: Optional[dict], gpu: str = "A100") -> str:
    """The generated block (``BEGIN`` ... ``END``, with a final newline): the assumptions, the cost
    table of ``config_files`` (one of them :data:`REFERENCE_CONFIG`) and the scaling table.

    Args:
        flops: per config name, as :func:`read_model_table` returns; ``flops_from`` says where
            they come from (shown in the block).
        bench: ``docs/benchmarks_cuda.json`` (None: no measured rows).
        gpu: the GPU the estimates are for (a key of :data:`REFERENCES`).
    """
    pairs = [config_facts(c, flops) for c in config_files]
    facts = [p[0] for p in pairs]
    rows = cost_rows(facts, REFERENCE_CONFIG, bench, gpu)
    solver = _solver_values(dict((p[0].name, p[1]) for p in pairs)[REFERENCE_CONFIG])
    why = bench_unusable(bench)
    out = [
        BEGIN,
        f"<!-- generated by `{COMMAND}{' --gpu ' + gpu if gpu != 'A100' else ''}`; "
        "method and constants: dev/aadet_dev/cost.py -->",
        "",
        f"Schedule: {facts[0].epochs:g} epochs x {COCO_TRAIN_IMAGES:,} images / batch "
        f"{facts[0].ims_per_batch} on {NODE_GPUS} GPUs ({facts[0].ims_per_batch // NODE_GPUS} "
        f"images per GPU); FLOPs per 640x640 image from {flops_from}. Measured rows: "
        + (f"none ({why})." if why else f"{bench.get('device_name')}, docs/benchmarks_cuda.json."),
        "Ranges: nominal (optimistic–pessimistic end of every factor).",
        "",
        render_assumptions(gpu),
        render_cost_table(rows, facts),
        f"Batch and LR on other GPU counts (`{REFERENCE_CONFIG}`; every COCO config has the same "
        "SOLVER):",
        "",
        render_scaling_table(solver),
        END,
    ]
    return "\n".join(out) + "\n"


def replace_block(text: str, block: str) -> str:
    """``text`` with its part from ``BEGIN`` to ``END`` (inclusive) replaced by ``block``
    (:func:`render_block`'s).

    Raises:
        ValueError: ``text`` has no such part.
    """
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    return head + block.rstrip("\n") + rest.split(END, 1)[1]
