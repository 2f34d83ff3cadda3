"""The CPU ratios that matter, with targets: ``dev/benchmark_cpu.py``'s report.

Three benchmark runs, each with its own baseline (ratios are always taken within one run):

* the SASA layer (``dev/benchmark_layers.py --suite sasa``): ``LocalSelfAttention2d`` 256
  channels, k 7, 8 heads, forward + backward, against a 3x3 convolution of the same width, at
  80x80 and 40x40, on the route ``impl="auto"`` takes on CPU (``cpp``) and with
  ``recompute_attention=True`` (``cpp-recompute``);
* the demo models (``tools/benchmark.py`` on ``configs/Demo``, 400x400, batch 2): the attention
  demos' training step against the conv demo's;
* the COCO R50 RetinaNets at a small input (256x256, batch 1): the attention models' training
  step against the conv R50's.

The JSON has the layout of ``docs/benchmarks_cuda.json`` (:mod:`aadet_dev.gpu_report`: the same
``configs`` / ``layers`` rows, ratios and target verdicts), plus ``runs``: the command of each
run. Pure functions of the tools' JSON outputs; the tool runs them.
"""
from typing import Dict, List, Sequence

from .gpu_report import (
    SCHEMA_VERSION,
    Target,
    config_name,
    config_rows,
    evaluate_targets,
    layer_rows,
)
from aadet.benchmark.report import markdown_table

__all__ = [
    "CPU_RUNS",
    "CPU_TARGETS",
    "CPU_PRECISIONS",
    "benchmarks_cpu",
    "render_cpu_markdown",
]

_DEMO = "configs/Demo/trees_{}.yaml"
_COCO = "configs/COCO-Detection/{}.yaml"

#: The three runs: name -> (tool, arguments). The first config of a run is its baseline.
CPU_RUNS: Dict[str, tuple] = {
    "layers": ("dev/benchmark_layers.py", [
        "--suite", "sasa", "--device", "cpu", "--batch", "1", "--sizes", "80", "40",
        "--warmup", "1", "--iters", "5", "--rounds", "3"]),
    "demo": ("tools/benchmark.py", [
        "--configs", _DEMO.format("R_26_slim_FPN"), _DEMO.format("AA_R_26_slim_FPN"),
        _DEMO.format("SASA_R_26_slim_FPN"), _DEMO.format("SASA_full_attention_R_26_slim"),
        _DEMO.format("Halo_R_26_slim_FPN"), _DEMO.format("CCNet_R_26_slim_FPN"),
        "--device", "cpu", "--size", "400", "--batch", "2", "--warmup", "2", "--iters", "10",
        "--interleave", "--no-inference"]),
    "coco": ("tools/benchmark.py", [
        "--configs", _COCO.format("retinanet_R_50_FPN_scratch_150ep"),
        _COCO.format("aa_retinanet_R_50_FPN_scratch_150ep"),
        _COCO.format("sasa_convstem_retinanet_R_50_FPN_scratch_150ep"),
        _COCO.format("sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"),
        _COCO.format("halo_retinanet_R_50_FPN_scratch_150ep"),
        _COCO.format("ccnet_retinanet_R_50_FPN_scratch_150ep"),
        "--device", "cpu", "--size", "256", "--batch", "1", "--warmup", "1", "--iters", "5",
        "--interleave"]),
}

#: The precisions the CPU runs measure (no autocast in CPU_RUNS): each target gets its verdict in them.
CPU_PRECISIONS = ("fp32",)
#: The CPU targets (one definition): training-step time ratios of the models,
#: the SASA layer's time and memory ratios on the route ``impl="auto"`` takes on CPU (``"cpp"``),
#: at 80x80 its memory with the attention weights recomputed in backward (``"cpp-recompute"``,
#: ``MODEL.SASA.RECOMPUTE_ATTENTION``), and the time that costs.
CPU_TARGETS = (
    Target("SASA layer 80x80 fwd+bwd time vs 3x3 conv", "layers", "sasa_cpp_80", "train_ms_ratio", 1.0),
    Target("SASA layer 40x40 fwd+bwd time vs 3x3 conv", "layers", "sasa_cpp_40", "train_ms_ratio", 1.0),
    Target("SASA layer 80x80 fwd+bwd memory vs 3x3 conv, recompute on", "layers",
           "sasa_cpp-recompute_80", "train_peak_mib_ratio", 2.0),
    Target("SASA layer 80x80 fwd+bwd time vs 3x3 conv, recompute on", "layers",
           "sasa_cpp-recompute_80", "train_ms_ratio", 1.3),
    Target("SASA layer 40x40 fwd+bwd memory vs 3x3 conv", "layers", "sasa_cpp_40",
           "train_peak_mib_ratio", 2.0),
    Target("demo AA vs conv demo, training step", "configs", "trees_AA_R_26_slim_FPN", "train_ms_ratio", 1.2),
    Target("demo SASA backbone vs conv demo, training step", "configs", "trees_SASA_R_26_slim_FPN",
           "train_ms_ratio", 1.3),
    Target("demo all attention vs conv demo, training step", "configs",
           "trees_SASA_full_attention_R_26_slim", "train_ms_ratio", 2.0),
    Target("demo CCNet vs conv demo, training step", "configs", "trees_CCNet_R_26_slim_FPN", "train_ms_ratio", 1.15),
    Target("COCO AA-R50 at 256 px vs conv R50, training step", "configs",
           "aa_retinanet_R_50_FPN_scratch_150ep", "train_ms_ratio", 1.05),
    Target("COCO SASA backbone R50 at 256 px vs conv R50, training step", "configs",
           "sasa_convstem_retinanet_R_50_FPN_scratch_150ep", "train_ms_ratio", 1.1),
    Target("COCO SASA all attention at 256 px vs conv R50, training step", "configs",
           "sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep", "train_ms_ratio", 1.3),
)


def benchmarks_cpu(reports: Dict[str, dict], commands: Dict[str, str], targets=CPU_TARGETS) -> dict:
    """The report from the runs' JSON (``reports["layers" | "demo" | "coco"]``).

    Raises:
        ValueError: a run is missing, or the runs come from different CPUs or thread counts.
    """
    missing = [name for name in CPU_RUNS if name not in reports]
    if missing:
        raise ValueError(f"benchmarks_cpu needs the runs {list(CPU_RUNS)}; missing {missing}")
    for field in ("device_name", "torch_threads"):
        values = {repr(r["env"].get(field)) for r in reports.values()}
        if len(values) > 1:
            raise ValueError(f"the CPU benchmark runs differ in {field}: {sorted(values)}")
    env = reports["layers"]["env"]
    configs = config_rows(reports["demo"]) + config_rows(reports["coco"])
    layers = layer_rows(reports["layers"])
    return {
        "schema": SCHEMA_VERSION,
        "device_name": env["device_name"],
        "torch": env.get("torch"),
        "threads": env.get("torch_threads"),
        "runs": {name: {"command": commands.get(name), "baseline": config_name(r["baseline"])
                        if r.get("baseline") else "conv3x3",
                        "size": r.get("size"), "batch": r.get("batch"), "iters": r.get("iters")}
                 for name, r in reports.items()},
        "configs": configs,
        "layers": layers,
        "targets": evaluate_targets(configs, layers, targets, precisions=CPU_PRECISIONS),
    }


def _f(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def render_cpu_markdown(bench: dict, targets=CPU_TARGETS) -> str:
    """The targets table (what | measured | target | met) and the device line. The verdicts are
    taken again from the report's rows against ``targets`` (today's, defined here), not read from
    the report, so a changed target shows without a new run."""
    rows: List[Sequence[str]] = []
    for v in evaluate_targets(bench["configs"], bench["layers"], targets, precisions=CPU_PRECISIONS):
        if v["status"] == "pass":
            verdict = "met"
        elif v["status"] == "miss":
            verdict = f"**missed** by {v['excess']:.2f} ({v['excess_pct']:+.0f}%)"
        else:
            verdict = "not measured: " + str(v.get("note", ""))[:60]
        if v.get("range") and v["range"][0] <= v["limit"] <= v["range"][1]:
            verdict += ", within the spread"  # the run cannot tell met from missed
        measured = _f(v["value"]) + "x"
        if v.get("range"):
            measured += " ({:.2f}-{:.2f})".format(*v["range"])
        rows.append([v["target"], measured, f"<= {v['limit']:.2f}x", verdict])
    head = (f"CPU: **{bench['device_name']}**, torch {bench['torch']}, {bench['threads']} thread(s); "
            "ratios within one run (layers: to a 3x3 conv of the same width and map; models: to the "
            "conv model of the same run), wall time, training step (forward, backward, SGD step); "
            "in brackets the ratio's spread within its run, as the run's table below says.\n\n")
    return head + markdown_table(["What (CPU, same run)", "Measured", "Target", "Met"], rows)
