"""The demo's results, computed from the run summaries committed under ``docs/runs/``.

``dev/record_demo_results.py`` copies the ``run_summary.json`` of finished runs into
``docs/runs/demo`` (or ``docs/runs/learning``); ``dev/update_docs.py`` renders every demo figure of
the docs from them: ``docs/demo_results.json`` (the model table's demo column reads it), the
tables of ``docs/demo_results.md`` and the learning table of ``docs/testing.md``.

Runs are grouped into *entries*: the same config file with the same recipe overrides (the
command-line options other than :data:`~aadet.engine.run_summary.NOT_RECIPE_KEYS`: output folder,
seed, device, loader workers, weights). Overrides that set a key to the value its config file has
today say nothing and are left out of the name (:func:`recipe_opts` with ``committed``), so a
run is named after what it trained, as the configs are today. A run recorded with an older
version of its config no longer resolves to what it recorded; ``dev/tests/test_generated_docs.py``
fails on it, so that it cannot back a number of today's.

Protocol (docs/demo_results.md): recipe choices are made on ``trees_val``; ``trees_test`` is
evaluated and reported, never decides. Each split's noise is stated with its numbers
(:func:`sampling_error`, :data:`SPLIT_OBJECTS`).
"""
import math
import os
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from aadet.engine.run_summary import BOX_METRICS, NOT_RECIPE_KEYS, load_summaries

__all__ = [
    "VAL",
    "TEST",
    "BASELINE",
    "DEMOS",
    "SEEDS",
    "SPLIT_OBJECTS",
    "sampling_error",
    "recipe_opts",
    "entry_name",
    "group_runs",
    "build_demo_results",
    "stats_cell",
    "render_headline_table",
    "render_noise_table",
    "render_learning_table",
    "replace_block",
    "BLOCK_BEGIN",
    "BLOCK_END",
]

#: The split recipe choices are made on, and the split that is only reported.
VAL, TEST = "trees_val", "trees_test"
#: The conv demo: the attention demos' ratios are to its mean.
BASELINE = "trees_R_26_slim_FPN"
#: The committed demo configs, in the order of the headline table.
DEMOS = (
    BASELINE,
    "trees_AA_R_26_slim_FPN",
    "trees_SASA_R_26_slim_FPN",
    "trees_SASA_full_attention_R_26_slim",
    "trees_Halo_R_26_slim_FPN",
    "trees_CCNet_R_26_slim_FPN",
)
#: The seeds every config runs, in table order.
SEEDS = (42, 7, 123)
#: Objects (tree crowns) in each evaluated split of ``make data`` (tests/data/test_demo_data.py
#: checks them against the prepared annotations): a split's AP50 noise follows from its count.
SPLIT_OBJECTS: Mapping[str, int] = {VAL: 414, TEST: 37}

BLOCK_BEGIN = "<!-- generated:{name}:begin -->"
BLOCK_END = "<!-- generated:{name}:end -->"


def sampling_error(ap50: float, objects: int) -> float:
    """One standard deviation of one model's AP50 (in points) from the finite object count of a
    split: ``100 sqrt(p (1 - p) / n)`` at ``p = ap50 / 100`` (AP50 taken as the share of ``n``
    objects found: a binomial approximation, before any seed-to-seed spread)."""
    p = min(max(ap50 / 100.0, 0.0), 1.0)
    return 100.0 * math.sqrt(p * (1.0 - p) / objects)


def recipe_opts(opts: Sequence[str], committed: Optional[Callable[[str, str], bool]] = None,
                ) -> Tuple[Tuple[str, str], ...]:
    """The ``(KEY, VALUE)`` overrides of a run's options that change what is trained.

    ``committed(key, value)``: whether ``value`` is what the run's config file sets today; such
    overrides change nothing and are left out (None: keep every override)."""
    pairs = list(zip(opts[0::2], opts[1::2]))
    return tuple((k, v) for k, v in pairs
                 if k not in NOT_RECIPE_KEYS and not (committed is not None and committed(k, v)))


def entry_name(summary: Mapping, committed: Optional[Callable[[str, str, str], bool]] = None) -> str:
    """``<config name>`` or ``<config name> KEY=VALUE ...`` (module docstring); a run with its
    attention broken on purpose (``tests/helpers/broken_attention.py``) adds ``broken=<mutation>``.

    ``committed(config_file, key, value)``: see :func:`recipe_opts`."""
    config = os.path.splitext(os.path.basename(summary["config_file"]))[0]
    same = None if committed is None else (lambda k, v: committed(summary["config_file"], k, v))
    extra = [f"{k}={v}" for k, v in recipe_opts(summary.get("opts", []), same)]
    if summary.get("broken_attention"):
        extra.append(f"broken={summary['broken_attention']}")
    return " ".join([config, *extra])


def _seed_order(summary: Mapping) -> Tuple[int, int]:
    seed = summary["seed"]
    return (SEEDS.index(seed) if seed in SEEDS else len(SEEDS), seed)


def group_runs(summaries: Iterable[Mapping], committed=None) -> "OrderedDict[str, List[Mapping]]":
    """Summaries by entry name (:func:`entry_name`), each list in :data:`SEEDS` order."""
    groups: "OrderedDict[str, List[Mapping]]" = OrderedDict()
    for s in sorted(summaries, key=_seed_order):
        groups.setdefault(entry_name(s, committed), []).append(s)
    return groups


def _stats(values: Sequence[float]) -> Dict[str, float]:
    """Mean, min and max, unrounded: a table rounds once, when it formats them."""
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def _had_cpu_alone(summary: Mapping) -> bool:
    """Whether a run's wall time counts: its process got at least 3/4 of its threads' worth of
    CPU time (``cpu_seconds``) over the training."""
    threads = summary["machine"].get("torch_threads") or 1
    return (summary.get("cpu_seconds") is not None and bool(summary.get("train_seconds"))
            and summary["cpu_seconds"] >= 0.75 * threads * summary["train_seconds"])


def _entry(runs: Sequence[Mapping], committed=None) -> Dict[str, object]:
    alone = [r for r in runs if not r.get("eval_only") and _had_cpu_alone(r)]
    datasets = sorted({d for r in runs for d in r["metrics"]}, key=lambda d: (d != VAL, d))
    same = None if committed is None else (lambda k, v: committed(runs[0]["config_file"], k, v))
    out: Dict[str, object] = {
        "config_file": runs[0]["config_file"],
        "overrides": dict(recipe_opts(runs[0].get("opts", []), same)),
        "seeds": [r["seed"] for r in runs],
        "runs": [r["_file"] for r in runs],
        "machines": sorted({f"{r['machine']['cpu']}, {r['machine']['cpu_count']} cores" for r in runs}),
        "train_minutes": _stats([r["train_seconds"] / 60 for r in alone]) if alone else None,
        "timed_runs": len(alone),
        "commits": sorted({(r.get("commit") or "unknown")[:12] for r in runs}),
    }
    for d in datasets:
        have = [r for r in runs if d in r["metrics"]]
        out[d] = {k: _stats([r["metrics"][d][k] for r in have]) for k in BOX_METRICS}
        out[d]["n"] = len(have)
    return out


def build_demo_results(folder: str, committed=None) -> "OrderedDict[str, Dict[str, object]]":
    """Every entry from the summaries in ``folder``, sorted by name: config file, overrides,
    seeds, summary files, CPU(s), training minutes (runs that had the CPU to themselves) and, per
    evaluated dataset, the mean/min/max of AP, AP50, AP75 and ``n``. ``AP`` / ``AP50`` at the top
    level are the val means (the model table's demo column reads them)."""
    results = OrderedDict()
    for name, runs in sorted(group_runs(load_summaries(folder), committed).items()):
        e = _entry(runs, committed)
        if VAL in e:
            e["AP"], e["AP50"] = e[VAL]["AP"]["mean"], e[VAL]["AP50"]["mean"]
        results[name] = e
    return results


def stats_cell(stats: Optional[Mapping], n: int, digits: int = 1) -> str:
    """``mean (min–max)`` of a metric over ``n`` runs; ``mean (1 run)``; ``–`` without runs."""
    if stats is None:
        return "–"
    if n == 1:
        return f"{stats['mean']:.{digits}f} (1 run)"
    return f"{stats['mean']:.{digits}f} ({stats['min']:.{digits}f}–{stats['max']:.{digits}f})"


def _ap50_cell(entry: Mapping, split: str) -> str:
    """``mean ±e (min–max)``: ``e`` the sampling error of one model at the mean (:func:`sampling_error`)."""
    if split not in entry:
        return "–"
    a, n = entry[split]["AP50"], entry[split]["n"]
    cell = stats_cell(a, n)
    err = f" ±{sampling_error(a['mean'], SPLIT_OBJECTS[split]):.1f}" if split in SPLIT_OBJECTS else ""
    mean, _, rest = cell.partition(" ")
    return f"{mean}{err} {rest}"


def render_headline_table(results: Mapping[str, Mapping], names: Sequence[str] = DEMOS,
                          baseline: str = BASELINE) -> str:
    """Per entry: seeds, val AP50 and its ratio to ``baseline`` (val: the instrument), test AP50
    (transfer to an unseen site), each ``mean ±sampling error (min–max over seeds)``, AP on both
    splits and training minutes (runs that had the CPU to themselves; "CPU shared" when none),
    each with its CPU where the entries' runs were made on different CPUs, else the one CPU in the
    column's header."""
    base = results.get(baseline)
    timed = [results[n] for n in names if n in results and results[n]["train_minutes"]]
    machines = {tuple(e["machines"]) for e in timed}
    mixed = len(machines) > 1
    on = "" if mixed or not machines else ", " + " / ".join(m.split(",")[0] for m in next(iter(machines)))
    lines = [
        f"| Config | Seeds | AP50 val | vs conv (val) | AP50 test | AP val | AP test | Training (min{on}) |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        e = results.get(name)
        if e is None:
            lines.append(f"| `{name}` | 0 | not run | | | | | |")
            continue
        if name == baseline:
            ratio = "1.00x"
        elif base is not None and VAL in e and VAL in base and base[VAL]["AP50"]["mean"] > 0:
            ratio = f"{e[VAL]['AP50']['mean'] / base[VAL]['AP50']['mean']:.2f}x"
        else:
            ratio = "–"
        ap = [stats_cell(e[s]["AP"], e[s]["n"]) if s in e else "–" for s in (VAL, TEST)]
        minutes = stats_cell(e["train_minutes"], e["timed_runs"]) if e["train_minutes"] else "CPU shared"
        if mixed and e["train_minutes"]:
            minutes += " on " + " / ".join(m.split(",")[0] for m in e["machines"])
        lines.append(f"| `{name}` | {len(e['seeds'])} | {_ap50_cell(e, VAL)} | {ratio} "
                     f"| {_ap50_cell(e, TEST)} | {ap[0]} | {ap[1]} | {minutes} |")
    return "\n".join(lines) + "\n"


def render_noise_table(results: Mapping[str, Mapping], baseline: str = BASELINE) -> str:
    """Per split: objects, one object's worth of AP50, the sampling error of one model's AP50 at
    the ``baseline``'s mean, and the ``baseline``'s spread over its seeds."""
    base = results.get(baseline, {})
    lines = [
        "| Split | Crowns | One crown (AP50 points) | Sampling error of one model (±1 s.d., at the conv "
        "demo's AP50) | Conv demo's seed range |",
        "|:---|---:|---:|---:|---:|",
    ]
    for split, n in SPLIT_OBJECTS.items():
        a = base.get(split, {}).get("AP50")
        err = f"±{sampling_error(a['mean'], n):.1f} (at {a['mean']:.1f})" if a else "–"
        spread = f"{a['max'] - a['min']:.1f} ({a['min']:.1f}–{a['max']:.1f})" if a else "–"
        lines.append(f"| `{split}` | {n} | {100 / n:.1f} | {err} | {spread} |")
    return "\n".join(lines) + "\n"


def render_learning_table(results: Mapping[str, Mapping], mutations: Sequence[str]) -> str:
    """The learning tests' measurements: per short run (entry without a mutation), the val AP50 of
    its correct seeds and of each broken-attention mutation, as ``min–max (n)``; a mutation is
    *separated* when the worst correct run beats the best broken one."""
    def span(e):
        if e is None or VAL not in e:
            return "not run", None
        a = e[VAL]["AP50"]
        return f"{a['min']:.1f}–{a['max']:.1f} ({e[VAL]['n']})", a

    lines = [
        "| Short run | Correct | " + " | ".join(f"`{m}`" for m in mutations) + " |",
        "|:---|---:|" + "---:|" * len(mutations),
    ]
    for name, e in results.items():
        if " broken=" in name:
            continue
        correct, c = span(e)
        cells = []
        for m in mutations:
            text, b = span(results.get(f"{name} broken={m}"))
            if c is not None and b is not None:
                text += " separated" if c["min"] > b["max"] else " not separated"
            cells.append(text)
        lines.append(f"| `{name}` | {correct} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the generated block ``name`` replaced by ``body`` (markers kept).

    Raises ValueError when the markers are missing."""
    begin, end = BLOCK_BEGIN.format(name=name), BLOCK_END.format(name=name)
    if begin not in text or end not in text:
        raise ValueError(f"no generated block {name!r}: expected lines {begin!r} ... {end!r}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"
