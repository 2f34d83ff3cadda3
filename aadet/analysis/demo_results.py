"""The demo's results, computed from the run summaries committed under ``docs/runs/``.

Every training figure of the docs comes from here: ``tools/record_demo_results.py`` copies the
``run_summary.json`` of finished runs into ``docs/runs/`` and regenerates, from all of them,
``docs/demo_results.json`` (the model table's demo column reads it) and the generated tables of
``docs/demo_results.md`` and ``README.md`` (between :data:`BLOCK_BEGIN` / :data:`BLOCK_END`
markers); ``tests/project/test_demo_results.py`` checks that the committed files equal a fresh rendering.

Runs are grouped into *entries*: the same config file with the same recipe overrides (the
command-line options other than :data:`~aadet.utils.run_summary.NOT_RECIPE_KEYS`: output folder,
seed, device, loader workers, and the weights an evaluation-only run evaluates). The entry of a
config run as committed is named after the config (``trees_R_26_slim_FPN``); a variant adds its
overrides (``trees_R_26_slim_FPN INPUT.SCALE_JITTER.FLIP_PROB=0.5``). When a committed demo config
changes a value (:data:`RECIPE_CHANGES`), the runs recorded before are named as today's config
with the old value as an override, and a run that had set the new value on its command line is
the config as committed. A test checks that every summary's ``config_diff`` is what its config file
and these overrides (:func:`summary_recipe_opts`) resolve to today, so that a run of an older
version of a config cannot back a number of today's.

Protocol (docs/demo_results.md): recipe choices are made on ``trees_val``; ``trees_test`` is only
reported, val alongside, as mean and range over seeds.
"""
import os
from collections import OrderedDict
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..utils.run_summary import BOX_METRICS, NOT_RECIPE_KEYS, load_summaries

__all__ = [
    "VAL",
    "TEST",
    "BASELINE",
    "RECIPE_CHANGES",
    "RECIPE_CHANGED_CONFIGS",
    "recipe_opts",
    "summary_recipe_opts",
    "entry_name",
    "group_runs",
    "build_demo_results",
    "stats_cell",
    "render_results_table",
    "render_variant_table",
    "render_learning_table",
    "replace_block",
    "BLOCK_BEGIN",
    "BLOCK_END",
]

#: The split recipe choices are made on, and the split that is only reported.
VAL, TEST = "trees_val", "trees_test"
#: The conv demo: the attention demos' ratios are to its mean.
BASELINE = "trees_R_26_slim_FPN"

BLOCK_BEGIN = "<!-- demo-results:{name}:begin -->"
BLOCK_END = "<!-- demo-results:{name}:end -->"


#: Values of demo configs changed after runs had been recorded with the old value,
#: ``KEY: (old, new)``, in the configs :data:`RECIPE_CHANGED_CONFIGS`. GN -> BN in the backbone
#: and FPN: GN, chosen on val, did not hold on test for these demos (docs/demo_results.md,
#: recipe choices re-judged on test).
RECIPE_CHANGES: Mapping[str, Tuple[str, str]] = {
    "MODEL.RESNETS.NORM": ("GN", "BN"),
    "MODEL.FPN.NORM": ("GN", "BN"),
}
RECIPE_CHANGED_CONFIGS = tuple(
    f"configs/Demo/trees_{name}.yaml" for name in ("R_26_slim_FPN", "AA_R_26_slim_FPN", "SASA_R_26_slim_FPN")
)


def recipe_opts(opts: Sequence[str]) -> Tuple[Tuple[str, str], ...]:
    """The ``(KEY, VALUE)`` overrides of a run's options that change what is trained."""
    pairs = list(zip(opts[0::2], opts[1::2]))
    return tuple((k, v) for k, v in pairs if k not in NOT_RECIPE_KEYS)


def summary_recipe_opts(summary: Mapping) -> Tuple[Tuple[str, str], ...]:
    """What a recorded run is against its config file as committed today: its recipe overrides
    without those that set a :data:`RECIPE_CHANGES` key to its new value, preceded by
    ``(KEY, old)`` for each changed key the run recorded (``config_diff``) at its old value without
    setting it."""
    given = recipe_opts(summary.get("opts", []))
    if summary["config_file"] not in RECIPE_CHANGED_CONFIGS:
        return given
    set_keys = {k for k, _ in given}
    recorded = summary.get("config_diff", {})
    implied = [(key, old) for key, (old, _) in RECIPE_CHANGES.items()
               if key not in set_keys and recorded.get(key) == old]
    # first: a variant of an older recipe is named as that recipe (its entry) plus the variant
    return tuple(implied + [(k, v) for k, v in given if RECIPE_CHANGES.get(k, (None, None))[1] != v])


def entry_name(summary: Mapping) -> str:
    """``<config name>`` or ``<config name> KEY=VALUE ...`` (see the module docstring)."""
    config = os.path.splitext(os.path.basename(summary["config_file"]))[0]
    extra = [f"{k}={v}" for k, v in summary_recipe_opts(summary)]
    if summary.get("broken_attention"):  # tests/helpers/broken_attention.py: attention broken on purpose
        extra.append(f"broken={summary['broken_attention']}")
    return " ".join([config, *extra])


def group_runs(summaries: Iterable[Mapping]) -> "OrderedDict[str, List[Mapping]]":
    """Summaries by entry name, each list sorted as the seeds were first listed (42, 7, 123)."""
    groups: "OrderedDict[str, List[Mapping]]" = OrderedDict()
    for s in summaries:
        groups.setdefault(entry_name(s), []).append(s)
    return groups


def _stats(values: Sequence[float]) -> Dict[str, float]:
    n = len(values)
    return {
        "mean": round(sum(values) / n, 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def _had_cpu_alone(summary: Mapping) -> bool:
    """Whether a run's wall time counts: its process got at least 3/4 of its threads' worth of
    CPU time (``cpu_seconds``) over the training; for summaries without it, a 1-minute load
    average at the end of at most the core count + 1."""
    threads = summary["machine"].get("torch_threads") or 1
    if summary.get("cpu_seconds") is not None and summary.get("train_seconds"):
        return summary["cpu_seconds"] >= 0.75 * threads * summary["train_seconds"]
    load, cores = summary.get("load_average"), summary["machine"].get("cpu_count")
    return bool(load) and bool(cores) and load[0] <= cores + 1


def _entry(runs: Sequence[Mapping]) -> Dict[str, object]:
    alone = [r for r in runs if not r.get("eval_only") and _had_cpu_alone(r)]
    datasets = sorted({d for r in runs for d in r["metrics"]}, key=lambda d: (d != VAL, d))
    out: Dict[str, object] = {
        "config_file": runs[0]["config_file"],
        "overrides": dict(summary_recipe_opts(runs[0])),
        "seeds": [r["seed"] for r in runs],
        "runs": [r["_file"] for r in runs],
        "machines": sorted({f"{r['machine']['cpu']}, {r['machine']['cpu_count']} cores"
                            for r in runs}),
        # Wall times only of runs that had the CPU to themselves (see _had_cpu_alone).
        "train_minutes": (
            _stats([r["train_seconds"] / 60 for r in alone]) if alone else None
        ),
        "timed_runs": len(alone),
        "eval_only": any(r.get("eval_only") for r in runs),
        "commits": sorted({(r.get("commit") or "unknown")[:12] for r in runs}),
    }
    for d in datasets:
        have = [r for r in runs if d in r["metrics"]]
        out[d] = {k: _stats([r["metrics"][d][k] for r in have]) for k in BOX_METRICS}
        out[d]["n"] = len(have)
    return out


def build_demo_results(folder: str) -> "OrderedDict[str, Dict[str, object]]":
    """Every entry from the summaries in ``folder`` (``docs/runs``), entries sorted by name.

    Each entry: the config file and overrides, seeds, the summary files, CPU(s), training minutes
    and, per evaluated dataset, the mean/min/max of AP, AP50, AP75 (and ``n``, the runs that
    evaluated it). The model table's demo column reads ``AP`` / ``AP50`` of the entry named after
    the config: kept at the top level too, as the test split's means.
    """
    summaries = sorted(load_summaries(folder), key=lambda s: (entry_name(s), _seed_order(s)))
    results = OrderedDict()
    for name, runs in sorted(group_runs(summaries).items()):
        e = _entry(runs)
        split = TEST if TEST in e else VAL
        e["AP"] = e[split]["AP"]["mean"]
        e["AP50"] = e[split]["AP50"]["mean"]
        e["split"] = split
        results[name] = e
    return results


_SEED_ORDER = (42, 7, 123)


def _seed_order(summary: Mapping) -> Tuple[int, int]:
    seed = summary["seed"]
    return (_SEED_ORDER.index(seed) if seed in _SEED_ORDER else len(_SEED_ORDER), seed)


def stats_cell(stats: Optional[Mapping], n: int, digits: int = 1) -> str:
    """``mean (min–max)`` of a metric over ``n`` runs; ``mean (1 run)``; ``–`` without runs."""
    if stats is None:
        return "–"
    if n == 1:
        return f"{stats['mean']:.{digits}f} (1 run)"
    return f"{stats['mean']:.{digits}f} ({stats['min']:.{digits}f}–{stats['max']:.{digits}f})"


def _ratio(entry: Mapping, base: Optional[Mapping], split: str) -> str:
    if base is None or split not in entry or split not in base:
        return "–"
    b = base[split]["AP50"]["mean"]
    return f"{entry[split]['AP50']['mean'] / b:.2f}x" if b > 0 else "–"


def render_results_table(results: Mapping[str, Mapping], names: Sequence[str],
                         baseline: str = BASELINE) -> str:
    """The headline table: per entry, test and val AP50 (mean and range over seeds), the ratio
    to the conv demo (``baseline``: the entry of the same recipe) on each split, test AP, seeds,
    training minutes (of the runs that had the CPU to themselves; "CPU shared" when none did)."""
    base = results.get(baseline)
    lines = [
        "| Config | Seeds | AP50 test | AP50 val | vs conv: test / val | AP test | AP val "
        "| Training (min) |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        e = results.get(name)
        if e is None:
            lines.append(f"| `{name}` | 0 | not run | | | | | |")
            continue
        n_t = e.get(TEST, {}).get("n", 0)
        n_v = e.get(VAL, {}).get("n", 0)
        ratio = (
            "1.00x (baseline)" if name == baseline
            else f"{_ratio(e, base, TEST)} / {_ratio(e, base, VAL)}"
        )
        lines.append(
            f"| `{name}` | {len(e['seeds'])} "
            f"| {stats_cell(e.get(TEST, {}).get('AP50'), n_t)} | {stats_cell(e.get(VAL, {}).get('AP50'), n_v)} "
            f"| {ratio} | {stats_cell(e.get(TEST, {}).get('AP'), n_t)} "
            f"| {stats_cell(e.get(VAL, {}).get('AP'), n_v)} "
            f"| {stats_cell(e['train_minutes'], e['timed_runs']) if e['train_minutes'] else 'CPU shared'} |"
        )
    return "\n".join(lines) + "\n"


def render_variant_table(results: Mapping[str, Mapping], pairs: Sequence[Tuple[str, str]]) -> str:
    """Recipe choices re-judged: per ``(chosen, alternative)`` entry pair, AP50 on val (where the
    choice was made) and on test, with the difference chosen - alternative."""
    lines = [
        "| Choice (made on val) | Alternative | Seeds | AP50 val: chosen / alt. (Δ) "
        "| AP50 test: chosen / alt. (Δ) | Holds on test |",
        "|:---|:---|---:|---:|---:|:---|",
    ]
    for chosen, alt in pairs:
        a, b = results.get(chosen), results.get(alt)
        alt_label = alt[len(chosen):].strip() if alt.startswith(chosen) else alt
        if a is None or b is None:
            lines.append(f"| `{chosen}` | `{alt_label}` | 0 | not run | | |")
            continue
        cells = []
        deltas = {}
        for split in (VAL, TEST):
            if split in a and split in b:
                x, y = a[split]["AP50"]["mean"], b[split]["AP50"]["mean"]
                deltas[split] = x - y
                cells.append(f"{x:.1f} / {y:.1f} ({x - y:+.1f})")
            else:
                cells.append("–")
        holds = "–"
        if TEST in deltas:
            holds = "yes" if deltas[TEST] >= 0 else "no"
        seeds = min(len(a["seeds"]), len(b["seeds"]))
        lines.append(f"| `{chosen}` | `{alt_label}` | {seeds} | {cells[0]} | {cells[1]} | {holds} |")
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
