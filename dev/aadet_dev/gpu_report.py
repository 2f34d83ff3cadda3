"""The GPU check's report: benchmark JSON -> ``docs/benchmarks_cuda.json`` with target verdicts,
pytest junit XML -> a test summary, and the stages of ``dev/gpu_check.py`` merged into one
``report.md`` / ``report.json``.

Everything here is a pure function of dicts / XML text (no CUDA, no model): the GPU machine runs
the tools, this module reads what they wrote, and CPU unit tests feed it synthetic inputs
(``dev/tests/test_gpu_check.py``).

The benchmark schema (``docs/benchmarks_cuda.json``, ``"schema": 1``)::

    {"schema": 1, "device_name": "NVIDIA H100 80GB HBM3", "torch": ..., "cuda": ..., "size": [640, 640],
     "batch": 8, "baseline": "retinanet_R_50_FPN_scratch_150ep",
     "configs": [{"config": "aa_retinanet_R_50_FPN_scratch_150ep", "precision": "bf16",
                  "train_ms": .., "infer_ms": .., "train_peak_mib": ..,
                  "train_ms_ratio": .., "infer_ms_ratio": .., "train_peak_mib_ratio": ..}, ...],
     "layers":  [{"layer": "sasa_fused_80", "label": .., "precision": "fp32", "side": 80,
                  "channels": 256, "train_ms": .. (forward + backward), "train_peak_mib": ..,
                  "train_ms_ratio": .., "train_peak_mib_ratio": ..}, ...],   # ratios to the 3x3 conv
     "informational_missing": ["halo bf16", ...],
     "targets": [{"target": "AA-R50 train time", "subject": .., "metric": "train_ms_ratio",
                  "precision": "bf16", "limit": 1.10, "value": 1.32, "status": "miss",
                  "excess": 0.22, "excess_pct": 20.0, "bound": "..."}, ...]}

A row measured with ``--profile`` (the benchmarks stage's) also holds ``train_profile`` /
``infer_profile``: its phase's device time by kind of work (:func:`profile_summary`); a time
target's verdict then says what bounds it (``"bound"``, :func:`describe_bound`): whether the GPU
was busy through the step or waited on the host, and which kinds of work take the time the
subject spends beyond its baseline's.

Ratios are to the baseline of the *same run and precision* (configs: the conv R50 RetinaNet;
layers: a 3x3 convolution of the same width and map size), so they compare like with like.
``status`` is ``"pass"`` (value <= limit), ``"miss"`` (then ``excess = value - limit`` and
``excess_pct = 100 * (value / limit - 1)`` say by how much) or ``"missing"`` (the case was not
measured or failed: the report says so instead of passing it). Every target gets a verdict in
every precision of :data:`PROTOCOL`, measured or not. The targets are defined at :data:`PROTOCOL`
(size, batch, precisions, least iterations); numbers measured otherwise (``--quick``, a smoke run,
too few iterations, a precision not measured) get ``"comparable": false``, the reasons in
``"not_comparable_why"``, and ``status`` ``"not comparable"`` instead of a verdict. ``"missing"``
lists the benchmark rows (``"<config> <precision>"``, ``"layers <precision>"``) not measured;
``"complete"``: comparable, nothing missing, every target a pass or a miss. The layer rows also
hold the suites of :data:`INFORMATIONAL_LAYER_SUITES` (HaloNet's layer), reported as measured with
their ratios to their own 3x3 conv and judged by no target: where one was not measured,
``"informational_missing"`` says so (``"<suite> <precision>"``), and neither ``"missing"`` nor
``"complete"`` depends on them. Only a complete run of
a benchmarks stage that passed is the record (``docs/benchmarks_cuda.json``); anything else goes to
a scratch file whose ``"scratch"`` says why it is not the record.

The merged report has two verdicts: ``status`` (did every required stage run on CUDA, at the
checked-out clean commit, and pass: :func:`stage_problems`) and ``targets`` (were the performance
targets met: :func:`targets_verdict`). A stage can pass while targets are missed.
"""

import json
import os
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from aadet.benchmark.report import markdown_table, mib, ratio

__all__ = [
    "SCHEMA_VERSION",
    "BASELINE_CONFIG",
    "BENCHMARK_CONFIGS",
    "LAYER_REFERENCE",
    "INFORMATIONAL_LAYER_SUITES",
    "COMPILED_CONFIGS",
    "COMPILED_PRECISION",
    "compiled_rows",
    "PRECISIONS",
    "Target",
    "TARGETS",
    "precision_name",
    "config_name",
    "config_rows",
    "layer_rows",
    "evaluate_targets",
    "HOST_BOUND_BUSY",
    "profile_summary",
    "describe_bound",
    "benchmarks_cuda",
    "render_benchmarks_markdown",
    "render_targets_markdown",
    "Protocol",
    "PROTOCOL",
    "AMP_DTYPES",
    "NOT_COMPARABLE",
    "parse_junit",
    "tests_stage_result",
    "STAGES",
    "LOAN_PLAN",
    "LOAN_LEFT_OUT",
    "loan_plan_lines",
    "StaleStageError",
    "stale_stages",
    "stage_problems",
    "targets_verdict",
    "merge_stage_results",
    "render_report_markdown",
]

SCHEMA_VERSION = 1

# ----------------------------------------------------------------------------- what is measured
#: The conv R50 RetinaNet every config ratio is taken against (same run, same precision).
BASELINE_CONFIG = "configs/COCO-Detection/retinanet_R_50_FPN_scratch_150ep.yaml"
#: The benchmark configs: the baseline first, then the attention models that have targets.
BENCHMARK_CONFIGS = (
    BASELINE_CONFIG,
    "configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep.yaml",
    # SASA attention backbone: every spatial 3x3 conv of res2-res5 is local attention (conv stem).
    "configs/COCO-Detection/sasa_convstem_retinanet_R_50_FPN_scratch_150ep.yaml",
    # SASA all-attention: attention stem, backbone, FPN and head.
    "configs/COCO-Detection/sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep.yaml",
    # HaloNet: every spatial 3x3 conv of res2-res5 is blocked local attention (b 8, h 3).
    "configs/COCO-Detection/halo_retinanet_R_50_FPN_scratch_150ep.yaml",
)
#: The layer every layer ratio is taken against (``dev/benchmark_layers.py``'s impl name).
LAYER_REFERENCE = "conv3x3"
#: The ``dev/benchmark_layers.py`` suites the benchmarks stage measures besides SASA's (whose
#: rows the layer targets judge): reported as measured, with their ratios to a 3x3 conv, without a
#: target. HaloNet's layer (256 ch, b 8, h 3, 8 heads, its CUDA routes).
INFORMATIONAL_LAYER_SUITES = ("halo",)
#: ``MODEL.COMPILE`` measured as an option, without a target: these configs compiled (Inductor,
#: ``MODE "default"``) in :data:`COMPILED_PRECISION`, after every eager case and layer of the
#: benchmarks stage, with what is left of its budget (the baseline first: AA-R50's steps are
#: launch-bound, which compiling addresses). Each compiled row: its ratio to the compiled baseline,
#: and ``eager_train_ms_ratio`` / ``eager_infer_ms_ratio``: its time over its own eager time.
COMPILED_CONFIGS = (BASELINE_CONFIG, "configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep.yaml")
COMPILED_PRECISION = "bf16"
#: Precision names used in the report; ``tools/benchmark*.py`` report ``amp`` (bool) and
#: ``amp_dtype`` (torch dtype name).
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPE_TO_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "bf16": "bf16",
                       "fp16": "fp16", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


class Target(NamedTuple):
    """One performance target: ``metric`` of ``subject`` must be <= ``limit``.

    ``section`` is ``"configs"`` (subject: a config name, no ``.yaml``) or ``"layers"`` (subject:
    a layer row name; a name ending in ``*`` matches every route of that layer, e.g.
    ``"sasa_*_80"``: each route gets its own verdict).
    """

    name: str
    section: str
    subject: str
    metric: str
    limit: float


_AA = "aa_retinanet_R_50_FPN_scratch_150ep"
_SASA = "sasa_convstem_retinanet_R_50_FPN_scratch_150ep"
_SASA_FULL = "sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"
_HALO = "halo_retinanet_R_50_FPN_scratch_150ep"
#: The performance targets: the attention models' speed and memory as
#: ratios to the conv R50 RetinaNet, the SASA layer's to a 3x3 conv (one definition; every
#: precision measured gets a verdict; bf16 AMP is the one the targets are about, fp32 beside it).
#: AA-R50's training step has two: 1.25x first, then 1.10x.
TARGETS = (
    Target("AA-R50 RetinaNet train time", "configs", _AA, "train_ms_ratio", 1.10),
    Target("AA-R50 RetinaNet train time, first step", "configs", _AA, "train_ms_ratio", 1.25),
    Target("AA-R50 RetinaNet inference time", "configs", _AA, "infer_ms_ratio", 1.30),
    Target("AA-R50 RetinaNet train memory", "configs", _AA, "train_peak_mib_ratio", 1.30),
    Target("SASA attention-backbone RetinaNet train time", "configs", _SASA, "train_ms_ratio", 1.5),
    Target("SASA all-attention RetinaNet train time", "configs", _SASA_FULL, "train_ms_ratio", 2.0),
    Target("HaloNet R50 RetinaNet train time", "configs", _HALO, "train_ms_ratio", 1.3),
    Target("LocalSelfAttention2d 256 ch k 7 80x80 fwd+bwd time vs 3x3 conv", "layers", "sasa_*_80",
           "train_ms_ratio", 1.0),
    Target("LocalSelfAttention2d 256 ch k 7 80x80 fwd+bwd memory vs 3x3 conv", "layers",
           "sasa_*_80", "train_peak_mib_ratio", 2.0),
)


class Protocol(NamedTuple):
    """What the targets are defined at, and the least a measurement must do to be held against them."""

    size: Tuple[int, int]  # detector input (H, W); the layer benchmark runs at the same batch
    batch: int
    precisions: Tuple[str, ...]  # each gets its own verdict per target; fp32 = no autocast
    min_iters: int  # timed iterations of each case (its median is the number)
    min_warmup: int  # untimed iterations before them


#: The targets' protocol (one definition; ``dev/gpu_check.py`` derives its benchmark arguments
#: from it): detectors on 640x640 images, batch 8, fp32 and bf16 autocast, the median of at least
#: 10 timed iterations after at least 3 warm-up ones. Numbers measured otherwise are not compared
#: with the targets and never become the record.
PROTOCOL = Protocol(size=(640, 640), batch=8, precisions=("fp32", "bf16"), min_iters=10, min_warmup=3)
#: The autocast dtype (``--amp-dtype`` of the benchmark tools) of each AMP precision.
AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
#: The verdict of a target measured at other sizes (a ``--quick`` smoke run).
NOT_COMPARABLE = "smoke run, not comparable to targets"


def precision_name(amp: bool, amp_dtype: Optional[str]) -> str:
    """``"fp32"`` without AMP, else ``"bf16"`` / ``"fp16"`` from the autocast dtype's name."""
    if not amp:
        return "fp32"
    if amp_dtype is None:
        raise ValueError("an AMP result needs its autocast dtype (amp_dtype: bfloat16 or float16)")
    key = str(amp_dtype).lower()
    if key not in _DTYPE_TO_PRECISION:
        raise ValueError(f"unknown amp_dtype {amp_dtype!r}; expected one of {sorted(_DTYPE_TO_PRECISION)}")
    return _DTYPE_TO_PRECISION[key]


def config_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _ms(section: Optional[dict]) -> Optional[float]:
    return None if not section or section.get("median_s") is None else 1e3 * section["median_s"]


def _mib(section: Optional[dict]) -> Optional[float]:
    return None if not section else mib(section.get("peak_bytes"))


# ----------------------------------------------------------------------------- benchmark JSON
def config_rows(report: dict, amp_dtype: Optional[str] = None) -> List[dict]:
    """Rows of ``tools/benchmark.py --output-json`` (one per config and AMP mode) with ratios.

    Args:
        report: the benchmark JSON (``results[i]``: ``config``, ``amp``, ``train.median_s``,
            ``train.peak_bytes``, ``inference.median_s``; failed cases carry ``error``).
        amp_dtype: autocast dtype of its AMP results when the JSON does not say it (a result's
            or the report's own ``amp_dtype`` wins).

    Returns:
        ``[{"config", "precision", "train_ms", "infer_ms", "train_peak_mib", "*_ratio", "error"}]``;
        ratios are to ``report["baseline"]`` with the same precision (None where either is missing).
    """
    rows = []
    for r in report["results"]:
        dtype = r.get("amp_dtype", report.get("amp_dtype", amp_dtype))
        row = {
            "config": config_name(r["config"]),
            "precision": precision_name(bool(r.get("amp")), dtype),
            "train_ms": _ms(r.get("train")),
            "infer_ms": _ms(r.get("inference")),
            "train_peak_mib": _mib(r.get("train")),
        }
        for phase, key in (("train", "train"), ("inference", "infer")):
            if (r.get(phase) or {}).get("profile"):
                row[f"{key}_profile"] = profile_summary(r[phase]["profile"])
        if "error" in r:
            row["error"] = str(r["error"])[:300]
        elif "train_time" in r.get("ratio_ranges", {}):  # several rounds, or interleaved
            row["train_ms_ratio_range"] = r["ratio_ranges"]["train_time"]
        rows.append(row)
    base = {row["precision"]: row for row in rows if row["config"] == config_name(report["baseline"])}
    for row, r in zip(rows, report["results"]):
        b = base.get(row["precision"], {})
        for key in ("train_ms", "infer_ms", "train_peak_mib"):
            row[key + "_ratio"] = ratio(row[key], b.get(key))
        if report.get("interleave") and row["train_ms_ratio"] is not None:
            row["train_ms_ratio"] = r["ratios"]["train_time"]  # the median of the paired iterations
    return rows


def layer_rows(report: dict, amp_dtype: Optional[str] = None) -> List[dict]:
    """Rows of ``dev/benchmark_layers.py --output-json`` with ratios to the 3x3 conv.

    Only layers that have a :data:`LAYER_REFERENCE` case of their suite at the same map size get
    ratios (the SASA and HaloNet suites); each row is named ``<suite>_<impl>_<side>``
    (``"sasa_fused_80"``, ``"halo_fused_80"``).
    ``train_ms`` is the forward + backward time, ``train_peak_mib`` its peak memory.
    """
    precision = precision_name(bool(report.get("amp")), report.get("amp_dtype", amp_dtype))
    rows = []
    for r in report["results"]:
        if r.get("suite") is None or r.get("kind") != "layer":
            continue
        row = {
            "layer": f"{r['suite']}_{r['impl']}_{r['side']}",
            "suite": r["suite"],
            "impl": r["impl"],
            "precision": precision,
            "side": r["side"],
            "channels": r.get("channels"),
            "train_ms": None if r.get("median_s") is None else 1e3 * r["median_s"],
            "train_peak_mib": mib(r.get("peak_bytes")),
        }
        if "error" in r or "skipped" in r:
            row["error"] = str(r.get("error") or r.get("skipped"))[:300]
        if r.get("profile"):
            row["train_profile"] = profile_summary(r["profile"])
        if r.get("round_medians_s"):  # a run of several rounds
            row["round_ms"] = [1e3 * t for t in r["round_medians_s"]]
        rows.append(row)
    ref = {(row["suite"], row["side"]): row for row in rows if row["impl"] == LAYER_REFERENCE}
    for row in rows:
        b = ref.get((row["suite"], row["side"]))
        for key in ("train_ms", "train_peak_mib"):
            row[key + "_ratio"] = None if b is None else ratio(row[key], b[key])
        if b is not None and row.get("round_ms") and b.get("round_ms"):
            per_round = [t / tb for t, tb in zip(row["round_ms"], b["round_ms"])]
            row["train_ms_ratio_range"] = [min(per_round), max(per_round)]
    return [row for row in rows if (row["suite"], row["side"]) in ref]


#: Below this share of a step's timed median spent in device work (the profiled call's operators'
#: self time on the GPU), the step is host-bound: the GPU waits on Python and kernel launches, and
#: faster kernels would not shorten it (fewer launches would: fusion, CUDA graphs, compiling).
HOST_BOUND_BUSY = 0.7
#: Kinds of work (``aadet.benchmark.step_profile.CATEGORIES``) a bound names, the largest first.
_BOUND_KINDS = 2


def profile_summary(profile: dict, top: int = 5) -> dict:
    """A phase's profile (``aadet.benchmark.step_profile.profile_call``) as a report row keeps it:
    device time, device events, time by kind of work, the ``top`` operators, the host's syncs and
    the operators it dispatched."""
    return {"device_ms": profile["device_ms"], "device_events": profile.get("device_events"),
            "categories": dict(profile["categories"]), "top": list(profile.get("top", ()))[:top],
            "host_syncs": dict(profile.get("host_syncs") or {}), "host_ops": profile.get("host_ops")}


def describe_bound(row: dict, base: Optional[dict], phase: str = "train") -> Optional[str]:
    """What bounds ``row``'s ``phase`` (``"train"`` or ``"infer"``) from its profile and its
    baseline's (``base``: the baseline config's or the 3x3 conv's row of the same precision):
    ``"host-bound: ..."`` where the device worked under :data:`HOST_BOUND_BUSY` of the timed
    median (with the operators the host dispatched and its waits for the device, the baseline's
    beside them: a host-bound step's time follows its operators), else ``"device-bound: ..."``;
    then the kinds of work that take the time the row spends beyond the baseline's, each with its
    largest operator. None without a profile."""
    p, ms = row.get(f"{phase}_profile"), row.get(f"{phase}_ms")
    if not p or not ms:
        return None
    busy = p["device_ms"] / ms
    events = f", {p['device_events']} kernels" if p.get("device_events") else ""
    kind = "host-bound" if busy < HOST_BOUND_BUSY else "device-bound"
    b = (base or {}).get(f"{phase}_profile")
    if kind == "host-bound" and p.get("host_ops"):
        base_ops = (b or {}).get("host_ops")
        events += f", {p['host_ops']} operators" + (f" ({p['host_ops'] / base_ops:.2f}x the baseline's)"
                                                    if base_ops else "")
    syncs = sum((p.get("host_syncs") or {}).values())
    if kind == "host-bound" and syncs:  # each stops the host from queueing work ahead
        base_syncs = f" (baseline {sum((b.get('host_syncs') or {}).values())})" if b else ""
        events += f", {syncs} host syncs{base_syncs}"
    head = f"{kind}: device busy {busy:.0%} of {ms:.1f} ms{events}"
    cats = p["categories"]
    if b:
        extra = {c: ms_c - b["categories"].get(c, 0.0) for c, ms_c in cats.items()}
        ranked = [c for c in sorted(extra, key=lambda c: -extra[c]) if extra[c] > 0][:_BOUND_KINDS]
        what = "beyond the baseline's device time"
        amounts = {c: f"+{extra[c]:.1f} ms" for c in ranked}
    else:
        ranked = [c for c in sorted(cats, key=lambda c: -cats[c]) if cats[c] > 0][:_BOUND_KINDS]
        what = "device time"
        amounts = {c: f"{cats[c]:.1f} ms" for c in ranked}
    parts = []
    for c in ranked:
        ops = [o for o in p.get("top", ()) if o.get("category") == c]
        parts.append(f"{c} {amounts[c]}" + (f" ({ops[0]['op']} {ops[0]['ms']:.1f} ms)" if ops else ""))
    return head + (f"; {what}: " + ", ".join(parts) if parts else "")


def _baseline_row(t: "Target", r: dict, rows: Sequence[dict]) -> Optional[dict]:
    """The row ``r``'s ratios are taken against: the baseline config's, or the 3x3 conv's of its
    suite and map, in ``r``'s precision."""
    if t.section == "configs":
        name = config_name(BASELINE_CONFIG)
        return next((b for b in rows if b["config"] == name and b["precision"] == r["precision"]), None)
    return next((b for b in rows if b.get("impl") == LAYER_REFERENCE and b.get("suite") == r.get("suite")
                 and b.get("side") == r.get("side") and b["precision"] == r["precision"]), None)


#: The phase of a time metric, whose profile says what bounds it (memory metrics have none).
_METRIC_PHASE = {"train_ms_ratio": "train", "infer_ms_ratio": "infer"}


def _matches(pattern: str, name: str) -> bool:
    if "*" not in pattern:
        return pattern == name
    head, tail = pattern.split("*", 1)
    return name.startswith(head) and name.endswith(tail) and len(name) >= len(head) + len(tail)


def evaluate_targets(
    configs: Sequence[dict],
    layers: Sequence[dict],
    targets: Iterable[Target] = TARGETS,
    *,
    precisions: Sequence[str] = PROTOCOL.precisions,
    comparable: bool = True,
) -> List[dict]:
    """A verdict per target and precision (see the module docstring for the fields).

    Every precision of ``precisions`` gets a verdict for every target, measured or not (a
    precision the device could not run is ``"missing"``, not absent); a precision measured
    beyond them gets its verdicts too. ``comparable=False`` (numbers not measured at
    :data:`PROTOCOL`): a measured value gets ``status`` ``"not comparable"``, never ``"pass"`` or
    ``"miss"``.
    """
    rows = {"configs": list(configs), "layers": list(layers)}
    key = {"configs": "config", "layers": "layer"}
    measured = {r["precision"] for r in rows["configs"] + rows["layers"]}
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        raise ValueError(f"precisions must be among {list(PRECISIONS)}; got {unknown}")
    precisions = [p for p in PRECISIONS if p in precisions or p in measured]
    out = []
    for t in targets:
        if t.section not in rows:
            raise ValueError(f"target {t.name!r}: section must be 'configs' or 'layers'; got {t.section!r}")
        for p in precisions:
            hits = [r for r in rows[t.section] if r["precision"] == p and _matches(t.subject, r[key[t.section]])]
            if t.section == "layers":  # the reference itself is not a subject
                hits = [r for r in hits if r.get("impl") != LAYER_REFERENCE]
            for r in hits or [None]:
                value = None if r is None or "error" in r else r.get(t.metric)
                v = {
                    "target": t.name,
                    "subject": t.subject if r is None else r[key[t.section]],
                    "metric": t.metric,
                    "precision": p,
                    "limit": t.limit,
                    "value": value,
                }
                if value is not None and r.get(t.metric + "_range"):
                    v["range"] = r[t.metric + "_range"]  # its spread: rounds or interleaved pairs
                if value is not None and t.metric in _METRIC_PHASE:
                    bound = describe_bound(r, _baseline_row(t, r, rows[t.section]), _METRIC_PHASE[t.metric])
                    if bound:
                        v["bound"] = bound
                if value is None:
                    why = "not measured" if r is None else (r.get("error") or "no baseline to compare with")
                    v.update(status="missing", note=why)
                elif not comparable:
                    v.update(status="not comparable", note=NOT_COMPARABLE)
                elif value <= t.limit:
                    v.update(status="pass", excess=0.0, excess_pct=0.0)
                else:
                    v.update(status="miss", excess=value - t.limit, excess_pct=100.0 * (value / t.limit - 1.0))
                out.append(v)
    return out


def describe_protocol(protocol: Protocol = PROTOCOL) -> str:
    """``"640x640, batch 8, fp32 and bf16, >= 10 timed iterations after >= 3 warm-up"``."""
    return (f"{protocol.size[0]}x{protocol.size[1]}, batch {protocol.batch}, {' and '.join(protocol.precisions)}, "
            f">= {protocol.min_iters} timed iterations after >= {protocol.min_warmup} warm-up")


def _not_comparable_why(reports: Sequence[dict], layer_reports: Sequence[dict], rows: Sequence[dict],
                        smoke: bool, protocol: Protocol = PROTOCOL) -> Optional[str]:
    """Why the numbers of ``reports`` (detectors) and ``layer_reports`` cannot be held against
    the targets (None: they can): a smoke run, another size or batch, fewer iterations than the
    protocol's least, a precision of the protocol with no measured row, a device that is not CUDA."""
    why = ["a --quick smoke run"] if smoke else []
    for r in reports:
        if r.get("size") is not None and list(r["size"]) != list(protocol.size):
            why.append(f"images {'x'.join(str(s) for s in r['size'])}")
    for r, what in [(r, "batch") for r in reports] + [(r, "layer batch") for r in layer_reports]:
        if r.get("batch") is not None and r["batch"] != protocol.batch:
            why.append(f"{what} {r['batch']}")
    for r in list(reports) + list(layer_reports):
        if (r.get("iters") or 0) < protocol.min_iters:
            why.append(f"{r.get('iters')} timed iterations (< {protocol.min_iters})")
        if (r.get("warmup") or 0) < protocol.min_warmup:
            why.append(f"{r.get('warmup')} warm-up iterations (< {protocol.min_warmup})")
        if not str(r.get("device", "cuda")).startswith("cuda"):
            why.append(f"device {r.get('device')}")
    measured = {row["precision"] for row in rows if row.get("train_ms") is not None and "error" not in row}
    why += [f"no {p} measurement" for p in protocol.precisions if p not in measured]
    why = list(dict.fromkeys(why))  # each reason once, in order
    if not why:
        return None
    return f"{', '.join(why)}; the targets are defined at {describe_protocol(protocol)}"


def _measured(row: dict) -> bool:
    return row.get("train_ms") is not None and "error" not in row


def missing_rows(configs: Sequence[dict], layers: Sequence[dict], expected_configs: Sequence[str] = BENCHMARK_CONFIGS,
                 precisions: Sequence[str] = PROTOCOL.precisions) -> List[str]:
    """The benchmark rows not measured: ``"<config> <precision>"`` for each of ``expected_configs``
    and ``"layers <precision>"`` when no layer was measured in that precision (the suites of
    :data:`INFORMATIONAL_LAYER_SUITES` aside: :func:`informational_missing`)."""
    got = {(r["config"], r["precision"]) for r in configs if _measured(r)}
    missing = [f"{config_name(c)} {p}" for c in expected_configs for p in precisions
               if (config_name(c), p) not in got]
    layer_precisions = {r["precision"] for r in layers
                        if _measured(r) and r.get("suite") not in INFORMATIONAL_LAYER_SUITES}
    return missing + [f"layers {p}" for p in precisions if p not in layer_precisions]


def informational_missing(layers: Sequence[dict], precisions: Sequence[str] = PROTOCOL.precisions,
                          suites: Sequence[str] = INFORMATIONAL_LAYER_SUITES) -> List[str]:
    """``"<suite> <precision>"`` for each of ``suites`` with no layer of its own (the 3x3 conv
    aside) measured against its 3x3 conv in that precision."""
    got = {(r.get("suite"), r["precision"]) for r in layers
           if _measured(r) and r.get("impl") != LAYER_REFERENCE and r.get("train_ms_ratio") is not None}
    return [f"{suite} {p}" for suite in suites for p in precisions if (suite, p) not in got]


def compiled_rows(report: dict, eager: Sequence[dict], amp_dtype: Optional[str] = None) -> List[dict]:
    """Rows of a ``tools/benchmark.py --compile`` run (:func:`config_rows`, ratios to its compiled
    baseline) marked ``"compiled": True``, each with ``eager_train_ms_ratio`` and
    ``eager_infer_ms_ratio``: its time over the ``eager`` row (:func:`config_rows`) of its config
    and precision (None where that was not measured)."""
    rows = config_rows(report, amp_dtype)
    for row in rows:
        e = next((r for r in eager if r["config"] == row["config"] and r["precision"] == row["precision"]), {})
        row["compiled"] = True
        for key in ("train_ms", "infer_ms"):
            row[f"eager_{key}_ratio"] = ratio(row[key], e.get(key))
    return rows


def benchmarks_cuda(
    config_reports: Sequence[dict],
    layer_reports: Sequence[dict] = (),
    *,
    compiled_reports: Sequence[dict] = (),
    amp_dtype: Optional[str] = None,
    targets: Iterable[Target] = TARGETS,
    smoke: bool = False,
) -> dict:
    """``docs/benchmarks_cuda.json`` from the benchmark tools' JSON outputs (see module docstring).

    Args:
        config_reports: ``tools/benchmark.py`` outputs (e.g. one run with ``--amp both``).
        layer_reports: ``dev/benchmark_layers.py`` outputs (one per suite and AMP setting:
            SASA's, and those of :data:`INFORMATIONAL_LAYER_SUITES`).
        compiled_reports: ``tools/benchmark.py --compile`` outputs (:data:`COMPILED_CONFIGS`):
            the ``"compiled"`` rows (:func:`compiled_rows`), judged by no target; where none was
            measured, ``"informational_missing"`` lists ``"compiled <precision>"``.
        amp_dtype: AMP dtype of outputs that do not record theirs.
        smoke: the numbers come from a smoke run (``dev/gpu_check.py --quick``): no target
            verdicts, whatever the sizes. Anything else short of :data:`PROTOCOL` (size, batch,
            iterations, a precision without a measured row) has the same effect.

    Raises:
        ValueError: no report given, or reports from different devices / input sizes / baselines.
    """
    if not config_reports and not layer_reports:
        raise ValueError("benchmarks_cuda needs at least one benchmark report")
    reports = list(config_reports) + list(layer_reports)
    names = {r["env"]["device_name"] for r in reports}
    if len(names) != 1:
        raise ValueError(f"benchmark reports come from different devices: {sorted(names)}")
    for field in ("size", "batch", "baseline"):
        values = {repr(r.get(field)) for r in config_reports}
        if len(values) > 1:
            raise ValueError(f"benchmark.py reports differ in {field}: {sorted(values)}")
    env = reports[0]["env"]
    configs = [row for r in config_reports for row in config_rows(r, amp_dtype)]
    layers = [row for r in layer_reports for row in layer_rows(r, amp_dtype)]
    compiled = [row for r in compiled_reports for row in compiled_rows(r, configs, amp_dtype)]
    first = config_reports[0] if config_reports else {}
    why = _not_comparable_why(config_reports, layer_reports, configs + layers, smoke)
    verdicts = evaluate_targets(configs, layers, targets, comparable=why is None)
    missing = missing_rows(configs, layers)
    return {
        "schema": SCHEMA_VERSION,
        "device_name": env["device_name"],
        "torch": env.get("torch"),
        "cuda": env.get("cuda"),
        "size": first.get("size"),
        "batch": first.get("batch"),
        "layer_batch": layer_reports[0].get("batch") if layer_reports else None,
        "iters": first.get("iters"),
        "warmup": first.get("warmup"),
        "baseline": config_name(first["baseline"]) if first else None,
        "layer_reference": LAYER_REFERENCE,
        "protocol": PROTOCOL._asdict(),
        "comparable": why is None,
        "not_comparable_why": why,
        "missing": missing,
        "informational_missing": informational_missing(layers) + (
            [] if any(_measured(r) for r in compiled) else [f"compiled {COMPILED_PRECISION}"]),
        "complete": why is None and not missing and all(v["status"] in ("pass", "miss") for v in verdicts),
        "configs": configs,
        "layers": layers,
        "compiled": compiled,
        "targets": verdicts,
    }


def _f(x, fmt=".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _verdict(v: dict) -> str:
    if v["status"] == "not comparable":
        return NOT_COMPARABLE
    if v["status"] == "pass":
        return "pass"
    if v["status"] == "miss":
        return f"**miss** by {v['excess']:.2f} ({v['excess_pct']:+.0f}%)"
    note = v.get("note", "")
    return "not measured" if note in ("", "not measured") else f"not measured: {note[:80]}"


def _layer_note(row: dict) -> str:
    """A layer row's error, or that no target judges it (:data:`INFORMATIONAL_LAYER_SUITES`)."""
    if "error" in row:
        return f"error: {row['error'][:60]}"
    if row.get("suite") in INFORMATIONAL_LAYER_SUITES and row.get("impl") != LAYER_REFERENCE:
        return "no target: as measured"
    return ""


def render_benchmarks_markdown(bench: dict) -> str:
    """The BENCHMARKS.md GPU section: configs, layers and target verdicts as markdown tables
    (a smoke run's numbers without verdicts: ``"smoke run, not comparable to targets"``)."""
    out = [] if bench.get("comparable", True) else [
        f"**{NOT_COMPARABLE[0].upper()}{NOT_COMPARABLE[1:]}** ({bench.get('not_comparable_why')}).\n\n"
    ]
    out += [
        f"Device: **{bench['device_name']}**, torch {bench['torch']}, CUDA {bench['cuda']}; "
        f"detectors at {_f(bench['size'] and bench['size'][0], 'd')}x"
        f"{_f(bench['size'] and bench['size'][-1], 'd')}, batch {bench['batch']}, ratios to "
        f"`{bench['baseline']}` of the same run and precision; layers batch {bench['layer_batch']}, "
        f"forward + backward, ratios to a 3x3 conv of the same width and map.\n"
    ]
    missing = set(bench.get("missing", ()))
    listed = {f"{r['config']} {r['precision']}" for r in bench["configs"]}
    if bench["configs"] or missing:
        rows = [
            [f"`{r['config']}`", r["precision"],
             "missing" if f"{r['config']} {r['precision']}" in missing else "measured",
             _f(r["train_ms"], ".1f"), _f(r["train_ms_ratio"]),
             _f(r["infer_ms"], ".1f"), _f(r["infer_ms_ratio"]), _f(r["train_peak_mib"], ".0f"),
             _f(r["train_peak_mib_ratio"])] + ([f"error: {r['error'][:60]}"] if "error" in r else [""])
            for r in bench["configs"]
        ]
        rows += [[f"`{m.rsplit(' ', 1)[0]}`", m.rsplit(" ", 1)[1], "missing"] + ["–"] * 6 + ["not in the run"]
                 for m in bench.get("missing", ()) if m not in listed and not m.startswith("layers ")]
        headers = ["Config", "Precision", "Status", "Train ms", "× base", "Infer ms", "× base", "Train peak MiB",
                   "× base", "Note"]
        out.append("\n" + markdown_table(headers, rows, align="lll" + "r" * 6 + "l"))
    layer_missing = [m.split(" ", 1)[1] for m in bench.get("missing", ()) if m.startswith("layers ")]
    if layer_missing:
        out.append(f"\nLayers not measured in {', '.join(layer_missing)}.\n")
    for suite_precision in bench.get("informational_missing", ()):
        suite, precision = suite_precision.split(" ", 1)
        what = "Compiled models (MODEL.COMPILE, no target)" if suite == "compiled" else \
            f"`{suite}` layer (no target)"
        out.append(f"\n{what} not measured in {precision}.\n")
    if bench["layers"]:
        rows = [
            [f"`{r['layer']}`", r["precision"], f"{r['side']}x{r['side']}", _f(r["channels"], "d"),
             _f(r["train_ms"], ".2f"), _f(r["train_ms_ratio"]), _f(r["train_peak_mib"], ".0f"),
             _f(r["train_peak_mib_ratio"]), _layer_note(r)]
            for r in bench["layers"]
        ]
        headers = ["Layer", "Precision", "Map", "Channels", "fwd+bwd ms", "× 3x3 conv", "Peak MiB",
                   "× 3x3 conv", "Note"]
        out.append("\n" + markdown_table(headers, rows, align="llll" + "r" * 4 + "l"))
    if bench.get("compiled"):
        rows = [
            [f"`{r['config']}`", r["precision"], _f(r["train_ms"], ".1f"), _f(r["train_ms_ratio"]),
             _f(r["eager_train_ms_ratio"]), _f(r["infer_ms"], ".1f"), _f(r["infer_ms_ratio"]),
             _f(r["eager_infer_ms_ratio"]), _f(r["train_peak_mib"], ".0f")]
            + ([f"error: {r['error'][:60]}"] if "error" in r else [""])
            for r in bench["compiled"]
        ]
        headers = ["Compiled (MODEL.COMPILE, no target)", "Precision", "Train ms", "× compiled base",
                   "× own eager", "Infer ms", "× compiled base", "× own eager", "Train peak MiB", "Note"]
        out.append("\n" + markdown_table(headers, rows, align="ll" + "r" * 7 + "l"))
    if bench["targets"]:
        rows = [
            [t["target"], f"`{t['subject']}`", t["precision"], f"≤ {t['limit']:.2f}", _f(t["value"]),
             _verdict(t), t.get("bound", "–")]
            for t in bench["targets"]
        ]
        out.append("\n" + markdown_table(["Target", "Subject", "Precision", "Limit", "Value", "Verdict",
                                          "What bounds it (one profiled step)"], rows, align="lllrrll"))
    return "".join(out)


def render_targets_markdown(targets: Iterable[Target] = TARGETS, protocol: Protocol = PROTOCOL) -> str:
    """The targets before any measurement: what, of which subject, at most how much, at ``protocol``."""
    rows = [[t.name, f"`{t.subject}`", f"<= {t.limit:.2f}x"] for t in targets]
    head = (f"At {describe_protocol(protocol)}; models as ratios to `{config_name(BASELINE_CONFIG)}` of the "
            "same run and precision, the layer to a 3x3 conv of the same width and map; each precision "
            "gets its own verdict.\n\n")
    return head + markdown_table(["Target (CUDA)", "Subject", "Limit"], rows, align="lll")


# ----------------------------------------------------------------------------- pytest junit
def parse_junit(xml_text: str) -> dict:
    """Counts and failures of a pytest ``--junitxml`` file's text.

    Returns:
        ``{"tests", "passed", "failed", "errors", "skipped", "time_s", "failures": [{"test",
        "kind", "message"}], "skipped_reasons": {reason: count}, "skipped_tests": [{"test",
        "reason"}]}``.
    """
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "time_s": 0.0,
           "failures": [], "skipped_reasons": {}, "skipped_tests": []}
    for suite in suites:
        out["time_s"] += float(suite.get("time", 0) or 0)
        for case in suite.iter("testcase"):
            out["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
            bad = case.find("failure")
            kind = "failed"
            if bad is None:
                bad, kind = case.find("error"), "errors"
            if bad is not None:
                out[kind] += 1
                msg = (bad.get("message") or bad.text or "").strip().splitlines()
                out["failures"].append({"test": name, "kind": kind, "message": (msg[0] if msg else "")[:300]})
            elif case.find("skipped") is not None:
                out["skipped"] += 1
                reason = (case.find("skipped").get("message") or "").strip()[:120]
                out["skipped_reasons"][reason] = out["skipped_reasons"].get(reason, 0) + 1
                out["skipped_tests"].append({"test": name, "reason": reason})
            else:
                out["passed"] += 1
    return out


#: Environment variable naming the progress record of a pytest run (``conftest.py`` writes
#: it as the run goes: one JSON line per finished test, one with the number collected).
TEST_PROGRESS_ENV = "AADET_TEST_PROGRESS"


def parse_test_progress(text: str, slowest: int = 10) -> dict:
    """What a pytest run got through, from its progress record (:data:`TEST_PROGRESS_ENV`), also
    when the run was cut off before its junit XML was written.

    Returns:
        ``{"collected": int | None, "finished": int, "passed", "failed", "skipped": int,
        "time_s": float, "failures": [test ids], "slowest": [[test id, seconds], ...]}``: a test
        counts as failed if any of its phases failed, its time is the sum of its phases'.
    """
    collected, outcome, seconds = None, {}, {}
    for line in text.splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "collected" in rec:
            collected = rec["collected"]
            continue
        test = rec["test"]
        seconds[test] = seconds.get(test, 0.0) + rec["duration_s"]
        if outcome.get(test) != "failed":
            outcome[test] = rec["outcome"]
    counts = {k: sum(1 for o in outcome.values() if o == k) for k in ("passed", "failed", "skipped")}
    return dict(collected=collected, finished=len(outcome), **counts, time_s=round(sum(seconds.values()), 1),
                failures=[t for t, o in outcome.items() if o == "failed"],
                slowest=[[t, round(s, 1)] for t, s in sorted(seconds.items(), key=lambda x: -x[1])[:slowest]])


def describe_test_progress(p: dict) -> str:
    """One line: how far a pytest run got (:func:`parse_test_progress`)."""
    of = f" of {p['collected']} collected" if p["collected"] is not None else ""
    line = (f"{p['finished']} finished{of}: {p['passed']} passed, {p['failed']} failed, "
            f"{p['skipped']} skipped, {p['time_s']:.0f} s of test time")
    if p["failures"]:
        line += "; failed: " + ", ".join(p["failures"][:5])
    if p["slowest"]:
        line += "; slowest: " + ", ".join(f"{t} {s:.0f} s" for t, s in p["slowest"][:5])
    return line


def tests_stage_result(junit: Optional[dict], exit_code, progress: Optional[dict] = None) -> dict:
    """Verdict of the ``tests`` stage (``pytest -m cuda``) from its parsed junit XML and exit code
    (and, where the run wrote no junit XML, how far its ``progress`` record got: said, never
    counted as a pass).

    ``"ok"`` only when CUDA tests ran and every one of them passed: a failure, an error, a test
    skipped (on the GPU machine a skipped CUDA test is a check that did not happen: missing
    Triton, a wrong device, ...) or no test at all fails the stage, and ``error`` says which.

    Returns:
        ``{"status": "ok" | "failed", "error"?: str}``.
    """
    if junit is None:
        error = f"pytest wrote no junit XML (exit {exit_code})"
        if progress is not None:
            error += f"; before it stopped: {describe_test_progress(progress)}"
        return {"status": "failed", "error": error}
    problems = []
    if junit["failed"] or junit["errors"]:
        problems.append(f"{junit['failed']} failed, {junit['errors']} errors")
    if junit["skipped"]:
        reasons = "; ".join(f"{r or 'no reason given'} ({n})" for r, n in junit["skipped_reasons"].items())
        problems.append(f"{junit['skipped']} CUDA-marked test(s) skipped: {reasons}")
    if junit["passed"] == 0 and not problems:
        problems.append("no CUDA test ran (none collected)")
    if exit_code != 0 and not problems:
        problems.append(f"pytest exit {exit_code}")
    return {"status": "failed", "error": "; ".join(problems)} if problems else {"status": "ok"}


# ----------------------------------------------------------------------------- the whole report
#: The stages of ``dev/gpu_check.py`` in the order they run: name -> what it checks.
STAGES = {
    "sweep": "every attention layer shape of the COCO configs at 640x640, batch 8, by every CUDA route of its "
             "family and the 3x3 conv beside it, forward + backward in fp32 and bf16 / fp16 autocast: finite, "
             "agreeing with the float64 brute force on a sample, time and peak memory (dev/gpu_sweep.py)",
    "tests": "pytest -m cuda: every attention route (fp32, bf16 and fp16 autocast) vs the float64 brute force, "
             "the compiled Triton kernels; ok only if every CUDA test ran and passed (a skip fails it)",
    "configs": "every config in configs/ built on CUDA and trained 20 iterations at its own training size "
               "(COCO 640x640 batch 8) in fp32 and bf16 AMP: every loss and gradient finite",
    "benchmarks": "640x640 batch 8 speed/memory of the R50 configs and the SASA layer, each profiled for what "
                  "bounds it, and without a target of the HaloNet layer (fp32, bf16 AMP) and of the conv and AA "
                  "R50 compiled (MODEL.COMPILE, bf16)",
    "demo": "short real training of the demo configs on CUDA, with their AP on trees_val and trees_test",
}


#: What a lent machine's calls run (``dev/gpu_loan.sh first|second``), in seconds: a call is at most
#: ``call_s`` of the command's own time (the machine's start and the transfers are not in it), of
#: which ``install_s`` go to installing what the machine lacks and ``finish_s`` to merging and
#: packing the report; each stage gets its budget, in this order, and writes what it finished when
#: it is cut. The second call goes on from the first's files (``--resume``): it repeats nothing.
#: Measured at 3a55981 on an H200: install 19 s and 15 s; the CUDA tests 129 s (pytest 113 s);
#: the configs stage about 6 s a config and precision at 640x640 batch 8.
LOAN_PLAN = {
    "first": {"call_s": 540, "install_s": 25, "finish_s": 20,
              "stages": {"sweep": 170, "tests": 135, "configs": 190}},
    "second": {"call_s": 240, "install_s": 25, "finish_s": 15,
               "stages": {"configs": 60, "benchmarks": 140}},
}
#: Stages no loan call runs, and why (``make gpu-check`` on a machine with time runs them).
LOAN_LEFT_OUT = {"demo": "a demo training on CUDA takes minutes, and the configs stage trains the demo "
                         "configs at their own size (at 3a55981 its 35 s ended both trainings it started)"}
#: The limit of one command on a lent machine (seconds) and of device time for a session, the
#: machine's start and the transfers included (measured at 3a55981: 35 s for the first call, 13 s
#: for the second): ``LOAN_PLAN``'s calls must fit both, on one start.
CALL_LIMIT_S, SESSION_DEVICE_S, MACHINE_START_S = 600, 900, 60


def loan_plan_lines(plan: dict = LOAN_PLAN) -> List[str]:
    """The plan as lines: each call's stages with their budgets, and what is left of the limits."""
    lines, total = [], MACHINE_START_S
    for call, p in plan.items():
        used = p["install_s"] + sum(p["stages"].values()) + p["finish_s"]
        total += p["call_s"]
        stages = ", ".join(f"{name} {sec} s" for name, sec in p["stages"].items())
        lines.append(f"{call}: install {p['install_s']} s, {stages}, finish {p['finish_s']} s = {used} s "
                     f"of the call's {p['call_s']} s (a command may run {CALL_LIMIT_S} s)")
    lines += [f"not in a call: {name} ({why})" for name, why in LOAN_LEFT_OUT.items()]
    lines.append(f"the calls on one machine start (~{MACHINE_START_S} s; the next call within the 30 s it stays "
                 f"warm): {total} s of the session's {SESSION_DEVICE_S} s of device time")
    return lines


class StaleStageError(ValueError):
    """A stage file ran at another commit than the one the report is merged at."""


def _short(commit: Optional[str]) -> str:
    return "unknown" if not commit else commit[:12]


def stale_stages(
    stage_results: Dict[str, dict],
    head: Optional[str],
    *,
    allow_stale: bool = False,
    files: Optional[Dict[str, str]] = None,
) -> Dict[str, dict]:
    """The stages whose recorded ``commit`` is not ``head`` (the checkout merging the report).

    Each stage file records the git commit it ran at (``"commit"``, None where it was unknown)
    and whether the tree had uncommitted changes (``"dirty"``). A stage of another commit checked
    other code than this checkout holds; so may one whose commit is unknown, and so may every stage
    when ``head`` itself is unknown: all of these are stale.

    Args:
        files: stage name -> the file it was read from (named in the error).

    Returns:
        ``{stage: {"commit", "dirty", "head"}}`` of the stale stages (empty: none).

    Raises:
        StaleStageError: there are stale stages and not ``allow_stale``; the message names each
            file with its commit and ``head``.
    """
    stale = {}
    for name, s in stage_results.items():
        commit = s.get("commit")
        if head is None or commit != head:
            stale[name] = {"commit": commit, "dirty": s.get("dirty"), "head": head}
    if stale and not allow_stale:
        files = files or {}
        lines = [f"{files.get(n, f'stage_{n}.json')}: ran at commit {_short(v['commit'])}, HEAD is "
                 f"{_short(head)}" for n, v in stale.items()]
        raise StaleStageError(
            "refusing to merge stage results of another commit into the report:\n  " + "\n  ".join(lines)
            + "\nrerun those stages at this commit, remove their files, or pass --allow-stale "
            "(the report then marks them stale)"
        )
    return stale


def stage_problems(stage: dict, head: Optional[str]) -> List[str]:
    """Why a stage's result does not count towards the check (empty: it counts).

    A stage counts only when it ran (``status`` ``"ok"``) on CUDA (its recorded ``device``), at
    ``head`` (the commit of the checkout that merges the report) in a clean tree (``dirty`` is
    False: uncommitted or untracked changes, or a state nobody checked, are not that commit), and
    was not a ``--quick`` smoke run.
    """
    status = stage.get("status", "not run")
    if status == "not run":
        return ["not run"]
    problems = [] if status == "ok" else [f"{status}" + (f": {stage['error'][:200]}" if stage.get("error") else "")]
    device = stage.get("device")
    if device is None or not str(device).startswith("cuda"):
        problems.append(f"ran on {device or 'an unrecorded device'}, not CUDA")
    if stage.get("quick"):
        problems.append("a --quick smoke run")
    if head is None:
        problems.append("the commit of the checkout merging the report is unknown")
    elif stage.get("commit") != head:
        problems.append(f"ran at commit {_short(stage.get('commit'))}, HEAD is {_short(head)}")
    dirty = stage.get("dirty")
    if dirty is not False:
        problems.append("the tree had uncommitted changes" if dirty else "the tree's state is unknown (no git "
                        "checkout and no verified manifest)")
    return problems


def targets_verdict(stages: Dict[str, dict]) -> dict:
    """Whether the performance targets were met, apart from whether the stages ran.

    Returns:
        ``{"status": "met" | "missed" | "not measured" | "not comparable", "met", "missed",
        "missing", "total"}``: ``"missed"`` when any target is missed, ``"not measured"`` when
        none is missed but some are missing (or no benchmark ran), ``"not comparable"`` for numbers
        not measured at :data:`PROTOCOL`.
    """
    bench = stages.get("benchmarks", {}).get("benchmarks")
    if not bench:
        return {"status": "not measured", "met": 0, "missed": 0, "missing": 0, "total": 0}
    n = Counter(t["status"] for t in bench["targets"])
    out = {"met": n["pass"], "missed": n["miss"], "missing": n["missing"], "total": len(bench["targets"])}
    if not bench.get("comparable", True):
        status = "not comparable"
    elif n["miss"]:
        status = "missed"
    elif n["missing"] or not bench["targets"]:
        status = "not measured"
    else:
        status = "met"
    return dict(out, status=status)


def merge_stage_results(
    stage_results: Dict[str, dict],
    *,
    head: Optional[str] = None,
    required: Sequence[str] = tuple(STAGES),
    stale: Optional[Dict[str, dict]] = None,
) -> dict:
    """One report from the stages' results (each ``{"status": "ok" | "failed" | "skipped", ...}``).

    Stages run in separate processes or separate machine calls write one JSON each. ``status`` is
    ``"ok"`` only when every stage of ``required`` counts (:func:`stage_problems` against
    ``head``), ``"incomplete"`` when the only shortfall is required stages not run, else
    ``"failed"``. ``not_counted``: each stage present that does not count, with why. ``targets``:
    :func:`targets_verdict`, a verdict of its own. ``stale`` (from :func:`stale_stages`, merged
    anyway) marks stages of another commit. ``envs``: each stage's own environment.
    """
    unknown = sorted(set(stage_results) - set(STAGES)) + sorted(set(required) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
    stages = {name: dict(stage_results.get(name, {"status": "not run"})) for name in STAGES}
    for name, info in (stale or {}).items():
        stages[name]["stale"] = info
    problems = {name: stage_problems(s, head) for name, s in stages.items()}
    shortfall = [problems[name] for name in required if problems[name]]
    status = "ok" if not shortfall else "incomplete" if all(p == ["not run"] for p in shortfall) else "failed"
    return {
        "status": status,
        "required": [name for name in STAGES if name in required],
        "head": head,
        "not_counted": {name: p for name, p in problems.items() if p and p != ["not run"]},
        "not_run": [name for name, p in problems.items() if p == ["not run"]],
        "targets": targets_verdict(stages),
        "quick": any(s.get("quick") for s in stages.values()),
        "stale_stages": sorted(stale or {}, key=list(STAGES).index),
        "envs": {name: s["env"] for name, s in stages.items() if s.get("env")},
        "stages": stages,
    }


def _stage_markdown(name: str, s: dict) -> List[str]:
    on = f", on {s['device']}" if s.get("device") else ""
    out = [f"\n## {name}: {s['status']}{on}\n\n{STAGES[name]}."]
    if s.get("elapsed_s") is not None:
        out.append(f" Ran {s['elapsed_s']:.0f} s (budget {_f(s.get('budget_s'), '.0f')} s).")
    if s["status"] != "not run":
        dirty = {True: ", uncommitted changes", False: "", None: ", tree state unknown"}[s.get("dirty")]
        out.append(f" Commit {_short(s.get('commit'))}{dirty}.")
    if s.get("quick"):
        out.append(" A `--quick` smoke run (small sizes, few iterations).")
    if s.get("stale"):
        out.append(f"\n\n**Stale**: ran at commit {_short(s['stale']['commit'])}, the report was merged at "
                   f"{_short(s['stale']['head'])} (`--allow-stale`).")
    if s.get("error"):
        out.append(f"\n\nError: `{s['error'][:500]}`")
    out.append("\n")
    if name == "sweep" and s.get("counts"):
        c = s["counts"]
        out.append(f"\n{c['measured']} of {c['planned']} cases measured ({c['failed']} not ok), {c['shapes']} layer "
                   f"shapes; rows: `{s.get('rows_file', 'sweep.jsonl')}`.\n")
        for r in s.get("failures", [])[:40]:
            why = r.get("exception") or (f"error {_f(r.get('error'), '.2e')}" if r.get("agrees") is False else
                                         "non-finite " + ("output" if not r.get("finite_output") else "gradients"))
            backends = r.get("sdpa_backends")
            out.append(f"\n- `{r['case']}`: {why}" + (f"; SDPA backends: {backends}" if backends else ""))
        out.append("\n")
    if name == "tests" and s.get("junit"):
        j = s["junit"]
        out.append(f"\n{j['tests']} tests: {j['passed']} passed, {j['failed']} failed, {j['errors']} errors, "
                   f"{j['skipped']} skipped ({j['time_s']:.0f} s).\n")
        for f in j["failures"]:
            out.append(f"\n- {f['kind']}: `{f['test']}`: {f['message']}")
        for reason, n in j["skipped_reasons"].items():
            out.append(f"\n- skipped ({n}): {reason}")
        skipped = j.get("skipped_tests", [])
        for t in skipped[:20]:
            out.append(f"\n  - `{t['test']}`")
        if len(skipped) > 20:
            out.append(f"\n  - ... and {len(skipped) - 20} more")
        out.append("\n")
    if name == "configs" and s.get("results"):
        rows = [[f"`{r['config']}`", r["precision"], r["status"], _f(r.get("first_loss"), ".3f"),
                 _f(r.get("last_loss"), ".3f"), _f(r.get("peak_mib"), ".0f"), _f(r.get("step_ms"), ".0f"),
                 (r.get("error") or "")[:80]] for r in s["results"]]
        out.append("\n" + markdown_table(["Config", "Precision", "Status", "First loss", "Last loss",
                                          "Peak MiB", "ms/iter", "Error"], rows, align="lll" + "r" * 4 + "l"))
    if name == "demo" and s.get("results"):
        datasets = []  # every dataset evaluated, in the order the runs report them
        for r in s["results"]:
            datasets += [d for d in r.get("metrics", {}) if d not in datasets]
        rows = [[f"`{r['config']}`", r["status"], _f(r.get("iters"), "d")]
                + [_f(r.get("metrics", {}).get(d, {}).get(k), ".2f") for d in datasets for k in ("AP", "AP50")]
                + [_f(r.get("first_loss"), ".3f"), _f(r.get("last_loss"), ".3f"), _f(r.get("elapsed_s"), ".0f"),
                   (r.get("error") or "")[:80]] for r in s["results"]]
        headers = (["Config", "Status", "Iters"] + [f"{d} {k}" for d in datasets for k in ("AP", "AP50")]
                   + ["First loss", "Last loss", "Time s", "Error"])
        out.append("\n" + markdown_table(headers, rows, align="ll" + "r" * (len(headers) - 3) + "l"))
    if name == "benchmarks" and s.get("benchmarks"):
        out.append("\n" + render_benchmarks_markdown(s["benchmarks"]))
    return out


def summary_line(report: dict) -> str:
    """The report's two verdicts in one line: ``"ok (tests, benchmarks); targets: missed 2 of 14"``."""
    notes = [", ".join(report["required"])]
    not_run = [n for n in report["not_run"] if n in report["required"]]
    if not_run:
        notes.append("not run: " + ", ".join(not_run))
    notes += [f"{name}: {'; '.join(p)}" for name, p in report["not_counted"].items()]
    if report.get("quick"):
        notes.append(NOT_COMPARABLE)
    if report.get("stale_stages"):
        notes.append("stale stages from another commit: " + ", ".join(report["stale_stages"]))
    t = report["targets"]
    targets = t["status"] if not t["total"] else (
        f"{t['status']} ({t['met']} met, {t['missed']} missed, {t['missing']} not measured, of {t['total']})")
    return f"{report['status']} ({'; '.join(n for n in notes if n)}); targets: {targets}"


_ENV_KEYS = ("device", "device_name", "torch", "cuda", "triton", "detectron2", "python", "driver")


def render_report_markdown(report: dict) -> str:
    """``report.md``: the two verdicts, every stage's environment, then each stage's status and numbers."""
    envs = report.get("envs", {})
    head = [f"# aadet GPU check: {summary_line(report)}\n\n",
            f"Check: **{report['status']}** for the stages {', '.join(report['required'])} (each must run on CUDA, "
            f"at the checked-out clean commit {_short(report.get('head'))}, and pass). Targets: "
            f"**{report['targets']['status']}** (a verdict of its own: a stage that ran may miss them).\n"]
    if report["not_counted"]:
        head.append("\nNot counted:\n" + "".join(f"\n- {name}: {'; '.join(p)}"
                                                  for name, p in report["not_counted"].items()) + "\n")
    if envs:
        names = list(envs)
        head.append("\n" + markdown_table([""] + names, [[k] + [str(envs[n].get(k)) for n in names]
                                                        for k in _ENV_KEYS], align="l" * (len(names) + 1)))
    body = [line for name, s in report["stages"].items() for line in _stage_markdown(name, s)]
    return "".join(head + body) + "\n"
