"""The markdown tables of the project's own benchmark reports, one function per table: what the
dev tools print and what ``dev/update_docs.py`` renders into BENCHMARKS.md from the committed runs
(``tools/benchmark.py``'s model table is :func:`aadet.benchmark.report.render_model_table`).

* :func:`render_layer_tables`: ``dev/benchmark_layers.py`` (the AA, SASA and HaloNet layers and
  SASA's attention stem);
* :func:`render_profile_parts`, :func:`render_profile_ops`: ``dev/profile_step.py`` (where a
  training step spends its time);
* :func:`spread_line`: the spread of the timed iterations of a run.

Pure functions of the tools' JSON (the tools import them; tools never import one another).
"""
import os
from typing import List, Sequence

from aadet.benchmark.report import fmt, header_line, markdown_table, mib
from aadet.benchmark.timing import report_peak_memory

__all__ = [
    "render_layer_tables",
    "render_profile_parts",
    "render_profile_ops",
    "spread_line",
]


_LABELS = {
    ("aa", "core", "auto"): "core, ours (auto: fused SDPA on CUDA)",
    ("aa", "core", "cpp"): "core, ours (C++ kernel, tables in-kernel)",
    ("aa", "core", "fused"): "core, ours (fused SDPA, heads widened by H + W)",
    ("aa", "core", "materialized"): "core, ours (materialized, chunk 1024)",
    ("aa", "core", "naive"): "core, naive (full logits + rel_to_abs)",
    ("aa", "core", "triton"): "core, ours (Triton, tables in-kernel)",
    ("aa", "core", "flex"): "core, flex_attention (tables in score_mod)",
    ("aa", "layer", "auto"): "AugmentedConv2d, ours",
    ("aa", "layer", "cpp"): "AugmentedConv2d, ours (C++ kernel)",
    ("aa", "layer", "fused"): "AugmentedConv2d, ours (fused SDPA)",
    ("aa", "layer", "naive"): "AugmentedConv2d, naive core",
    ("sasa", "layer", "neighborhood"): "LocalSelfAttention2d, ours (neighborhood)",
    ("sasa", "layer", "fused"): "LocalSelfAttention2d, ours (blocked, fused SDPA)",
    ("sasa", "layer", "cpp"): "LocalSelfAttention2d, ours (C++ kernel)",
    ("sasa", "layer", "cpp-recompute"): "LocalSelfAttention2d, ours (C++ kernel, recompute)",
    ("sasa", "layer", "triton"): "LocalSelfAttention2d, ours (Triton kernels)",
    ("sasa", "layer", "unfold"): "naive unfold attention",
    ("sasa", "layer", "conv3x3"): "3x3 conv",
    ("halo", "layer", "cpp"): "HaloSelfAttention2d, ours (C++ kernel)",
    ("halo", "layer", "bmm"): "HaloSelfAttention2d, ours (bmm)",
    ("halo", "layer", "materialized"): "HaloSelfAttention2d, ours (materialized)",
    ("halo", "layer", "fused"): "HaloSelfAttention2d, ours (fused SDPA)",
    ("halo", "layer", "sasa"): "LocalSelfAttention2d k 7, auto",
    ("halo", "layer", "conv3x3"): "3x3 conv",
    ("stem", "layer", "factorized"): "SpatiallyAwareAttentionStem, ours (factorized)",
    ("stem", "layer", "projected"): "SpatiallyAwareAttentionStem, ours (projected)",
    ("stem", "layer", "cpp"): "SpatiallyAwareAttentionStem, ours (C++ kernel)",
    ("stem", "layer", "convstem"): "conv stem (7x7/2 conv, 3x3/2 max pool)",
}


def render_layer_tables(report: dict) -> str:
    """``dev/benchmark_layers.py``'s report: one markdown table per suite (AA: ratios to the naive
    implementation; SASA: to a 3x3 conv and to ``unfold``; HaloNet: to a 3x3 conv and to SASA; the
    attention stem: to the conv stem, its rows sized by input side and ``C=in->out``)."""
    rounds = report.get("rounds", 1)
    median = (f"median of {report['iters']} after {report['warmup']} warm-up" if rounds == 1 else
              f"{rounds} rounds over the cases in turn, each case in each round {report['iters']} "
              f"iterations after {report['warmup']} warm-up; the median of the rounds' medians")
    out = [
        header_line(report, report_peak_memory(report))
        + f". Batch {report['batch']}, AMP {'on' if report['amp'] else 'off'}, forward + backward, "
        f"{median}. Reference check (float64, "
        "max abs diff naive vs ours): "
        f"{', '.join(f'{k} {v:.1e}' for k, v in report['reference_check'].items())}.\n"
    ]
    suites = (("aa", ("naive",)), ("sasa", ("conv3x3", "unfold")), ("halo", ("conv3x3", "sasa")),
              ("stem", ("convstem",)))
    for suite, refs in suites:
        rows = []
        for r in report["results"]:
            if r.get("suite") != suite:
                continue
            label = _LABELS[(r["suite"], r["kind"], r["impl"])]
            width = f"{r['in_channels']}->{r['channels']}" if "in_channels" in r else r["channels"]
            size = f"{r['side']}x{r['side']}, C={width}"
            if "median_s" not in r:
                why = r.get("skipped") or ("error: " + r.get("error", "?"))
                rows.append([size, label, why] + [""] * (2 + 2 * len(refs)))
                continue
            row = [size, label, fmt(r["median_s"], ".1f", 1e3), fmt(r["cpu_median_s"], ".1f", 1e3)]
            row += [fmt(r["ratios"].get(n, {}).get("time"), ".2f") for n in refs]
            row += [fmt(mib(r["peak_bytes"]), ".0f")]
            row += [fmt(r["ratios"].get(n, {}).get("peak_mem"), ".2f") for n in refs]
            rows.append(row)
        if not rows:
            continue
        title = {
            "aa": "AA: relative self-attention (core) and AugmentedConv2d (kappa 0.2, nu 0.1, 8 heads)",
            "sasa": "SASA: LocalSelfAttention2d (k 7, 8 heads) vs 3x3 conv and unfold",
            "halo": "HaloNet: HaloSelfAttention2d (b 8, h 3, 8 heads) vs 3x3 conv and SASA (k 7)",
            "stem": "Attention stem: SpatiallyAwareAttentionStem (block 4, 1 head, 4 mixtures, no norm) "
            "vs the conv stem (7x7/2 conv, 3x3/2 max pool, no norm), by input side",
        }[suite]
        headers = (
            ["Map, width", "Implementation", "fwd+bwd ms", "CPU ms"]
            + [f"time × {n}" for n in refs]
            + ["peak MiB"]
            + [f"mem × {n}" for n in refs]
        )
        out.append(
            f"\n**{title}**\n\n"
            + markdown_table(headers, rows, align="ll" + "r" * (len(headers) - 2))
        )
    return "".join(out)



def spread_line(report: dict) -> str:
    """The largest interquartile range of a run's timed iterations, as a share of the median, and
    its case: ``tools/benchmark.py`` (training step) or ``dev/benchmark_layers.py`` reports."""
    worst = None
    for r in report["results"]:
        t = r.get("train", r)
        if t.get("median_s") and t.get("p25_s") is not None and t.get("p75_s") is not None:
            share = (t["p75_s"] - t["p25_s"]) / t["median_s"]
            name = r.get("config") or f"{r['suite']} {r['kind']} {r['impl']} {r['side']}x{r['side']}"
            if worst is None or share > worst[0]:
                worst = (share, os.path.splitext(os.path.basename(name))[0])
    if worst is None:
        return "Spread: not recorded in this run.\n"
    return (f"Spread within the run: the timed iterations' interquartile range is at most "
            f"{100 * worst[0]:.1f}% of their median (`{worst[1]}`); ratios of two cases move by up to "
            "about the sum of their spreads.\n")


_PART = "backbone.bottom_up."


def _part_names(report: dict) -> List[str]:
    names: List[str] = []
    for r in report["results"]:
        names += [n for n in r["forward_ms"] if n not in names]
    return names


def render_profile_parts(report: dict) -> str:
    """``dev/profile_step.py``'s report: the training step and its forward per part (ms), a column
    per config."""
    results = report["results"]
    headers = ["ms"] + [f"`{os.path.splitext(os.path.basename(r['config']))[0]}`" for r in results]
    rows: List[Sequence[str]] = [["training step (median)"] + [fmt(r["step_ms"], ".0f") for r in results]]
    rows.append(["profiled step"] + [fmt(r["profiled_step_ms"], ".0f") for r in results])
    for name in _part_names(report):
        label = "forward " + (name[len(_PART):] if name.startswith(_PART) else name)
        rows.append([label] + [fmt(r["forward_ms"].get(name), ".0f") for r in results])
    rows.append(["losses, backward, SGD step"] + [fmt(r["losses_backward_and_step_ms"], ".0f") for r in results])
    m = report.get("machine", {})
    head = (f"CPU: {m.get('cpu')}, torch {report.get('torch')}, {report.get('threads')} thread(s); input "
            f"{report['size']}x{report['size']}, batch {report['batch']}; configs one after another in one "
            "process, forward per part by module hooks.\n\n")
    return head + markdown_table(headers, rows)


def render_profile_ops(report: dict, top: int = 6) -> str:
    """``dev/profile_step.py``'s report: each config's ``top`` operators by self CPU time in one
    step (``name`` calls, ms)."""
    rows = []
    for r in report["results"]:
        ops = sorted(r["ops"], key=lambda o: -o["self_cpu_ms"])[:top]
        cells = "; ".join(f"`{o['name']}` x{o['calls']} {o['self_cpu_ms']:.0f}" for o in ops)
        rows.append([f"`{os.path.splitext(os.path.basename(r['config']))[0]}`",
                     fmt(r["ops_self_cpu_total_ms"], ".0f"), cells])
    headers = ["Config", "Self CPU ms", f"Top {top} operators: name, calls, self CPU ms"]
    return markdown_table(headers, rows, align="lrl")
