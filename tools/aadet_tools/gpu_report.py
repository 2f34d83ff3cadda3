"""The GPU check's report: benchmark JSON -> ``docs/benchmarks_cuda.json`` with target verdicts,
pytest junit XML -> a test summary, and the stages of ``tools/gpu_check.py`` merged into one
``report.md`` / ``report.json``.

Everything here is a pure function of dicts / XML text (no CUDA, no model): the GPU machine runs
the tools, this module reads what they wrote, and CPU unit tests feed it synthetic inputs
(``tests/tools/test_gpu_check.py``).

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
measured or failed: the report says so instead of passing it). The targets are defined at
:data:`TARGET_SIZE` and :data:`TARGET_BATCH`; numbers measured otherwise (``--quick``, a smoke
run) get ``"comparable": false`` and ``status`` ``"not comparable"`` instead of a verdict.
"""

import os
import xml.etree.ElementTree as ET
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence

from aadet.analysis.report import markdown_table, mib, ratio

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
    "TARGET_SIZE",
    "TARGET_BATCH",
    "NOT_COMPARABLE",
    "parse_junit",
    "tests_stage_result",
    "STAGES",
    "StaleStageError",
    "stale_stages",
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
)
#: The layer every layer ratio is taken against (``tools/benchmark_layers.py``'s impl name).
LAYER_REFERENCE = "conv3x3"
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
#: The performance targets: the attention models' speed and memory as ratios to the conv R50
#: RetinaNet, the SASA layer's to a 3x3 conv (one definition; every precision measured gets a
#: verdict).
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
#: What the targets are defined at: detectors on 640x640 images, batch 8 (the layer benchmark at
#: the same batch). Numbers measured at other sizes are not compared with them.
TARGET_SIZE = (640, 640)
TARGET_BATCH = 8
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
    configs: Sequence[dict],
    layers: Sequence[dict],
    targets: Iterable[Target] = TARGETS,
    *,
    comparable: bool = True,
) -> List[dict]:
    """A verdict per target and precision measured (see the module docstring for the fields).

    ``comparable=False`` (numbers not measured at :data:`TARGET_SIZE` / :data:`TARGET_BATCH`):
    a measured value gets ``status`` ``"not comparable"``, never ``"pass"`` or ``"miss"``.
    """
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
                elif not comparable:
                    v.update(status="not comparable", note=NOT_COMPARABLE)
                elif value <= t.limit:
                    v.update(status="pass", excess=0.0, excess_pct=0.0)
                else:
                    v.update(status="miss", excess=value - t.limit, excess_pct=100.0 * (value / t.limit - 1.0))
                out.append(v)
    return out


def _not_comparable_why(size, batch, layer_batches: Iterable, smoke: bool) -> Optional[str]:
    """Why numbers measured at ``size`` / ``batch`` (detectors) and ``layer_batches`` cannot be
    held against the targets (None: they can)."""
    why = []
    if smoke:
        why.append("a --quick smoke run")
    if size is not None and list(size) != list(TARGET_SIZE):
        why.append(f"images {'x'.join(str(s) for s in size)}")
    if batch is not None and batch != TARGET_BATCH:
        why.append(f"batch {batch}")
    why += [f"layer batch {b}" for b in sorted(set(layer_batches), key=str) if b != TARGET_BATCH]
    if not why:
        return None
    return (f"{', '.join(why)}; the targets are defined at {TARGET_SIZE[0]}x{TARGET_SIZE[1]}, "
            f"batch {TARGET_BATCH}")


def benchmarks_cuda(
    config_reports: Sequence[dict],
    layer_reports: Sequence[dict] = (),
    *,
    amp_dtype: Optional[str] = None,
    targets: Iterable[Target] = TARGETS,
    smoke: bool = False,
) -> dict:
    """``docs/benchmarks_cuda.json`` from the benchmark tools' JSON outputs (see module docstring).

    Args:
        config_reports: ``tools/benchmark.py`` outputs (e.g. one run with ``--amp both``).
        layer_reports: ``tools/benchmark_layers.py`` outputs (one per AMP setting).
        amp_dtype: AMP dtype of outputs that do not record theirs.
        smoke: the numbers come from a smoke run (``tools/gpu_check.py --quick``): no target
            verdicts, whatever the sizes. Sizes or batches other than :data:`TARGET_SIZE` /
            :data:`TARGET_BATCH` have the same effect.

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
    why = _not_comparable_why(first.get("size"), first.get("batch"),
                              [r.get("batch") for r in layer_reports], smoke)
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
        "comparable": why is None,
        "not_comparable_why": why,
        "configs": configs,
        "layers": layers,
        "targets": evaluate_targets(configs, layers, targets, comparable=why is None),
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


def tests_stage_result(junit: Optional[dict], exit_code) -> dict:
    """Verdict of the ``tests`` stage (``pytest -m cuda``) from its parsed junit XML and exit code.

    ``"ok"`` only when CUDA tests ran and every one of them passed: a failure, an error, a test
    skipped (on the GPU machine a skipped CUDA test is a check that did not happen: missing
    Triton, a wrong device, ...) or no test at all fails the stage, and ``error`` says which.

    Returns:
        ``{"status": "ok" | "failed", "error"?: str}``.
    """
    if junit is None:
        return {"status": "failed", "error": f"pytest wrote no junit XML (exit {exit_code})"}
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
#: The stages of ``tools/gpu_check.py`` in the order they run: name -> what it checks.
STAGES = {
    "tests": "pytest -m cuda: every attention route (fp32, bf16 and fp16 autocast) vs the float64 brute force, "
             "the compiled Triton kernels; ok only if every CUDA test ran and passed (a skip fails it)",
    "configs": "every config in configs/ built on CUDA and trained a few iterations in fp32 and bf16 AMP",
    "demo": "short real training of the demo configs on CUDA, with their AP on trees_val and trees_test",
    "benchmarks": "640x640 batch 8 speed/memory of the R50 configs and the SASA layer (fp32, bf16 AMP)",
}


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


def merge_stage_results(
    stage_results: Dict[str, dict], env: Optional[dict] = None, *, stale: Optional[Dict[str, dict]] = None
) -> dict:
    """One report from the stages' results (each ``{"status": "ok" | "failed" | "skipped", ...}``).

    Stages run in separate processes or separate machine calls write one JSON each; merging
    them keeps the newest result of each stage. ``status`` of the whole report is ``"ok"`` only
    when every stage in :data:`STAGES` ran and passed. ``stale`` (from :func:`stale_stages`,
    merged anyway) marks stages of another commit: each gets ``"stale"`` and the report lists
    them in ``"stale_stages"``. ``"quick"``: some stage was a ``--quick`` smoke run.
    """
    unknown = sorted(set(stage_results) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
    stages = {name: dict(stage_results.get(name, {"status": "not run"})) for name in STAGES}
    for name, info in (stale or {}).items():
        stages[name]["stale"] = info
    envs = [s["env"] for s in stages.values() if s.get("env")]
    env = env or (envs[-1] if envs else {})
    ok = all(s["status"] == "ok" for s in stages.values())
    return {"status": "ok" if ok else "incomplete" if all(
        s["status"] in ("ok", "not run") for s in stages.values()) else "failed",
        "quick": any(s.get("quick") for s in stages.values()),
        "stale_stages": sorted(stale or {}, key=list(STAGES).index),
        "env": env, "stages": stages}


def _stage_markdown(name: str, s: dict) -> List[str]:
    out = [f"\n## {name}: {s['status']}\n\n{STAGES[name]}."]
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


def render_report_markdown(report: dict) -> str:
    """``report.md``: environment, then each stage's status and numbers."""
    env = report.get("env", {})
    notes = []
    if report.get("quick"):
        notes.append(NOT_COMPARABLE)
    if report.get("stale_stages"):
        notes.append("stale stages from another commit: " + ", ".join(report["stale_stages"]))
    title = report["status"] + (f" ({'; '.join(notes)})" if notes else "")
    head = [
        f"# aadet GPU check: {title}\n\n",
        "| | |\n|:---|:---|\n",
        *(f"| {k} | {env.get(k)} |\n" for k in ("device_name", "torch", "cuda", "triton", "detectron2",
                                               "python", "driver")),
    ]
    body = [line for name, s in report["stages"].items() for line in _stage_markdown(name, s)]
    return "".join(head + body) + "\n"
