"""The GPU check's run records (``docs/runs/gpu/<commit>-<gpu>/``) rendered for the docs: the
GPU run section of ``BENCHMARKS.md`` and the README's one-line headline (``dev/update_docs.py``
writes and checks both through :mod:`aadet_dev.generated_docs`).

A record folder holds what the calls of the loan script returned (each call's ``report.json``,
``report.md``, ``stage_*.json`` and logs, renamed with the call's prefix) and ``record.json``,
what no report says::

    {"commit": "<40 hex>", "date": "2026-11-28", "machine": "...", "prepare": "<command>",
     "note": "..." (optional), "calls": [{"name": "first", "command": "<command>",
                                         "report": "first_report.json", "log": "first_loan.log"}]}

Each stage's result is taken from the call whose report ran it (a later call wins); the stages are
the reports' own, as the check had them at the record's commit. The benchmark rows and their
ratios are the stage's own (ratios to the conv R50 of the same run and precision, unrounded); the
target verdicts are taken again from those rows against today's
:data:`aadet_dev.gpu_report.TARGETS`. Every number is rounded once, here, from those values.
"""
import json
import os
import re
from typing import Dict, List, Optional, Sequence

from aadet.benchmark.report import markdown_table

from .gpu_report import (
    BENCHMARK_CONFIGS,
    PROTOCOL,
    TARGETS,
    config_name,
    evaluate_targets,
)

__all__ = [
    "ANCHOR",
    "latest_record",
    "load_record",
    "case_rows",
    "short_error",
    "render_record",
    "render_headline",
    "render_targets_intro",
]

#: The heading of BENCHMARKS.md above the rendered record, as a link anchor.
ANCHOR = "the-last-gpu-run"
_BASELINE = config_name(BENCHMARK_CONFIGS[0])
_ENV_KEYS = ("device_name", "torch", "cuda", "triton", "driver", "python", "detectron2")


# ----------------------------------------------------------------------------- reading a record
def latest_record(root: str) -> Optional[str]:
    """The record folder under ``root`` with the latest ``date`` (then name), or None."""
    if not os.path.isdir(root):
        return None
    found = []
    for name in sorted(os.listdir(root)):
        manifest = os.path.join(root, name, "record.json")
        if os.path.isfile(manifest):
            with open(manifest) as f:
                found.append((json.load(f).get("date", ""), name))
    return os.path.join(root, max(found)[1]) if found else None


def load_record(folder: str, repo: Optional[str] = None) -> dict:
    """``record.json`` with each call's report read in (``calls[i]["result"]``), the stages merged
    (``stages``: name -> the stage's result from the call that ran it), the environment shared by the
    stages (``env``) and ``path`` (the folder, relative to ``repo`` when given).

    Raises:
        ValueError: a stage ran at another commit than the record's, or the stages' GPUs or
            versions differ.
    """
    with open(os.path.join(folder, "record.json")) as f:
        record = json.load(f)
    record["path"] = os.path.relpath(folder, repo) if repo else folder
    stages: Dict[str, dict] = {}
    for call in record["calls"]:
        with open(os.path.join(folder, call["report"])) as f:
            call["result"] = json.load(f)
        for name, stage in call["result"]["stages"].items():
            if stage.get("status", "not run") != "not run" or name not in stages:
                stages[name] = dict(stage, call=call["name"])
    for name in ("tests", "configs", "benchmarks", "demo"):  # the stages rendered, run or not
        stages.setdefault(name, {"status": "not run"})
    env: Dict[str, object] = {}
    for name, stage in stages.items():
        if stage["status"] == "not run":
            continue
        if stage.get("commit") != record["commit"]:
            raise ValueError(f"{record['path']}: stage {name} ran at commit {stage.get('commit')}, "
                             f"the record is of {record['commit']}")
        for key in _ENV_KEYS:
            value = stage.get("env", {}).get(key)
            if value is not None and env.setdefault(key, value) != value:
                raise ValueError(f"{record['path']}: the stages differ in {key}: {env[key]!r}, {value!r}")
    record["stages"], record["env"] = stages, env
    return record


# ----------------------------------------------------------------------------- what happened to each case
_SHORT_ERRORS = (  # (pattern, short form): the failures the check reports, named in a few words
    (re.compile(r"Loss became infinite or NaN at iteration=(\d+)"), "NaN loss at iteration {}"),
    (re.compile(r"iteration (\d+): non-finite gradients"), "non-finite gradients at iteration {}"),
    (re.compile(r"timed out"), "timed out"),
    (re.compile(r"stage budget spent"), "not reached (stage budget spent)"),
)


def short_error(error: str) -> str:
    """A few words for a case's error: ``"NaN loss at iteration 0"``, ``"timed out"``, ... (else
    its first 80 characters)."""
    for pattern, short in _SHORT_ERRORS:
        m = pattern.search(error)
        if m:
            return short.format(*m.groups())
    return error[:80]


def _cut_off(stage: dict) -> bool:
    """Whether the stage stopped on its time budget (what it had not finished is cut off)."""
    return stage["status"] != "ok" and "timeout" in (stage.get("error") or "")


def case_rows(stage: dict) -> List[dict]:
    """Every config x precision the benchmarks stage had to measure (:data:`BENCHMARK_CONFIGS` x
    :data:`PROTOCOL` precisions, then any other row), each the stage's row (or only ``config`` and
    ``precision`` where it has none) with ``status``: ``"measured"``, ``"failed"`` (its ``error``)
    or ``"cut off"`` (the stage stopped on its budget before the case finished) / ``"not measured"``."""
    bench = stage.get("benchmarks") or {"configs": []}
    rows = {(r["config"], r["precision"]): r for r in bench["configs"]}
    keys = [(config_name(c), p) for c in BENCHMARK_CONFIGS for p in PROTOCOL.precisions]
    keys += [k for k in rows if k not in keys]
    out = []
    for key in keys:
        row = dict(rows.get(key, {"config": key[0], "precision": key[1]}))
        if "error" in row:
            row["status"] = "failed"
        elif row.get("train_ms") is not None:
            row["status"] = "measured"
        else:
            row["status"] = "cut off" if _cut_off(stage) else "not measured"
        out.append(row)
    return out


def _why(stage: dict, row: Optional[dict]) -> str:
    if row is not None and row.get("error"):
        return short_error(row["error"])
    return "cut off" if _cut_off(stage) else "not measured"


def _verdicts(stage: dict) -> List[dict]:
    """Today's targets judged on the stage's rows; ``why`` says why a value is missing."""
    bench = stage.get("benchmarks") or {"configs": [], "layers": [], "comparable": True}
    configs = {(r["config"], r["precision"]): r for r in bench["configs"]}
    out = []
    for v in evaluate_targets(bench["configs"], bench["layers"], TARGETS, comparable=bench.get("comparable", True)):
        if v["status"] == "missing":
            v["why"] = _why(stage, configs.get((v["subject"], v["precision"])))
        out.append(v)
    return out


# ----------------------------------------------------------------------------- rendering
def _f(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def _x(x) -> str:
    return "–" if x is None else f"{x:.2f}x"


def _short_commit(record: dict) -> str:
    return record["commit"][:7]


def _env_line(record: dict) -> str:
    env = record["env"]
    driver, _, memory = str(env.get("driver", "")).partition(", ")
    gpu = f"**{env.get('device_name', 'unknown GPU')}**" + (f" ({memory})" if memory else "")
    detectron2 = str(env.get("detectron2", "")).split(" (")[0]
    return (f"{gpu}, driver {driver or '–'}; torch {env.get('torch')}, CUDA {env.get('cuda')}, Triton "
            f"{env.get('triton')}, Detectron2 {detectron2 or '–'}, Python {env.get('python')}")


def _budget(stage: dict) -> str:
    if stage.get("elapsed_s") is None:
        return ""
    return f" ({stage['elapsed_s']:.0f} s of its {_f(stage.get('budget_s'), '.0f')} s budget)"


def _stage_word(stage: dict) -> str:
    if stage["status"] == "not run":
        return "not run"
    return "cut off" if _cut_off(stage) else stage["status"]


def _stop_reasons(stage: dict) -> List[str]:
    """What stopped the stage's tools, from its error (the commands left out) and notes."""
    parts = [p.split(": ", 1)[0] for p in (stage.get("error") or "").split("; ")
             if p and not p.startswith("not measured")]
    parts += [n for n in stage.get("notes", []) if not n.startswith("wrote ")]
    return list(dict.fromkeys(parts))


def _calls_table(record: dict) -> str:
    rows = []
    for call in record["calls"]:
        ran = [(n, s) for n, s in call["result"]["stages"].items() if s.get("status", "not run") != "not run"]
        stages = "; ".join(f"{n}: {_stage_word(s)}{_budget(s)}" for n, s in ran)
        rows.append([call["name"], f"`{call['command']}`", stages, call["result"]["status"]])
    return markdown_table(["Call", "Command", "Stages", "Check"], rows, align="llll")


def _tests_line(stage: dict) -> str:
    if stage["status"] == "not run":
        return "**Tests** (`pytest -m cuda`): not run.\n"
    j = stage.get("junit")
    counts = (f"{j['tests']} tests: {j['passed']} passed, {j['failed']} failed, {j['errors']} errors, "
              f"{j['skipped']} skipped" if j else (stage.get("error") or "no junit XML")[:200])
    workers = f", {stage['workers']} pytest workers" if stage.get("workers") else ""
    return f"**Tests** (`pytest -m cuda`): {_stage_word(stage)}{_budget(stage)}{workers}; {counts}.\n"


def _benchmarks_section(stage: dict) -> List[str]:
    if stage["status"] == "not run" or not stage.get("benchmarks"):
        return [f"\n**Benchmarks**: {_stage_word(stage)}.\n"]
    bench = stage["benchmarks"]
    size = "x".join(str(s) for s in bench.get("size") or ()) or "–"
    out = [f"\n**Benchmarks** ({size}, batch {bench.get('batch')}, median of {bench.get('iters')} timed "
           f"iterations after {bench.get('warmup')} warm-up; ratios to `{bench.get('baseline')}` of the same "
           f"run and precision): {_stage_word(stage)}{_budget(stage)}."]
    reasons = _stop_reasons(stage)
    if reasons:
        out.append(" What stopped it:\n\n" + "".join(f"- {r}\n" for r in reasons))
    else:
        out.append("\n")
    rows = []
    for r in case_rows(stage):
        if r["status"] == "measured":
            note = "baseline" if r["config"] == bench.get("baseline", _BASELINE) else ""
        elif r["status"] == "failed":
            note = f"**{short_error(r['error'])}**"
        else:
            note = f"**{r['status']}**"
        rows.append([f"`{r['config']}`", r["precision"], _f(r.get("train_ms"), ".1f"), _x(r.get("train_ms_ratio")),
                     _f(r.get("infer_ms"), ".1f"), _x(r.get("infer_ms_ratio")), _f(r.get("train_peak_mib"), ".0f"),
                     _x(r.get("train_peak_mib_ratio")), note])
    out.append("\n" + markdown_table(
        ["Model", "Precision", "Train step ms", "× conv R50", "Inference ms", "× conv R50", "Train peak MiB",
         "× conv R50", "Note"], rows, align="ll" + "r" * 6 + "l"))
    errors: Dict[str, List[str]] = {}
    for r in case_rows(stage):
        if r["status"] == "failed":
            errors.setdefault(r["error"], []).append(f"`{r['config']}` {r['precision']}")
    for error, cases in errors.items():
        out.append(f"\n{', '.join(cases)}: `{error}`\n")
    if bench.get("compiled"):
        rows = [[f"`{r['config']}`", r["precision"], _f(r.get("train_ms"), ".1f"), _x(r.get("train_ms_ratio")),
                 _x(r.get("eager_train_ms_ratio")), _f(r.get("infer_ms"), ".1f"), _x(r.get("infer_ms_ratio")),
                 _x(r.get("eager_infer_ms_ratio")), short_error(r["error"]) if r.get("error") else ""]
                for r in bench["compiled"]]
        out.append("\n" + markdown_table(
            ["Compiled (MODEL.COMPILE, no target)", "Precision", "Train step ms", "× compiled conv R50", "× own eager",
             "Inference ms", "× compiled conv R50", "× own eager", "Note"], rows, align="ll" + "r" * 6 + "l"))
    if bench.get("layers"):
        rows = [[f"`{r['layer']}`", r["precision"], _f(r.get("train_ms"), ".2f"), _x(r.get("train_ms_ratio")),
                 _f(r.get("train_peak_mib"), ".0f"), _x(r.get("train_peak_mib_ratio")),
                 short_error(r["error"]) if r.get("error") else ""] for r in bench["layers"]]
        out.append("\n" + markdown_table(["Layer (fwd+bwd)", "Precision", "ms", "× 3x3 conv", "Peak MiB",
                                          "× 3x3 conv", "Note"], rows, align="ll" + "r" * 4 + "l"))
    not_measured = [m.split(" ", 1)[1] for m in bench.get("missing", ()) if m.startswith("layers ")]
    informational = bench.get("informational_missing", ())
    suites: Dict[str, List[str]] = {}
    for m in informational:
        suites.setdefault(m.split(" ", 1)[0], []).append(m.split(" ", 1)[1])
    compiled = suites.pop("compiled", None)  # informational_missing's "compiled <precision>"
    if not_measured or suites:
        why = "cut off" if _cut_off(stage) else "not measured"
        lines = [f"the SASA layer (its targets) {why} in {' and '.join(not_measured)}"] if not_measured else []
        lines += [f"the `{suite}` layer (no target) not measured in {' and '.join(ps)}" for suite, ps in suites.items()]
        out.append("\nLayers: " + "; ".join(lines) + ".\n")
    if compiled:
        out.append(f"\nCompiled models (MODEL.COMPILE, no target): not measured in {' and '.join(compiled)}.\n")
    return out


def _targets_table(stage: dict) -> str:
    rows = []
    for v in _verdicts(stage):
        if v["status"] == "pass":
            verdict = "met"
        elif v["status"] == "miss":
            verdict = f"**missed** by {v['excess']:.2f} ({v['excess_pct']:+.0f}%)"
        elif v["status"] == "missing":
            verdict = "not measured" if v["why"] == "not measured" else f"not measured: {v['why']}"
        else:
            verdict = v["status"]
        rows.append([v["target"], f"`{v['subject']}`", v["precision"], _x(v["value"]), f"<= {v['limit']:.2f}x",
                     verdict, v.get("bound", "–")])
    headers = ["Target (CUDA)", "Subject", "Precision", "Measured", "Target", "Verdict"]
    if any(row[-1] != "–" for row in rows):  # a run whose benchmarks were profiled
        return markdown_table(headers + ["What bounds it (one profiled step)"], rows, align="lllrrll")
    return markdown_table(headers, [row[:-1] for row in rows], align="lllrrl")


def _config_cell(r: Optional[dict], base: Optional[dict] = None) -> str:
    """A config's cell: "finite", with its median step where the stage timed it and its ratio to
    ``base`` (the conv R50's row of the same precision) where that has one; else why not."""
    if r is None:
        return "–"
    if r["status"] == "ok":
        ms = r.get("step_ms")
        if ms is None:
            return "finite"
        base_ms = (base or {}).get("step_ms") if (base or {}).get("status") == "ok" else None
        return f"finite, {ms:.0f} ms" + (f" ({ms / base_ms:.2f}x)" if base_ms else "")
    if r["status"] == "skipped":
        return short_error(r.get("error") or "not reached")
    error = r.get("error") or ""
    if error.startswith("FloatingPointError"):
        return f"**not finite**: {short_error(error)}"
    return f"**{short_error(error)}**" if error else f"**{r['status']}**"


def _configs_section(stage: dict) -> List[str]:
    if stage["status"] == "not run":
        return ["\n**Configs**: not run.\n"]
    results = stage.get("results", [])
    size = stage.get("size")
    shape = (f"at {size}x{size}, batch {stage.get('batch')}" if isinstance(size, int)
             else "at each config's own training size")
    ok = sum(r["status"] == "ok" for r in results)
    out = [f"\n**Configs** (every config trained {stage.get('iters')} iterations {shape}, losses and gradients "
           f"checked finite): {_stage_word(stage)}{_budget(stage)}; {ok} of {len(results)} config x precision "
           "runs finite.\n"]
    precisions = list(dict.fromkeys(r["precision"] for r in results))
    by = {(r["config"], r["precision"]): r for r in results}
    configs = list(dict.fromkeys(r["config"] for r in results))
    rows = [[f"`{c}`"] + [_config_cell(by.get((c, p)), by.get((_BASELINE, p))) for p in precisions] for c in configs]
    if any(r.get("step_ms") is not None for r in results):
        out.append(f"\nA finite run's median training step (ms; the first of its iterations warms up) and its ratio "
                   f"to `{_BASELINE}`'s of the same run and precision, {shape}, with the config's optimizer.\n")
    out.append("\n" + markdown_table(["Config"] + precisions, rows, align="l" * (len(precisions) + 1)))
    errors: Dict[str, List[str]] = {}
    for r in results:
        if r["status"] == "failed" and (r.get("error") or "").startswith("FloatingPointError"):
            errors.setdefault(r["error"], []).append(f"`{r['config']}` {r['precision']}")
    for error, cases in errors.items():
        out.append(f"\n{', '.join(cases)}: `{error}`\n")
    return out


def render_record(record: Optional[dict]) -> str:
    """BENCHMARKS.md's GPU run section: where and what ran, the tests, the benchmark cases with their
    ratios to the conv R50, today's targets judged on them, the configs stage."""
    if record is None:
        return "No GPU run recorded yet (no record under `docs/runs/gpu/`).\n"
    stages = record["stages"]
    out = [f"Commit `{_short_commit(record)}`, {record['date']}, on {record['machine']}: {_env_line(record)}. "
           f"Record: [{record['path']}]({record['path']}/). After `{record['prepare']}` here, "
           f"{len(record['calls'])} call(s) there (`$OUT`: the call's output folder):\n\n",
           _calls_table(record) + "\n"]
    if record.get("note"):
        out.append(f"{record['note']}\n")
    out.append("\n" + _tests_line(stages["tests"]))
    out += _benchmarks_section(stages["benchmarks"])
    bench = stages["benchmarks"].get("benchmarks")
    if bench:
        if not bench.get("comparable", True):
            out.append(f"\nNot comparable with the targets: {bench.get('not_comparable_why')}.\n")
        out.append("\n" + _targets_table(stages["benchmarks"]))
    out += _configs_section(stages["configs"])
    out.append(f"\n**Demo**: {_stage_word(stages['demo'])}.\n")
    return "".join(out)


def _train_time_targets() -> Sequence:
    """The models' training-step targets, one per model (its first: AA-R50 has two limits)."""
    first = {}
    for t in TARGETS:
        if t.section == "configs" and t.metric == "train_ms_ratio":
            first.setdefault(t.subject, t)
    return list(first.values())


def render_headline(record: Optional[dict], link: str = f"BENCHMARKS.md#{ANCHOR}") -> str:
    """The README's line: the run, whether it finished, the models' training-step ratios to the conv
    R50 (and what stopped the cases that have none), the targets' tally, and the link."""
    if record is None:
        return f"On GPUs nothing has been measured yet ([BENCHMARKS.md]({link.split('#')[0]}#gpu)).\n"
    stages = record["stages"]
    ran_first = sorted(stages.items(), key=lambda item: item[1]["status"] == "not run")
    unfinished = [f"{name} {_stage_word(s)}" for name, s in ran_first if s["status"] != "ok"]
    bench = stages["benchmarks"]
    rows = {(r["config"], r["precision"]): r for r in case_rows(bench)}
    parts = []
    for t in _train_time_targets():
        measured, other = [], {}
        for p in PROTOCOL.precisions:
            r = rows.get((t.subject, p), {"status": "not measured"})
            if r["status"] == "measured":
                measured.append(f"{_x(r['train_ms_ratio'])} ({p})")
            else:
                other.setdefault(short_error(r["error"]) if r["status"] == "failed" else r["status"], []).append(p)
        label = t.name.replace(" RetinaNet", "").replace(" train time", "")
        said = ([" / ".join(measured)] if measured else []) + [f"{why} in {' and '.join(ps)}"
                                                               for why, ps in other.items()]
        parts.append(f"{label} {', '.join(said)}")
    verdicts = _verdicts(bench)
    tally = {s: sum(v["status"] == s for v in verdicts) for s in ("pass", "miss", "missing", "not comparable")}
    targets = (f"targets {tally['pass']} met, {tally['miss']} missed, {tally['missing']} not measured"
               if not tally["not comparable"] else "targets not judged (a run short of their protocol)")
    finished = "did not finish (" + ", ".join(unfinished) + ")" if unfinished else "finished"
    return (f"On GPUs, the last check ({record['env'].get('device_name')}, `{_short_commit(record)}`) "
            f"{finished}. Its training steps against the conv R50's: {'; '.join(parts)}; {targets}: "
            f"[BENCHMARKS.md]({link}).\n")


def render_targets_intro(record: Optional[dict]) -> str:
    """The line above the targets in BENCHMARKS.md while no complete run has written
    ``docs/benchmarks_cuda.json``."""
    if record is None:
        return "**Not measured yet**: no GPU has run `make gpu-check`.\n\n"
    return (f"**No complete run yet**: only a complete benchmarks stage writes `docs/benchmarks_cuda.json`; "
            f"in the last run (`{_short_commit(record)}`, [below](#{ANCHOR})) it was "
            f"{_stage_word(record['stages']['benchmarks'])}.\n\n")
