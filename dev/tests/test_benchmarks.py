"""``dev/benchmark_layers.py``: its ratios and tables on hand-made results, its naive references,
tiny runs of each suite; the flags both benchmark commands share, and the GPU report's rows of an
interleaved ``tools/benchmark.py`` run."""
import os

import pytest
import torch

from aadet.benchmark.timing import merge_rounds
from aadet_dev.benchmark_tables import render_layer_tables
from aadet_dev.gpu_report import config_rows, layer_rows

from tests.helpers import REPO, load_dev, load_tool



def _timed(median, cpu, peak, **extra):
    return dict(median_s=median, cpu_median_s=cpu, peak_bytes=peak, **extra)


def test_benchmark_layers_ratios():
    benchmark_layers = load_dev("benchmark_layers")

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
    benchmark_layers = load_dev("benchmark_layers")

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
    benchmark_layers = load_dev("benchmark_layers")

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
    benchmark_layers = load_dev("benchmark_layers")

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


@pytest.mark.parametrize("load", [lambda: load_tool("benchmark"), lambda: load_dev("benchmark_layers")],
                         ids=["benchmark", "benchmark_layers"])
def test_tools_take_amp_dtype(load, capsys):
    """``--amp-dtype`` offers exactly the allowed values; a bad one is refused by name."""
    parser = load().build_parser()
    assert "--amp-dtype {bfloat16,float16}" in parser.format_help()
    assert parser.parse_args(["--amp-dtype", "bfloat16"]).amp_dtype == "bfloat16"
    assert parser.parse_args([]).amp_dtype is None  # resolved per device: default_amp_dtype
    with pytest.raises(SystemExit):
        parser.parse_args(["--amp-dtype", "fp8"])
    assert "--amp-dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_tools_refuse_repeated_cases_before_running():
    """A repeated config / size would give two results under one key: refused up front, not
    after the measurements."""
    benchmark, benchmark_layers = load_tool("benchmark"), load_dev("benchmark_layers")

    config = os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml")
    with pytest.raises(SystemExit, match="lists .*trees_R_26_slim_FPN.yaml.* more than once"):
        benchmark.main(["--configs", config, config])
    with pytest.raises(SystemExit, match=r"--sizes lists a size more than once: \[20, 20\]"):
        benchmark_layers.main(["--sizes", "20", "20"])


# ----------------------------------------------------------------------------- tiny runs
def test_layer_benchmark_naive_references_agree_with_ours():
    tool = load_dev("benchmark_layers")
    with torch.no_grad():
        ref = tool.check_references()
    assert max(ref.values()) < 1e-9, ref


@pytest.mark.parametrize("impl", ["neighborhood", "cpp", "cpp-recompute", "fused"])
def test_layer_benchmark_case_runs(impl):
    tool = load_dev("benchmark_layers")
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
    tool = load_dev("benchmark_layers")
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
    tool = load_dev("benchmark_layers")
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
    tool = load_dev("benchmark_layers")
    case = dict(suite="stem", kind="layer", impl=impl, side=18, channels=8, in_channels=3)
    spec = dict(case=case, device="cpu", batch=2, warmup=0, iters=1, amp=False, threads=None)
    r = tool.run_case(spec)
    assert r["median_s"] > 0 and r["peak_bytes"] >= 0
    x = torch.randn(2, 3, 18, 18)
    attention = tool.SpatiallyAwareAttentionStem(3, 8, num_heads=1, norm="", impl="factorized")
    assert attention(x).shape == tool.conv_stem(3, 8)(x).shape == (2, 8, 5, 5)


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
