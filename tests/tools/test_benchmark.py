"""``tools/benchmark.py``: its ratios and table on hand-made results, a failed or cut-off run's
report, and a tiny run on CPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

from aadet.benchmark.timing import merge_rounds

from aadet.benchmark.report import (
    render_model_table,
    MISSING,
)

from tests.helpers import REPO, load_tool



def _timed(median, cpu, peak, **extra):
    return dict(median_s=median, cpu_median_s=cpu, peak_bytes=peak, **extra)


def test_benchmark_ratios_and_table():
    benchmark = load_tool("benchmark")

    env = {"device_name": "Test CPU", "torch": torch.__version__, "torch_threads": 1}
    base, aa = "configs/base.yaml", "configs/aa.yaml"
    results = [
        {"config": base, "amp": False, "params": 2e6, "env": env,
         "train": _timed(0.5, 0.4, 100 * 2**20, images_per_s=4.0),
         "inference": _timed(0.1, 0.08, 10 * 2**20, per_image_s=0.05)},
        {"config": aa, "amp": False, "params": 3e6, "env": env,
         "train": _timed(1.0, 1.0, 150 * 2**20, images_per_s=2.0),
         "inference": _timed(0.3, 0.2, 0, per_image_s=0.15)},
        {"config": base, "amp": True, "amp_dtype": "bfloat16", "params": 2e6, "env": env,
         "train": _timed(0.25, 0.2, 50 * 2**20, images_per_s=8.0)},  # inference skipped
        {"config": aa, "amp": True, "amp_dtype": "bfloat16", "error": "CUDA out of memory"},
    ]  # fmt: skip
    benchmark.add_ratios(results, base)
    assert results[0]["ratios"] == {k: 1.0 for k in benchmark.RATIO_METRICS}
    assert results[1]["ratios"] == pytest.approx(
        {"train_time": 2.0, "train_cpu_time": 2.5, "images_per_s": 0.5, "train_peak_mem": 1.5,
         "inference_time": 3.0, "inference_cpu_time": 2.5, "inference_peak_mem": 0.0})  # fmt: skip
    assert set(results[2]["ratios"]) == {"train_time", "train_cpu_time", "images_per_s",
                                         "train_peak_mem"}  # fmt: skip
    assert "ratios" not in results[3]
    rep = {"device": "cpu", "size": [128, 160], "batch": 2, "warmup": 1, "iters": 3,
           "amp_dtype": "bfloat16", "baseline": base, "env": env, "results": results}  # fmt: skip
    md = render_model_table(rep)
    head, table = md.split("\n\n")
    assert head.startswith("Device: Test CPU (cpu)") and "AMP autocasts to bfloat16" in head
    assert "Input 128x160, batch 2, median of 3" in head and "baseline `base`" in head
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    assert lines[3] == ("| `aa` | off | 3.00 | 1000.0 | 2.00 | 1000.0 | 2.50 | 2.00 | 150 | 1.50 "
                        "| 300.0 | 3.00 | 0 | 0.00 | 200.0 | 2.50 |")  # fmt: skip
    assert lines[4].startswith("| `base` | bfloat16 | 2.00 | 250.0 | 1.00 | 200.0 | 1.00 |")
    assert lines[4].endswith(f"| {MISSING} | {MISSING} | {MISSING} | {MISSING} | {MISSING} | {MISSING} |")
    assert lines[5].startswith("| `aa` | bfloat16 | error: CUDA out of memory |")


def test_benchmark_rounds_take_the_median_round_and_keep_each_ratio_range():
    """Three rounds in which the machine ran slow during the second: the medians of the rounds
    ignore it, the train-time ratio's range shows each round's own ratio, and a case that failed
    in any round is reported by its failure."""
    benchmark = load_tool("benchmark")
    base, aa, sasa = "configs/base.yaml", "configs/aa.yaml", "configs/sasa.yaml"

    def case(config, median, peak):
        train = dict(_timed(median, median, peak, images_per_s=2 / median), iters=5, times_s=[median] * 5)
        return {"config": config, "amp": False, "params": 1e6, "train": train}

    rounds = []
    for slow, aa_time, sasa_error in ((1.0, 1.0, False), (1.6, 1.7, True), (1.04, 1.1, False)):
        results = [case(base, 0.5 * slow, 100), case(aa, aa_time, 150 + 10 * slow)]
        results.append({"config": sasa, "amp": False, "error": "killed"} if sasa_error else case(sasa, 2.0, 1))
        rounds.append(benchmark.add_ratios(results, base))
    merged = benchmark.add_ratios(merge_rounds(rounds, benchmark.combine_case), base)
    b, a, s = merged
    assert b["train"]["median_s"] == pytest.approx(0.52) and a["train"]["median_s"] == pytest.approx(1.1)
    assert a["train"]["round_medians_s"] == [1.0, 1.7, 1.1] and a["train"]["iters"] == 15
    assert a["ratios"]["train_time"] == pytest.approx(1.1 / 0.52)
    assert a["ratio_ranges"]["train_time"] == pytest.approx([2.0, 1.7 / 0.8])  # rounds: 2.0, 2.125, 2.115
    assert a["train"]["peak_bytes"] == 166 and a["train"]["images_per_s"] == pytest.approx(2 / 1.1)
    assert s == {"config": sasa, "amp": False, "error": "killed"}
    assert merge_rounds(rounds[:1], benchmark.combine_case) is rounds[0]  # one round: the results as they are
    rep = {"device": "cpu", "size": [64, 64], "batch": 2, "warmup": 1, "iters": 5, "rounds": 3,
           "baseline": base, "env": {"device_name": "Test CPU", "torch": "2", "torch_threads": 1},
           "results": merged}  # fmt: skip
    md = render_model_table(rep)
    assert "3 rounds over the configs in turn" in md
    assert "| `aa` | off | 1.00 | 1100.0 | 2.12 (2.00-2.12) |" in md


@pytest.mark.slow  # a subprocess building and timing a demo model
def test_benchmark_runs_tiny_config_on_cpu(tmp_path):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "benchmark.py"),
        "--configs",
        os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml"),
        "--device",
        "cpu",
        "--size",
        "128",
        "--batch",
        "1",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--output-json",
        str(out_json),
        "--output-md",
        str(out_md),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    (r,) = report["results"]
    assert "error" not in r, r.get("detail")
    assert report["size"] == [128, 128] and report["batch"] == 1
    assert r["train"]["median_s"] > 0 and r["train"]["images_per_s"] > 0
    assert r["inference"]["median_s"] > 0 and r["train"]["peak_bytes"] >= 0
    assert r["ratios"]["train_time"] == pytest.approx(1.0)  # the baseline against itself
    assert "| `trees_R_26_slim_FPN` |" in out_md.read_text()


def test_benchmark_writes_the_cases_finished_so_far_after_each_case(tmp_path, monkeypatch, capsys):
    """A run cut off at a time limit (a lent GPU machine's stage budget) keeps the cases it
    finished: the JSON is written after each case, marked partial until the run ends, and each
    case's progress line says where its time went."""
    benchmark = load_tool("benchmark")
    configs = [os.path.join(REPO, "configs/Demo", n)
               for n in ("trees_R_26_slim_FPN.yaml", "trees_AA_R_26_slim_FPN.yaml")]
    out = tmp_path / "bench.json"
    seen, timeouts = [], []

    def fake_case(script, spec, tmp, timeout=None, env=None):
        seen.append(json.loads(out.read_text()) if out.exists() else None)
        timeouts.append(timeout)
        phase = dict(median_s=0.5, cpu_median_s=0.5, peak_bytes=1, wall_s=9.0)
        return dict(config=spec["config"], amp=spec["amp"], params=1, env={}, build_s=2.0,
                    train=dict(phase, images_per_s=2.0))

    monkeypatch.setattr(benchmark, "run_case_in_subprocess", fake_case)
    benchmark.main(["--configs", *configs, "--size", "64", "--batch", "1", "--no-inference", "--case-timeout", "30",
                    "--output-json", str(out), "--output-md", str(tmp_path / "bench.md")])
    assert timeouts == [30.0] * 4  # each case and its memory pass stopped after --case-timeout
    assert seen[0] is None  # nothing before the first case
    assert seen[1]["partial"] is True and [r["config"] for r in seen[1]["results"]] == configs[:1]
    final = json.loads(out.read_text())
    assert "partial" not in final and len(final["results"]) == 2
    assert "done in" in capsys.readouterr().err and "build 2 s, train 9 s (median 500 ms)" in benchmark.describe_case(
        final["results"][1], 12.0)


def test_benchmark_names_a_failed_case_in_the_partial_and_the_final_report(tmp_path, monkeypatch):
    # A failure comes back as its error only; the reports list it by config and precision.
    benchmark = load_tool("benchmark")
    configs = [os.path.join(REPO, "configs/Demo", n)
               for n in ("trees_R_26_slim_FPN.yaml", "trees_AA_R_26_slim_FPN.yaml", "trees_SASA_R_26_slim_FPN.yaml")]
    out = tmp_path / "bench.json"
    seen = []

    def fake_case(script, spec, tmp, timeout=None, env=None):
        seen.append(json.loads(out.read_text()) if out.exists() else None)
        if spec["config"] == configs[1]:
            return {"error": "out of memory"}
        phase = dict(median_s=0.5, cpu_median_s=0.5, peak_bytes=1, wall_s=9.0)
        return dict(config=spec["config"], amp=spec["amp"], params=1, env={}, build_s=2.0,
                    train=dict(phase, images_per_s=2.0))

    monkeypatch.setattr(benchmark, "run_case_in_subprocess", fake_case)
    benchmark.main(["--configs", *configs, "--size", "64", "--batch", "1", "--no-inference",
                    "--output-json", str(out), "--output-md", str(tmp_path / "bench.md")])
    partial = seen[2]["results"][1]
    final = json.loads(out.read_text())["results"][1]
    for failed in (partial, final):
        assert failed["config"] == configs[1] and failed["amp"] is False and failed["error"] == "out of memory"



def test_benchmark_in_process_runs_every_case_here_and_reports_a_failure(tmp_path, monkeypatch):
    """--in-process (the GPU check's mode: a lent machine paid 20-35 s a case for a fresh process,
    of which about 1 s timed steps): no worker process, a case that raises is a row, the run goes on."""
    benchmark = load_tool("benchmark")
    configs = [os.path.join(REPO, "configs/Demo", n)
               for n in ("trees_R_26_slim_FPN.yaml", "trees_AA_R_26_slim_FPN.yaml", "trees_SASA_R_26_slim_FPN.yaml")]
    args = ["--configs", *configs, "--size", "64", "--batch", "1", "--no-inference", "--in-process",
            "--output-json", str(tmp_path / "bench.json"), "--output-md", str(tmp_path / "bench.md")]
    with pytest.raises(SystemExit, match="--in-process measures CUDA cases"):
        benchmark.main([*args, "--device", "cpu"])

    def no_subprocess(*a, **kw):
        raise AssertionError("a worker process was started")

    def fake_case(spec):
        if spec["config"] == configs[1]:
            raise RuntimeError("no kernel image for this device")
        phase = dict(median_s=0.5, cpu_median_s=0.5, peak_bytes=1, wall_s=9.0)
        return dict(config=spec["config"], amp=spec["amp"], params=1, env={}, build_s=2.0,
                    train=dict(phase, images_per_s=2.0))

    monkeypatch.setattr(benchmark, "run_case_in_subprocess", no_subprocess)
    monkeypatch.setattr(benchmark, "run_case", fake_case)
    monkeypatch.setattr(benchmark, "command_device", lambda device, dtype: (torch.device("cuda"), dtype))
    cpu_env = benchmark.environment_info(torch.device("cpu"))
    monkeypatch.setattr(benchmark, "environment_info", lambda device: cpu_env)
    benchmark.main([*args, "--device", "cuda"])
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert [r["config"] for r in results] == configs
    assert results[1]["error"] == "RuntimeError: no kernel image for this device"
    assert results[0]["train"]["median_s"] == results[2]["train"]["median_s"] == 0.5


@pytest.mark.slow  # builds the demo detector twice and traces one with dynamo: about a minute
def test_benchmark_case_honours_model_compile_and_profiles_each_phase(tmp_path):
    """A case of ``--compile`` runs its model through ``torch.compile`` (here the ``eager`` backend:
    dynamo captures graphs, no compiler needed) and says so in its result; ``--profile`` adds each
    phase's profile; without them neither."""
    import torch._dynamo
    from aadet.benchmark.synthetic_batch import make_batch

    benchmark = load_tool("benchmark")
    batch_file = tmp_path / "batch.pt"
    torch.save(make_batch(1, 64, 64, 0), batch_file)
    args = benchmark.build_parser().parse_args(["--compile", "MODEL.COMPILE.BACKEND", "eager"])
    assert benchmark.compile_opts(args) == ["MODEL.COMPILE.ENABLED", "True"]
    spec = dict(config=os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml"), device="cpu", amp=False,
                amp_dtype=None, seed=0, warmup=1, iters=1, batch_file=str(batch_file), threads=None,
                no_train=False, no_inference=False)
    with pytest.raises(SystemExit, match="--profile takes one more call"):
        benchmark.main(["--configs", spec["config"], "--profile", "--interleave"])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain = benchmark.run_case(dict(spec, opts=[], profile=False))
    assert plain["compile"] is None and "profile" not in plain["train"] and "profile" not in plain["inference"]
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = benchmark.run_case(dict(spec, opts=list(args.opts) + benchmark.compile_opts(args), profile=True))
    assert compiled["compile"] == {"backend": "eager", "mode": None, "dynamic": True}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the model's forward was captured
    for phase in ("train", "inference"):
        profile = compiled[phase]["profile"]
        assert profile["device"] == "cpu" and profile["categories"]["conv"] > 0
    torch._dynamo.reset()
