"""``dev/aadet_dev/cpu_report.py`` (``dev/benchmark_cpu.py``'s report) on synthetic benchmark
outputs with known ratios: every CPU target gets a verdict from its own run's baseline, misses say
by how much, and runs from different CPUs or thread counts are refused."""
import pytest

from aadet_dev.cpu_report import CPU_RUNS, CPU_TARGETS, benchmarks_cpu, render_cpu_markdown

MIB = 2**20
ENV = {"device_name": "Some Xeon", "torch": "2.14.1", "torch_threads": 1}


def _configs(run):
    args = CPU_RUNS[run][1]
    return [a for a in args[args.index("--configs") + 1:] if a.endswith(".yaml")]


def _model_report(run, times):
    configs = _configs(run)
    results = [dict(config=c, amp=False, env=ENV, train={"median_s": t, "peak_bytes": 100 * MIB})
               for c, t in zip(configs, times)]
    return dict(device="cpu", size=[400, 400], batch=2, iters=5, baseline=configs[0], env=ENV,
                results=results)


def _layer_report(ms_mib):
    rows = [dict(suite="sasa", kind="layer", impl=impl, side=side, channels=256, median_s=t / 1e3,
                 peak_bytes=int(m * MIB))
            for (impl, side), (t, m) in ms_mib.items()]
    return dict(device="cpu", batch=1, iters=5, amp=False, env=ENV, results=rows)


def _reports(**env):
    layers = _layer_report({("conv3x3", 80): (150, 60), ("cpp", 80): (140, 150), ("neighborhood", 80): (300, 160),
                            ("cpp-recompute", 80): (210, 114), ("conv3x3", 40): (40, 24), ("cpp", 40): (36, 44)})
    reports = {"layers": layers, "demo": _model_report("demo", [1.0, 1.2, 1.35, 2.0]),
               "coco": _model_report("coco", [1.0, 1.04, 1.2, 1.3])}
    for k, v in env.items():
        reports["coco"]["env"] = dict(ENV, **{k: v})
    return reports


def test_every_target_gets_its_verdict_from_its_own_run():
    bench = benchmarks_cpu(_reports(), {"layers": "python dev/benchmark_layers.py ..."})
    verdicts = {v["target"]: v for v in bench["targets"]}
    assert set(verdicts) == {t.name for t in CPU_TARGETS}
    expect = {
        "SASA layer 80x80 fwd+bwd time vs 3x3 conv": ("pass", 140 / 150),
        "SASA layer 80x80 fwd+bwd memory vs 3x3 conv, recompute on": ("pass", 1.9),
        "SASA layer 80x80 fwd+bwd time vs 3x3 conv, recompute on": ("miss", 1.4),
        "SASA layer 40x40 fwd+bwd time vs 3x3 conv": ("pass", 0.9),
        "SASA layer 40x40 fwd+bwd memory vs 3x3 conv": ("pass", 44 / 24),
        "demo AA vs conv demo, training step": ("pass", 1.2),
        "demo SASA backbone vs conv demo, training step": ("miss", 1.35),
        "demo all attention vs conv demo, training step": ("pass", 2.0),  # <= is inclusive
        "COCO AA-R50 at 256 px vs conv R50, training step": ("pass", 1.04),
        "COCO SASA backbone R50 at 256 px vs conv R50, training step": ("miss", 1.2),
        "COCO SASA all attention at 256 px vs conv R50, training step": ("pass", 1.3),
    }
    for name, (status, value) in expect.items():
        v = verdicts[name]
        assert v["value"] == pytest.approx(value), name
        assert v["status"] == status, (name, v)
    # the neighborhood route is measured but has no target of its own
    assert {r["layer"] for r in bench["layers"]} >= {"sasa_neighborhood_80", "sasa_cpp_80", "sasa_cpp-recompute_80"}
    table = render_cpu_markdown(bench)
    assert "| demo AA vs conv demo, training step | 1.20x |" in table  # one round: no range
    assert "Some Xeon" in table and "**missed** by 0.05 (+4%)" in table  # demo SASA: 1.35 vs 1.30
    assert render_cpu_markdown(dict(bench, targets=[])) == table  # verdicts from today's targets, not the file's


def test_runs_from_different_cpus_or_threads_are_refused():
    with pytest.raises(ValueError, match="device_name"):
        benchmarks_cpu(_reports(device_name="Another CPU"), {})
    with pytest.raises(ValueError, match="torch_threads"):
        benchmarks_cpu(_reports(torch_threads=2), {})
    with pytest.raises(ValueError, match="missing"):
        benchmarks_cpu({"layers": _reports()["layers"]}, {})


def test_a_ratio_measured_in_rounds_shows_its_range():
    reports = _reports()
    reports["demo"]["results"][1]["ratio_ranges"] = {"train_time": [1.15, 1.31]}
    bench = benchmarks_cpu(reports, {})
    (row,) = [r for r in bench["configs"] if r["config"] == "trees_AA_R_26_slim_FPN"]
    assert row["train_ms_ratio_range"] == [1.15, 1.31]
    table = render_cpu_markdown(bench)
    assert "| demo AA vs conv demo, training step | 1.20x (1.15-1.31) | <= 1.20x | met, within the spread |" in table
    reports["demo"]["results"][1]["ratio_ranges"] = {"train_time": [1.21, 1.31]}  # the target below it
    assert "| 1.20x (1.21-1.31) | <= 1.20x | met |" in render_cpu_markdown(benchmarks_cpu(reports, {}))
