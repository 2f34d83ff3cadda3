"""The benchmark tools (``tools/benchmark.py``, ``tools/benchmark_layers.py``) and their shared code
(``aadet_tools.timing``, ``aadet_tools.report``): ratios to a reference (exact numbers, missing
sections, zero references), markdown, JSON, exit status, the AMP dtype choice, timing and peak
memory, each tool's ratios and table on hand-made results, and tiny runs of both."""

import json
import os
import subprocess
import sys

import pytest
import torch

from aadet_tools import timing
from aadet_tools.timing import merge_rounds
from aadet_tools.benchmark_tables import render_layer_tables, render_model_table
from aadet_tools.gpu_report import config_rows, layer_rows
from aadet_tools.report import (
    MISSING,
    fmt,
    index_results,
    markdown_table,
    mib,
    ratio,
    ratios,
    write_report,
)
from aadet_tools.timing import (
    AMP_DTYPES,
    autocast,
    check_amp_dtype,
    default_amp_dtype,
    needs_grad_scaler,
    time_fn,
    worker_main,
)

from tests.helpers import REPO, TOOLS, load_tool


# ----------------------------------------------------------------------------- report.py
def test_ratio_and_ratios():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0) is None
    r = {"train": {"median_s": 0.3, "peak_bytes": 0}, "inference": {"median_s": 0.02}}
    b = {"train": {"median_s": 0.2, "peak_bytes": 0}}  # no inference section
    metrics = {"t": "train.median_s", "m": "train.peak_bytes", "i": "inference.median_s"}
    assert ratios(r, b, metrics) == {"t": pytest.approx(1.5), "m": None}  # "i" left out
    assert ratios(r, r, metrics) == {"t": 1.0, "m": None, "i": 1.0}


def test_index_results_skips_failures_and_refuses_duplicates():
    results = [{"k": 1, "v": 1}, {"k": 2, "error": "x"}, {"k": 3, "skipped": "y"}, {"k": 4}]
    assert list(index_results(results, key=lambda r: r["k"])) == [1, 4]
    with pytest.raises(ValueError, match="share the key 1"):
        index_results([{"k": 1}, {"k": 1}], key=lambda r: r["k"])


def test_formatting_helpers():
    assert fmt(None, ".2f") == MISSING and fmt(0.01234, ".1f", 1e3) == "12.3"
    assert mib(3 * 2**20) == 3.0 and mib(None) is None
    assert markdown_table(["a", "b", "c"], [[1, "x", 2.5]], align="lrl") == (
        "| a | b | c |\n|:---|---:|:---|\n| 1 | x | 2.5 |\n"
    )
    with pytest.raises(ValueError, match="one of 'l'/'r' per column"):
        markdown_table(["a"], [[1]], align="c")
    with pytest.raises(ValueError, match="2 columns"):
        markdown_table(["a", "b"], [[1]])
    # one home: the report helpers live in report.py only
    assert not hasattr(timing, "markdown_table") and not hasattr(timing, "write_json")


def test_write_report(tmp_path, capsys):
    rep = {"results": [{"x": 1}]}
    assert write_report(rep, "| md |\n", str(tmp_path / "a" / "r.json"), str(tmp_path / "r.md")) == 0
    assert json.loads((tmp_path / "a" / "r.json").read_text()) == rep
    assert (tmp_path / "r.md").read_text() == "| md |\n" and capsys.readouterr().out == ""
    assert write_report({"results": [{"x": 1}, {"error": "boom"}]}, "table\n") == 1
    assert capsys.readouterr().out == "table\n"
    assert not list(tmp_path.glob("**/*.tmp"))


# ----------------------------------------------------------------------------- timing helpers
def test_time_fn_and_peak_memory():
    calls = []
    t = time_fn(lambda: calls.append(1), warmup=2, iters=3)
    assert len(calls) == 5 and t["iters"] == 3 and t["median_s"] >= 0 and len(t["times_s"]) == 3
    # In a fresh process: in a long pytest run the resident set can shrink inside the phase
    # (freed heap, reclaimed file pages) and hide part of the allocation.
    code = (
        "import json, torch\n"
        "from aadet_tools.timing import PeakMemory\n"
        "with PeakMemory('cpu') as mem:\n"
        "    x = torch.ones(128 * 2**20 // 4)  # 128 MiB, touched\n"
        "    del x\n"
        "print(json.dumps([mem.exact, mem.peak_bytes]))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TOOLS])))
    assert p.returncode == 0, p.stderr[-2000:]
    exact, peak = json.loads(p.stdout.strip().splitlines()[-1])
    assert peak >= 96 * 2**20 if exact else peak >= 0, (exact, peak)
    with pytest.raises(ValueError, match="iters >= 1"):
        time_fn(lambda: None, warmup=0, iters=0)


# The heap pattern that makes a resident-set peak overstate the tensors: a 4 MiB block freed
# (glibc raises its mmap threshold to it), twenty 2 MiB tensors on the heap, every other one
# freed (holes that stay resident), then ten 3 MiB tensors that fit no hole. Live at the peak:
# ten 2 MiB + ten 3 MiB = 50 MiB.
_HOLES = (
    "import json, torch\n"
    "from aadet_tools.timing import PeakMemory\n"
    "del_me = torch.ones(2**20)\n"
    "del del_me\n"
    "with PeakMemory('cpu') as mem:\n"
    "    small = [torch.ones(2**19) for _ in range(20)]\n"
    "    small = small[1::2]\n"
    "    big = [torch.ones(3 * 2**18) for _ in range(10)]\n"
    "    del small, big\n"
    "print(json.dumps([mem.exact, mem.peak_bytes]))\n"
)


def _peak_mib(code, env):
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TOOLS]), **env))
    assert p.returncode == 0, p.stderr[-2000:]
    exact, peak = json.loads(p.stdout.strip().splitlines()[-1])
    return peak / 2**20 if exact else None


def test_memory_pass_measures_the_tensors_not_the_heap_malloc_keeps():
    """Under the memory pass' environment the peak is the live tensors' (50 MiB); with glibc's
    defaults the same code's resident set also holds the freed holes (70 MiB)."""
    passed = _peak_mib(_HOLES, timing.MEMORY_PASS_ENV)
    default = _peak_mib(_HOLES, {})
    if passed is None:
        pytest.skip("/proc/self/clear_refs is unavailable: no resettable resident-set peak")
    assert 49 <= passed <= 53, passed
    assert default >= 60, default  # what the memory pass is for


def test_with_memory_pass_takes_each_phases_peak_from_the_pass():
    timed = dict(config="a", train=dict(median_s=1.0, peak_bytes=70, peak_abs_bytes=90, peak_exact=True),
                 inference=dict(median_s=0.5, peak_bytes=20, peak_abs_bytes=40, peak_exact=True))
    mem = dict(config="a", train=dict(median_s=9.0, peak_bytes=50, peak_abs_bytes=70, peak_exact=True),
               inference=dict(median_s=9.0, peak_bytes=15, peak_abs_bytes=35, peak_exact=True))
    out = timing.with_memory_pass(timed, mem)
    assert out["train"] == dict(median_s=1.0, peak_bytes=50, peak_abs_bytes=70, peak_exact=True,
                                timed_rss_peak_bytes=70)
    assert out["inference"]["peak_bytes"] == 15 and out["inference"]["median_s"] == 0.5
    flat = timing.with_memory_pass(dict(kind="conv", median_s=1.0, peak_bytes=7), dict(peak_bytes=5))
    assert flat["peak_bytes"] == 5 and flat["timed_rss_peak_bytes"] == 7 and flat["median_s"] == 1.0
    failed = timing.with_memory_pass(timed, {"error": "killed"})
    assert failed["error"] == "memory pass: killed"
    assert timing.with_memory_pass({"error": "x"}, mem) == {"error": "x"}
    spec = timing.memory_pass_spec(dict(config="a", warmup=5, iters=20, turns=["go", "ack"]))
    assert spec == dict(config="a", warmup=1, iters=1)


def test_memory_pass_reruns_each_measured_case_in_its_environment():
    calls = []

    def run(script, spec, tmp, timeout=None, env=None):
        calls.append((script, spec, tmp, timeout, env))
        return {"error": "killed"} if spec["case"] == "c" else dict(peak_bytes=5)

    timed = [dict(case="a", peak_bytes=7), {"case": "b", "error": "x"}, {"case": "s", "skipped": "no"},
             dict(case="c", peak_bytes=7)]
    specs = [dict(case=r["case"], warmup=5, iters=20) for r in timed]
    out = timing.memory_pass("tool.py", timed, specs, "/tmp/x", timeout=30, run=run)
    assert calls == [("tool.py", dict(case=c, warmup=1, iters=1), "/tmp/x", 30, timing.MEMORY_PASS_ENV)
                     for c in "ac"]  # failed and skipped cases are not run again
    assert out[0] == dict(case="a", peak_bytes=5, peak_abs_bytes=None, peak_exact=None, timed_rss_peak_bytes=7)
    assert out[1:3] == timed[1:3]
    assert out[3]["case"] == "c" and out[3]["error"] == "memory pass: killed"  # named by its timed result


# ----------------------------------------------------------------------------- AMP settings
def test_amp_dtype_choice():
    assert sorted(AMP_DTYPES) == ["bfloat16", "float16"]
    assert default_amp_dtype("cpu") == "bfloat16" and default_amp_dtype("cuda") == "float16"
    assert check_amp_dtype(None, "cpu") == "bfloat16" and check_amp_dtype("float16", "cpu") == "float16"
    with pytest.raises(ValueError, match=r"--amp-dtype must be one of \['bfloat16', 'float16'\]"):
        check_amp_dtype("fp8", "cpu")
    assert needs_grad_scaler("cuda", "float16") and not needs_grad_scaler("cuda", "bfloat16")
    assert not needs_grad_scaler("cpu", "float16") and not needs_grad_scaler("cuda", "float16", False)


@pytest.mark.parametrize("name", sorted(AMP_DTYPES))
def test_autocast_uses_the_chosen_dtype(name):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with autocast("cpu", name):
        assert (a @ b).dtype == AMP_DTYPES[name]
    with autocast("cpu", name, enabled=False):
        assert (a @ b).dtype == torch.float32


def test_worker_main_reports_cuda_oom_as_a_result(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"n": 2}))
    assert worker_main(str(spec), lambda s: {"twice": 2 * s["n"]}) == 0
    assert json.loads(capsys.readouterr().out) == {"twice": 4}

    def oom(_):
        raise torch.cuda.OutOfMemoryError("tried to allocate 80 GiB")

    assert worker_main(str(spec), oom) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"error": "CUDA out of memory: tried to allocate 80 GiB"}
    with pytest.raises(KeyError):  # other failures fail the worker (the stderr reaches the table)
        worker_main(str(spec), lambda s: s["missing"])


# ----------------------------------------------------------------------------- the two tools
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


def test_benchmark_layers_ratios():
    benchmark_layers = load_tool("benchmark_layers")

    def case(impl, median, cpu, peak, suite="sasa"):
        return dict(suite=suite, kind="layer", impl=impl, side=20, channels=256,
                    **_timed(median, cpu, peak))  # fmt: skip

    results = [case("neighborhood", 2.0, 1.0, 30), case("unfold", 8.0, 4.0, 60),
               case("conv3x3", 1.0, 0.0, 10),
               dict(suite="aa", kind="core", impl="naive", side=80, channels=128, skipped="big")]
    benchmark_layers.add_ratios(results)
    assert results[0]["ratios"] == {
        "conv3x3": {"time": 2.0, "cpu_time": None, "peak_mem": 3.0},  # zero CPU time: no ratio
        "unfold": {"time": 0.25, "cpu_time": 0.25, "peak_mem": 0.5},
    }
    assert results[2]["ratios"]["conv3x3"] == {"time": 1.0, "cpu_time": None, "peak_mem": 1.0}
    assert "ratios" not in results[3]
    env = {"device_name": "Test CPU", "torch": torch.__version__, "torch_threads": 1}
    md = render_layer_tables(dict(device="cpu", batch=1, amp=False, iters=3, warmup=1, env=env,
                                  reference_check={"sasa": 1e-12}, results=results))
    assert md.startswith("Device: Test CPU (cpu)") and "reference check" in md.lower() and "sasa 1.0e-12" in md
    assert ("| 20x20, C=256 | LocalSelfAttention2d, ours (neighborhood) | 2000.0 | 1000.0 | 2.00 | 0.25 | 0 "
            "| 3.00 | 0.50 |") in md
    assert "| 80x80, C=128 | core, naive (full logits + rel_to_abs) | big |" in md


def test_benchmark_layers_halo_ratios_and_table():
    """HaloNet's suite: each route against the 3x3 conv and the SASA layer of the same size."""
    benchmark_layers = load_tool("benchmark_layers")

    def case(impl, median, cpu, peak):
        return dict(suite="halo", kind="layer", impl=impl, side=40, channels=256, **_timed(median, cpu, peak))

    results = [case("cpp", 3.0, 3.0, 40), case("conv3x3", 2.0, 2.0, 10), case("sasa", 6.0, 4.0, 80),
               case("fused", 1.0, 1.0, 20)]
    benchmark_layers.add_ratios(results)
    assert results[0]["ratios"] == {
        "conv3x3": {"time": 1.5, "cpu_time": 1.5, "peak_mem": 4.0},
        "sasa": {"time": 0.5, "cpu_time": 0.75, "peak_mem": 0.5},
    }
    env = {"device_name": "Test CPU", "torch": torch.__version__, "torch_threads": 1}
    md = render_layer_tables(dict(device="cpu", batch=1, amp=False, iters=3, warmup=1, env=env,
                                  reference_check={"sasa": 1e-12}, results=results))
    assert "**HaloNet: HaloSelfAttention2d (b 8, h 3, 8 heads) vs 3x3 conv and SASA (k 7)**" in md
    assert "| 40x40, C=256 | HaloSelfAttention2d, ours (C++ kernel) | 3000.0 | 3000.0 | 1.50 | 0.50 |" in md
    assert "| 40x40, C=256 | HaloSelfAttention2d, ours (fused SDPA) | 1000.0 | 1000.0 | 0.50 | 0.17 |" in md


def test_benchmark_layers_stem_ratios_and_table():
    """The attention stem's suite: each route against the conv stem of the same input."""
    benchmark_layers = load_tool("benchmark_layers")

    def case(impl, median, cpu, peak):
        return dict(suite="stem", kind="layer", impl=impl, side=256, channels=64, in_channels=3,
                    **_timed(median, cpu, peak))  # fmt: skip

    results = [case("factorized", 3.0, 3.0, 40), case("projected", 4.0, 2.0, 60), case("cpp", 1.0, 1.0, 20),
               case("convstem", 0.5, 0.5, 10)]
    benchmark_layers.add_ratios(results)
    assert results[0]["ratios"] == {"convstem": {"time": 6.0, "cpu_time": 6.0, "peak_mem": 4.0}}
    assert results[1]["ratios"] == {"convstem": {"time": 8.0, "cpu_time": 4.0, "peak_mem": 6.0}}
    assert results[3]["ratios"] == {"convstem": {"time": 1.0, "cpu_time": 1.0, "peak_mem": 1.0}}
    env = {"device_name": "Test CPU", "torch": torch.__version__, "torch_threads": 1}
    md = render_layer_tables(dict(device="cpu", batch=8, amp=False, iters=3, warmup=1, env=env,
                                  reference_check={"sasa": 1e-12}, results=results))
    assert "Batch 8" in md
    assert ("**Attention stem: SpatiallyAwareAttentionStem (block 4, 1 head, 4 mixtures, no norm) vs the conv "
            "stem (7x7/2 conv, 3x3/2 max pool, no norm), by input side**") in md
    assert ("| Map, width | Implementation | fwd+bwd ms | CPU ms | time × convstem | peak MiB | mem × convstem |"
            in md)
    ours = "| 256x256, C=3->64 | SpatiallyAwareAttentionStem, ours"
    assert f"{ours} (C++ kernel) | 1000.0 | 1000.0 | 2.00 | 0 | 2.00 |" in md
    assert f"{ours} (projected) | 4000.0 | 2000.0 | 8.00 | 0 | 6.00 |" in md
    assert "| 256x256, C=3->64 | conv stem (7x7/2 conv, 3x3/2 max pool) | 500.0 | 500.0 | 1.00 | 0 | 1.00 |" in md


def test_benchmark_layers_rounds_and_their_ratio_range():
    """Rounds of the layer suite: each case's time is the median of its rounds, a case that failed
    in a round is reported failed, and the report's layer rows carry each round's ratio range."""
    benchmark_layers = load_tool("benchmark_layers")

    def case(impl, median, **extra):
        return dict(suite="halo", kind="layer", impl=impl, side=40, channels=256, iters=5,
                    times_s=[median] * 5, **_timed(median, median, 10), **extra)

    rounds = [[case("cpp", 1.0), case("conv3x3", 1.0), case("bmm", 1.0)],
              [case("cpp", 1.8), case("conv3x3", 2.0), dict(case("bmm", 0), error="killed")],
              [case("cpp", 0.9), case("conv3x3", 1.2), case("bmm", 1.0)]]
    cpp, conv, bmm = benchmark_layers.add_ratios(
        merge_rounds(rounds, benchmark_layers.combine_rounds, failed=benchmark_layers.not_measured))
    assert cpp["median_s"] == 1.0 and conv["median_s"] == 1.2 and cpp["round_medians_s"] == [1.0, 1.8, 0.9]
    assert cpp["ratios"]["conv3x3"]["time"] == pytest.approx(1.0 / 1.2) and bmm["error"] == "killed"
    rows = {r["impl"]: r for r in layer_rows(dict(batch=1, amp=False, results=[cpp, conv, bmm]))}
    assert rows["cpp"]["train_ms_ratio"] == pytest.approx(1.0 / 1.2)
    assert rows["cpp"]["train_ms_ratio_range"] == pytest.approx([0.75, 1.0])  # rounds: 1.0, 0.9, 0.75
    assert "train_ms_ratio_range" not in rows["bmm"]


def test_interleaved_ratio_is_the_median_of_the_paired_iterations():
    """The machine ran at half speed during the second turn: ratio of medians would say 1.6, the
    pairs (each iteration over the baseline's of the same turn) say 1.5 with a narrow spread."""
    benchmark = load_tool("benchmark")
    base, aa = "configs/base.yaml", "configs/aa.yaml"

    def case(config, times):
        return {"config": config, "amp": False, "params": 1e6,
                "train": dict(_timed(sorted(times)[1], sorted(times)[1], 1), times_s=times, images_per_s=1.0)}

    results = benchmark.add_ratios([case(base, [1.0, 2.0, 1.0]), case(aa, [1.5, 3.0, 1.6])], base)
    assert results[1]["ratios"]["train_time"] == pytest.approx(1.6)
    benchmark.add_paired_spread(results, base)
    assert results[1]["ratios"]["train_time"] == pytest.approx(1.5)
    assert results[1]["ratio_ranges"]["train_time"] == pytest.approx([1.5, 1.55])
    report = {"baseline": base, "interleave": True, "results": results}
    rows = config_rows(report)
    assert rows[1]["train_ms_ratio"] == pytest.approx(1.5)
    assert rows[1]["train_ms_ratio_range"] == pytest.approx([1.5, 1.55])
    assert config_rows(dict(report, interleave=False))[1]["train_ms_ratio"] == pytest.approx(1.6)


_TURN_WORKER = """
import sys, time
sys.path.insert(0, {tools!r})
from aadet_tools.timing import TakeTurns, time_fn, worker_main

def run_case(spec):
    if spec.get("fail"):
        raise RuntimeError("this case fails")
    starts = []
    def fn():
        starts.append(time.monotonic())
        time.sleep(0.02)
    time_fn(fn, warmup=1, iters=3, turns=TakeTurns.from_spec(spec))
    return {{"name": spec["name"], "starts": starts}}

sys.exit(worker_main(sys.argv[2], run_case))
"""


def test_interleaved_workers_take_turns_call_by_call(tmp_path):
    """--interleave's mechanism: the workers' calls (warm-up and timed) alternate a, b, a, b, ...
    (no two at once), and a worker that fails drops out without stopping the others."""
    script = tmp_path / "worker.py"
    script.write_text(_TURN_WORKER.format(tools=TOOLS))
    specs = [{"name": "a"}, {"name": "broken", "fail": True}, {"name": "b"}]
    a, broken, b = timing.run_interleaved(str(script), specs, str(tmp_path), calls=4, timeout=120)
    assert "this case fails" in broken["error"]
    calls = sorted([(t, "a") for t in a["starts"]] + [(t, "b") for t in b["starts"]])
    assert [name for _, name in calls] == ["a", "b"] * 4
    assert all(t1 - t0 >= 0.015 for (t0, _), (t1, _) in zip(calls, calls[1:]))  # one at a time


@pytest.mark.parametrize("tool", ["benchmark", "benchmark_layers"])
def test_tools_take_amp_dtype(tool, capsys):
    """``--amp-dtype`` offers exactly the allowed values; a bad one is refused by name."""
    parser = load_tool(tool).build_parser()
    assert "--amp-dtype {bfloat16,float16}" in parser.format_help()
    assert parser.parse_args(["--amp-dtype", "bfloat16"]).amp_dtype == "bfloat16"
    assert parser.parse_args([]).amp_dtype is None  # resolved per device: default_amp_dtype
    with pytest.raises(SystemExit):
        parser.parse_args(["--amp-dtype", "fp8"])
    assert "--amp-dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_tools_refuse_repeated_cases_before_running():
    """A repeated config / size would give two results under one key: refused up front, not
    after the measurements."""
    benchmark, benchmark_layers = load_tool("benchmark"), load_tool("benchmark_layers")

    config = os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml")
    with pytest.raises(SystemExit, match="lists .*trees_R_26_slim_FPN.yaml.* more than once"):
        benchmark.main(["--configs", config, config])
    with pytest.raises(SystemExit, match=r"--sizes lists a size more than once: \[20, 20\]"):
        benchmark_layers.main(["--sizes", "20", "20"])


# ----------------------------------------------------------------------------- tiny runs
def test_layer_benchmark_naive_references_agree_with_ours():
    tool = load_tool("benchmark_layers")
    with torch.no_grad():
        ref = tool.check_references()
    assert max(ref.values()) < 1e-9, ref


@pytest.mark.parametrize("impl", ["neighborhood", "cpp", "cpp-recompute", "fused"])
def test_layer_benchmark_case_runs(impl):
    tool = load_tool("benchmark_layers")
    assert {c["impl"] for c in tool.plan_cases(["sasa"], [20], 1, 0)} == {
        "neighborhood", "fused", "cpp", "cpp-recompute", "unfold", "conv3x3"}
    assert {c["impl"] for c in tool.plan_cases(["sasa"], [20], 1, 0, cuda=True)} == {
        "neighborhood", "fused", "triton", "unfold", "conv3x3"}
    aa_core = {c["impl"] for c in tool.plan_cases(["aa"], [20], 1, 0, cuda=True) if c["kind"] == "core"}
    assert {"triton", "flex"} <= aa_core
    case = dict(suite="sasa", kind="layer", impl=impl, side=20, channels=256)
    spec = dict(case=case, device="cpu", batch=1, warmup=0, iters=1, amp=False, threads=None)
    r = tool.run_case(spec)
    assert r["median_s"] > 0 and r["peak_bytes"] >= 0


@pytest.mark.parametrize("impl", ["cpp", "sasa"])
def test_layer_benchmark_halo_case_runs(impl):
    tool = load_tool("benchmark_layers")
    assert [c["impl"] for c in tool.plan_cases(["halo"], [20], 1, 0)] == [
        "cpp", "bmm", "materialized", "fused", "sasa", "conv3x3"]
    assert [c["impl"] for c in tool.plan_cases(["halo"], [20], 1, 0, cuda=True)] == [
        "fused", "materialized", "sasa", "conv3x3"]
    case = dict(suite="halo", kind="layer", impl=impl, side=12, channels=16)
    spec = dict(case=case, device="cpu", batch=1, warmup=0, iters=1, amp=False, threads=None)
    r = tool.run_case(spec)
    assert r["median_s"] > 0 and r["peak_bytes"] >= 0


def test_layer_benchmark_stem_suite_plans_its_routes_at_its_own_shape():
    """``--suite stem``: every route of the stem but ``auto`` on CPU, the PyTorch ones on CUDA, then
    the conv stem; by default the demo's training batch and crop, which --batch / --sizes override;
    ``--suite all`` leaves it out."""
    tool = load_tool("benchmark_layers")
    assert [c["impl"] for c in tool.plan_cases(["stem"], [256], 8, 0)] == [
        "factorized", "projected", "cpp", "convstem"]
    assert [c["impl"] for c in tool.plan_cases(["stem"], [256], 8, 0, cuda=True)] == [
        "factorized", "projected", "convstem"]
    assert {(c["side"], c["channels"], c["in_channels"]) for c in tool.plan_cases(["stem"], [256], 8, 0)} == {
        (256, 64, 3)}
    parse = lambda *argv: tool.suites_sizes_batch(tool.build_parser().parse_args(argv))  # noqa: E731
    assert parse("--suite", "stem") == (("stem",), [256], 8)
    assert parse("--suite", "stem", "--sizes", "64", "32", "--batch", "2") == (("stem",), [64, 32], 2)
    assert parse() == (("aa", "sasa", "halo"), [80, 40, 20], 1)
    assert parse("--suite", "halo", "--batch", "4") == (("halo",), [80, 40, 20], 4)


@pytest.mark.parametrize("impl", ["factorized", "projected", "cpp", "convstem"])
def test_layer_benchmark_stem_case_runs(impl):
    """A tiny case of each stem route and of the conv stem; both stems give the same output size."""
    tool = load_tool("benchmark_layers")
    case = dict(suite="stem", kind="layer", impl=impl, side=18, channels=8, in_channels=3)
    spec = dict(case=case, device="cpu", batch=2, warmup=0, iters=1, amp=False, threads=None)
    r = tool.run_case(spec)
    assert r["median_s"] > 0 and r["peak_bytes"] >= 0
    x = torch.randn(2, 3, 18, 18)
    attention = tool.SpatiallyAwareAttentionStem(3, 8, num_heads=1, norm="", impl="factorized")
    assert attention(x).shape == tool.conv_stem(3, 8)(x).shape == (2, 8, 5, 5)


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
