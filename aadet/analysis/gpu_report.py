"""The GPU check's report: benchmark JSON -> ``docs/benchmarks_cuda.json`` with target verdicts,
pytest junit XML -> a test summary, and the stages of ``tools/gpu_check.py`` merged into one
``report.md`` / ``report.json``.

Everything here is a pure function of dicts / XML text (no CUDA, no model): the GPU machine runs
the tools, this module reads what they wrote, and CPU unit tests feed it synthetic inputs
(``tests/test_gpu_check.py``).

The benchmark schema (``docs/benchmarks_cuda.json``, ``"schema": 1``)::

    {"schema": 1, "device_name": "NVIDIA H100 80GB HBM3", "torch": ..., "cuda": ..., "size": [640, 640],
     "batch": 8, "baseline": "retinanet_R_50_FPN_scratch_150ep",
     "configs": [{"config": "aa_retinanet_R_50_FPN_scratch_150ep", "precision": "bf16",
                  "train_ms": .., "infer_ms": .., "train_peak_mib": ..,
                  "train_ms_ratio": .., "infer_ms_ratio": .., "train_peak_mib_ratio": ..}, ...],
     "layers":  [{"layer": "sasa_fused_80", "label": .., "precision": "fp32", "side": 80,
                  "channels": 256, "train_ms": .. (forward + backward), "train_peak_mib": ..,
                  "train_ms_ratio": .., "train_peak_mib_ratio": ..}, ...],   # ratios to the 3x3 conv
     "targets": [{"target": "AA-R50 train time", "subject": .., "metric": "train_ms_ratio",
                  "precision": "bf16", "limit": 1.10, "value": 1.32, "status": "miss",
                  "excess": 0.22, "excess_pct": 20.0}, ...]}

Ratios are to the baseline of the *same run and precision* (configs: the conv R50 RetinaNet;
layers: a 3x3 convolution of the same width and map size), so they compare like with like.
``status`` is ``"pass"`` (value <= limit), ``"miss"`` (then ``excess = value - limit`` and
``excess_pct = 100 * (value / limit - 1)`` say by how much) or ``"missing"`` (the case was not
measured or failed: the report says so instead of passing it).
"""

import os
import xml.etree.ElementTree as ET
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence

from .report import markdown_table, mib, ratio

__all__ = [
    "SCHEMA_VERSION",
    "BASELINE_CONFIG",
    "BENCHMARK_CONFIGS",
    "LAYER_REFERENCE",
    "PRECISIONS",
    "Target",
    "TARGETS",
    "precision_name",
    "config_name",
    "config_rows",
    "layer_rows",
    "evaluate_targets",
    "benchmarks_cuda",
    "render_benchmarks_markdown",
    "parse_junit",
    "STAGES",
    "merge_stage_results",
    "render_report_markdown",
]

SCHEMA_VERSION = 1

# ----------------------------------------------------------------------------- what is measured
#: The conv R50 RetinaNet every config ratio is taken against (same run, same precision).
BASELINE_CONFIG = "configs/COCO-Detection/retinanet_R_50_FPN_scratch_150ep.yaml"
#: Issue 10's benchmark configs: the baseline first, then the attention models with targets.
BENCHMARK_CONFIGS = (
    BASELINE_CONFIG,
    "configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep.yaml",
    # SASA attention backbone: every spatial 3x3 conv of res2-res5 is local attention (conv stem).
    "configs/COCO-Detection/sasa_convstem_retinanet_R_50_FPN_scratch_150ep.yaml",
    # SASA all-attention: attention stem, backbone, FPN and head.
    "configs/COCO-Detection/sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep.yaml",
)
#: The layer every layer ratio is taken against (``tools/benchmark_layers.py``'s impl name).
LAYER_REFERENCE = "conv3x3"
#: Precision names used in the report; ``tools/benchmark*.py`` report ``amp`` (bool) and
#: ``amp_dtype`` (torch dtype name).
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPE_TO_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "bf16": "bf16",
                       "fp16": "fp16", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


class Target(NamedTuple):
    """One performance target of issue 10: ``metric`` of ``subject`` must be <= ``limit``.

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
#: Issue 10's targets (one definition; every precision measured gets a verdict).
TARGETS = (
    Target("AA-R50 RetinaNet train time", "configs", _AA, "train_ms_ratio", 1.10),
    Target("AA-R50 RetinaNet inference time", "configs", _AA, "infer_ms_ratio", 1.10),
    Target("AA-R50 RetinaNet train memory", "configs", _AA, "train_peak_mib_ratio", 1.15),
    Target("SASA attention-backbone RetinaNet train time", "configs", _SASA, "train_ms_ratio", 1.5),
    Target("SASA all-attention RetinaNet train time", "configs", _SASA_FULL, "train_ms_ratio", 2.0),
    Target("LocalSelfAttention2d 256 ch k 7 80x80 fwd+bwd time vs 3x3 conv", "layers", "sasa_*_80",
           "train_ms_ratio", 2.0),
    Target("LocalSelfAttention2d 256 ch k 7 80x80 fwd+bwd memory vs 3x3 conv", "layers",
           "sasa_*_80", "train_peak_mib_ratio", 2.0),
)


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
        if "error" in r:
            row["error"] = str(r["error"])[:300]
        rows.append(row)
    base = {row["precision"]: row for row in rows if row["config"] == config_name(report["baseline"])}
    for row in rows:
        b = base.get(row["precision"], {})
        for key in ("train_ms", "infer_ms", "train_peak_mib"):
            row[key + "_ratio"] = ratio(row[key], b.get(key))
    return rows


def layer_rows(report: dict, amp_dtype: Optional[str] = None) -> List[dict]:
    """Rows of ``tools/benchmark_layers.py --output-json`` with ratios to the 3x3 conv.

    Only layers that have a :data:`LAYER_REFERENCE` case at the same map size get ratios (the
    SASA suite); each row is named ``<suite>_<impl>_<side>`` (``"sasa_fused_80"``).
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
        rows.append(row)
    ref = {(row["suite"], row["side"]): row for row in rows if row["impl"] == LAYER_REFERENCE}
    for row in rows:
        b = ref.get((row["suite"], row["side"]))
        for key in ("train_ms", "train_peak_mib"):
            row[key + "_ratio"] = None if b is None else ratio(row[key], b[key])
    return [row for row in rows if (row["suite"], row["side"]) in ref]


def _matches(pattern: str, name: str) -> bool:
    if "*" not in pattern:
        return pattern == name
    head, tail = pattern.split("*", 1)
    return name.startswith(head) and name.endswith(tail) and len(name) >= len(head) + len(tail)


def evaluate_targets(
    configs: Sequence[dict], layers: Sequence[dict], targets: Iterable[Target] = TARGETS
) -> List[dict]:
    """A verdict per target and precision measured (see the module docstring for the fields)."""
    rows = {"configs": list(configs), "layers": list(layers)}
    key = {"configs": "config", "layers": "layer"}
    precisions = [p for p in PRECISIONS if any(r["precision"] == p for r in rows["configs"] + rows["layers"])]
    out = []
    for t in targets:
        if t.section not in rows:
            raise ValueError(f"target {t.name!r}: section must be 'configs' or 'layers'; got {t.section!r}")
        for p in precisions:
            hits = [r for r in rows[t.section] if r["precision"] == p and _matches(t.subject, r[key[t.section]])]
            if t.section == "layers":  # the reference itself is not a subject
                hits = [r for r in hits if r.get("impl") != LAYER_REFERENCE]
            for r in hits or [None]:
                value = None if r is None else r.get(t.metric)
                v = {
                    "target": t.name,
                    "subject": t.subject if r is None else r[key[t.section]],
                    "metric": t.metric,
                    "precision": p,
                    "limit": t.limit,
                    "value": value,
                }
                if value is None:
                    why = "not measured" if r is None else (r.get("error") or "no baseline to compare with")
                    v.update(status="missing", note=why)
                elif value <= t.limit:
                    v.update(status="pass", excess=0.0, excess_pct=0.0)
                else:
                    v.update(status="miss", excess=value - t.limit, excess_pct=100.0 * (value / t.limit - 1.0))
                out.append(v)
    return out


def benchmarks_cuda(
    config_reports: Sequence[dict],
    layer_reports: Sequence[dict] = (),
    *,
    amp_dtype: Optional[str] = None,
    targets: Iterable[Target] = TARGETS,
) -> dict:
    """``docs/benchmarks_cuda.json`` from the benchmark tools' JSON outputs (see module docstring).

    Args:
        config_reports: ``tools/benchmark.py`` outputs (e.g. one run with ``--amp both``).
        layer_reports: ``tools/benchmark_layers.py`` outputs (one per AMP setting).
        amp_dtype: AMP dtype of outputs that do not record theirs.

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
    first = config_reports[0] if config_reports else {}
    return {
        "schema": SCHEMA_VERSION,
        "device_name": env["device_name"],
        "torch": env.get("torch"),
        "cuda": env.get("cuda"),
        "size": first.get("size"),
        "batch": first.get("batch"),
        "layer_batch": layer_reports[0].get("batch") if layer_reports else None,
        "iters": first.get("iters"),
        "baseline": config_name(first["baseline"]) if first else None,
        "layer_reference": LAYER_REFERENCE,
        "configs": configs,
        "layers": layers,
        "targets": evaluate_targets(configs, layers, targets),
    }


def _f(x, fmt=".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _verdict(v: dict) -> str:
    if v["status"] == "pass":
        return "pass"
    if v["status"] == "miss":
        return f"**miss** by {v['excess']:.2f} ({v['excess_pct']:+.0f}%)"
    note = v.get("note", "")
    return "not measured" if note in ("", "not measured") else f"not measured: {note[:80]}"


def render_benchmarks_markdown(bench: dict) -> str:
    """The BENCHMARKS.md GPU section: configs, layers and target verdicts as markdown tables."""
    out = [
        f"Device: **{bench['device_name']}**, torch {bench['torch']}, CUDA {bench['cuda']}; "
        f"detectors at {_f(bench['size'] and bench['size'][0], 'd')}x"
        f"{_f(bench['size'] and bench['size'][-1], 'd')}, batch {bench['batch']}, ratios to "
        f"`{bench['baseline']}` of the same run and precision; layers batch {bench['layer_batch']}, "
        f"forward + backward, ratios to a 3x3 conv of the same width and map.\n"
    ]
    if bench["configs"]:
        rows = [
            [f"`{r['config']}`", r["precision"], _f(r["train_ms"], ".1f"), _f(r["train_ms_ratio"]),
             _f(r["infer_ms"], ".1f"), _f(r["infer_ms_ratio"]), _f(r["train_peak_mib"], ".0f"),
             _f(r["train_peak_mib_ratio"])] + ([f"error: {r['error'][:60]}"] if "error" in r else [""])
            for r in bench["configs"]
        ]
        headers = ["Config", "Precision", "Train ms", "× base", "Infer ms", "× base", "Train peak MiB",
                   "× base", "Note"]
        out.append("\n" + markdown_table(headers, rows, align="ll" + "r" * 6 + "l"))
    if bench["layers"]:
        rows = [
            [f"`{r['layer']}`", r["precision"], f"{r['side']}x{r['side']}", _f(r["channels"], "d"),
             _f(r["train_ms"], ".2f"), _f(r["train_ms_ratio"]), _f(r["train_peak_mib"], ".0f"),
             _f(r["train_peak_mib_ratio"])]
            for r in bench["layers"]
        ]
        headers = ["Layer", "Precision", "Map", "Channels", "fwd+bwd ms", "× 3x3 conv", "Peak MiB",
                   "× 3x3 conv"]
        out.append("\n" + markdown_table(headers, rows, align="llll" + "r" * 4))
    if bench["targets"]:
        rows = [
            [t["target"], f"`{t['subject']}`", t["precision"], f"≤ {t['limit']:.2f}", _f(t["value"]),
             _verdict(t)]
            for t in bench["targets"]
        ]
        out.append("\n" + markdown_table(["Target", "Subject", "Precision", "Limit", "Value", "Verdict"],
                                         rows, align="lllrrl"))
    return "".join(out)


# ----------------------------------------------------------------------------- pytest junit
def parse_junit(xml_text: str) -> dict:
    """Counts and failures of a pytest ``--junitxml`` file's text.

    Returns:
        ``{"tests", "passed", "failed", "errors", "skipped", "time_s", "failures": [{"test",
        "kind", "message"}], "skipped_reasons": {reason: count}}``.
    """
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "time_s": 0.0,
           "failures": [], "skipped_reasons": {}}
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
            else:
                out["passed"] += 1
    return out


# ----------------------------------------------------------------------------- the whole report
#: The stages of ``tools/gpu_check.py`` in the order they run: name -> what it checks.
STAGES = {
    "tests": "pytest -m cuda: every attention route (fp32, bf16 and fp16 autocast) vs the float64 brute force",
    "configs": "every config in configs/ built on CUDA and trained a few iterations in fp32 and bf16 AMP",
    "demo": "short real training of the demo configs on CUDA, with their AP on trees_val",
    "benchmarks": "640x640 batch 8 speed/memory of the R50 configs and the SASA layer (fp32, bf16 AMP)",
}


def merge_stage_results(stage_results: Dict[str, dict], env: Optional[dict] = None) -> dict:
    """One report from the stages' results (each ``{"status": "ok" | "failed" | "skipped", ...}``).

    Stages run in separate processes or separate machine calls write one JSON each; merging
    them keeps the newest result of each stage. ``status`` of the whole report is ``"ok"`` only
    when every stage in :data:`STAGES` ran and passed.
    """
    unknown = sorted(set(stage_results) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
    stages = {name: stage_results.get(name, {"status": "not run"}) for name in STAGES}
    envs = [s["env"] for s in stages.values() if s.get("env")]
    env = env or (envs[-1] if envs else {})
    ok = all(s["status"] == "ok" for s in stages.values())
    return {"status": "ok" if ok else "incomplete" if all(
        s["status"] in ("ok", "not run") for s in stages.values()) else "failed",
        "env": env, "stages": stages}


def _stage_markdown(name: str, s: dict) -> List[str]:
    out = [f"\n## {name}: {s['status']}\n\n{STAGES[name]}."]
    if s.get("elapsed_s") is not None:
        out.append(f" Ran {s['elapsed_s']:.0f} s (budget {_f(s.get('budget_s'), '.0f')} s).")
    if s.get("error"):
        out.append(f"\n\nError: `{s['error'][:500]}`")
    out.append("\n")
    if name == "tests" and s.get("junit"):
        j = s["junit"]
        out.append(f"\n{j['tests']} tests: {j['passed']} passed, {j['failed']} failed, {j['errors']} errors, "
                   f"{j['skipped']} skipped ({j['time_s']:.0f} s).\n")
        for f in j["failures"]:
            out.append(f"\n- {f['kind']}: `{f['test']}`: {f['message']}")
        for reason, n in j["skipped_reasons"].items():
            out.append(f"\n- skipped ({n}): {reason}")
        out.append("\n")
    if name == "configs" and s.get("results"):
        rows = [[f"`{r['config']}`", r["precision"], r["status"], _f(r.get("first_loss"), ".3f"),
                 _f(r.get("last_loss"), ".3f"), _f(r.get("peak_mib"), ".0f"), _f(r.get("step_ms"), ".0f"),
                 (r.get("error") or "")[:80]] for r in s["results"]]
        out.append("\n" + markdown_table(["Config", "Precision", "Status", "First loss", "Last loss",
                                          "Peak MiB", "ms/iter", "Error"], rows, align="lll" + "r" * 4 + "l"))
    if name == "demo" and s.get("results"):
        rows = [[f"`{r['config']}`", r["status"], _f(r.get("iters"), "d"), _f(r.get("AP"), ".2f"),
                 _f(r.get("AP50"), ".2f"), _f(r.get("first_loss"), ".3f"), _f(r.get("last_loss"), ".3f"),
                 _f(r.get("elapsed_s"), ".0f"), (r.get("error") or "")[:80]] for r in s["results"]]
        out.append("\n" + markdown_table(["Config", "Status", "Iters", "AP", "AP50", "First loss",
                                          "Last loss", "Time s", "Error"], rows, align="ll" + "r" * 6 + "l"))
    if name == "benchmarks" and s.get("benchmarks"):
        out.append("\n" + render_benchmarks_markdown(s["benchmarks"]))
    return out


def render_report_markdown(report: dict) -> str:
    """``report.md``: environment, then each stage's status and numbers."""
    env = report.get("env", {})
    head = [
        f"# aadet GPU check: {report['status']}\n\n",
        "| | |\n|:---|:---|\n",
        *(f"| {k} | {env.get(k)} |\n" for k in ("device_name", "torch", "cuda", "triton", "detectron2",
                                               "python", "driver")),
    ]
    body = [line for name, s in report["stages"].items() for line in _stage_markdown(name, s)]
    return "".join(head + body) + "\n"
