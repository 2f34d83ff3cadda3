"""The one test that reads the committed docs: every generated block equals what
``dev/update_docs.py`` makes from the committed data today, and that data is today's.

* the generated blocks (demo results, learning table, the model table counted again, README's
  results table, BENCHMARKS' tables, the COCO cost tables) are up to date (``make docs``
  fixes them);
* every run summary under ``docs/runs`` was made with the config that its file and overrides
  give today: a changed config invalidates its numbers instead of keeping them;
* every demo config has its three seeds;
* the committed GPU run record (``docs/runs/gpu``) rendered with the ratios its raw benchmark
  output gives (computed here from that JSON, not from the renderer), its failed and cut-off
  cases named;
* every threshold of the short learning trainings (``tests/engine/test_training.py``) sits below
  each recorded correct run of its recipe (``docs/runs/learning``).
"""
import json
import os

import pytest

from aadet_dev import gpu_record
from aadet_dev.demo_results import DEMOS, SEEDS, TEST, VAL, build_demo_results, entry_name, recipe_opts
from aadet_dev.generated_docs import committed_override

from tests.helpers import REPO, load_dev, markdown_row
from tests.helpers.learning_runs import RUNS as LEARNING_RUNS, command

RUNS = os.path.join(REPO, "docs", "runs")


@pytest.mark.slow  # counts every config's parameters and FLOPs (minutes)
def test_generated_docs_are_up_to_date(capsys):
    assert load_dev("update_docs").main(["--check", "--model-table"]) == 0, capsys.readouterr().err


def test_every_demo_config_has_its_seeds():
    results = build_demo_results(os.path.join(RUNS, "demo"), committed_override(REPO))
    for name in DEMOS:
        assert name in results, f"no run of {name} under docs/runs/demo"
        assert sorted(results[name]["seeds"]) == sorted(SEEDS), (name, results[name]["seeds"])
        assert results[name][VAL]["n"] == results[name][TEST]["n"] == len(SEEDS), name


@pytest.mark.parametrize("name", DEMOS)
def test_headline_table_shows_the_runs_rounded_once(name):
    """The headline row of each demo in docs/demo_results.md against its run files themselves (not
    the generator's output): val and test AP50 as mean (min–max) and the training minutes, each
    rounded once from the raw numbers."""
    import json

    runs = []
    for seed in SEEDS:
        with open(os.path.join(RUNS, "demo", f"{name}_s{seed}.json")) as f:
            runs.append(json.load(f))

    def cell(values):
        return f"{sum(values) / len(values):.1f}", f"({min(values):.1f}–{max(values):.1f})"

    with open(os.path.join(REPO, "docs", "demo_results.md")) as f:
        row = next(line for line in f if line.startswith(f"| `{name}` |"))
    for split in (VAL, TEST):
        mean, span = cell([r["metrics"][split]["AP50"] for r in runs])
        assert f"| {mean} ±" in row and f" {span} |" in row, (split, mean, span, row)
    # minutes: the runs whose process had the CPU to itself, 3/4 of its threads busy (the rule
    # docs/demo_results.md states)
    alone = [r for r in runs if r["cpu_seconds"] >= 0.75 * r["machine"]["torch_threads"] * r["train_seconds"]]
    mean, span = cell([r["train_seconds"] / 60 for r in alone])
    assert row.rstrip().endswith(f"| {mean} {span} |"), (mean, span, row)


def _all_summaries():
    from aadet.engine.run_summary import load_summaries

    return [s for kind in ("demo", "learning") if os.path.isdir(os.path.join(RUNS, kind))
            for s in load_summaries(os.path.join(RUNS, kind))]


@pytest.mark.parametrize("summary", _all_summaries(), ids=lambda s: s["_file"])
def test_summary_was_made_with_todays_config(summary):
    """Resolve the summary's config file and overrides as tools/train_net.py does: the keys that
    differ from the defaults must be the ones the run recorded."""
    from aadet.engine import apply_epoch_schedule, get_aadet_cfg, load_config
    from aadet.engine.run_summary import config_diff

    opts = [x for kv in recipe_opts(summary.get("opts", [])) for x in kv]
    cfg = load_config(os.path.join(REPO, summary["config_file"]), opts, freeze=False)
    if not summary.get("eval_only"):
        apply_epoch_schedule(cfg)
    assert config_diff(cfg, get_aadet_cfg()) == summary["config_diff"], (
        f"{summary['_file']}: {summary['config_file']} has changed since this run; run it again "
        "and record it (docs/demo_results.md shows the commands)"
    )


# ----------------------------------------------------------------------------- learning thresholds vs the recorded runs
#: AP50 points a threshold keeps below the worst recorded correct run.
MARGIN = 1.0


def _measured(name):
    """The val AP50 of the recorded runs of ``name`` (docs/runs/learning), by seed."""
    from aadet.engine.run_summary import load_summaries

    folder = os.path.join(RUNS, "learning")
    want = entry_name({"config_file": LEARNING_RUNS[name].config, "opts": command(name, "x")[4:]})
    if not os.path.isdir(folder):
        return {}
    return {s["seed"]: s["metrics"]["trees_val"]["AP50"] for s in load_summaries(folder)
            if entry_name(s) == want}


@pytest.mark.parametrize("name", sorted(LEARNING_RUNS))
def test_thresholds_sit_below_the_measured_runs(name):
    """Each threshold is below every recorded correct run of the committed recipe (3 seeds or
    more, docs/runs/learning) by MARGIN."""
    correct = _measured(name)
    assert len(correct) >= 3, (
        f"{name}: {len(correct)} recorded correct runs (python tests/helpers/learning_runs.py)")
    assert min(correct.values()) >= LEARNING_RUNS[name].min_ap50 + MARGIN, (name, correct)


# ----------------------------------------------------------------------------- the GPU run record rendered
GPU_RECORD = os.path.join(RUNS, "gpu", "35bbeff-h200")
GPU_AA = "aa_retinanet_R_50_FPN_scratch_150ep"
GPU_CONV = "retinanet_R_50_FPN_scratch_150ep"
GPU_SASA = "sasa_convstem_retinanet_R_50_FPN_scratch_150ep"
GPU_SASA_FULL = "sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"


@pytest.fixture(scope="module")
def gpu_run():
    return gpu_record.load_record(GPU_RECORD, REPO)


@pytest.fixture(scope="module")
def raw():
    """tools/benchmark.py's own output of the first call: {(config, precision): result}."""
    with open(os.path.join(GPU_RECORD, "first_work_bench_configs.json")) as f:
        results = json.load(f)["results"]
    return {(os.path.basename(r["config"])[:-5], "bf16" if r["amp"] else "fp32"): r for r in results}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_committed_record_gives_the_raw_ratios(gpu_run, raw, precision):
    """AA-R50's and the SASA backbone's rows: train step, inference and train peak memory over the
    conv R50's of the same run and precision, from the medians and peaks benchmark.py wrote."""
    text = gpu_record.render_record(gpu_run)
    base = raw[(GPU_CONV, precision)]
    cases = [GPU_AA] + ([GPU_SASA] if precision == "bf16" else [])
    for config in cases:
        r = raw[(config, precision)]
        expected = [f"{r[phase][key] / base[phase][key]:.2f}x"
                    for phase, key in (("train", "median_s"), ("inference", "median_s"), ("train", "peak_bytes"))]
        cells = markdown_row(text, f"`{config}`", precision)
        assert [cells[3], cells[5], cells[7]] == expected, (config, precision, cells)
        assert cells[2] == f"{1e3 * r['train']['median_s']:.1f}"
    headline = gpu_record.render_headline(gpu_run)
    train = raw[(GPU_AA, precision)]["train"]["median_s"] / base["train"]["median_s"]
    assert f"{train:.2f}x ({precision})" in headline


def test_committed_record_names_the_failed_and_cut_off_cases(gpu_run):
    text = gpu_record.render_record(gpu_run)
    for config in (GPU_SASA, GPU_SASA_FULL):  # both SASA R50s in fp32: NaN at the first iteration
        assert markdown_row(text, f"`{config}`", "fp32")[-1] == "**NaN loss at iteration 0**"
    assert markdown_row(text, f"`{GPU_SASA_FULL}`", "bf16")[-1] == "**cut off**"  # the stage's time ran out
    assert "tools/benchmark.py exit timeout after 7 finished case(s)" in text
    assert "the SASA layer (its targets) cut off in fp32 and bf16" in text
    assert markdown_row(text, "SASA attention-backbone RetinaNet train time", f"`{GPU_SASA}`", "fp32")[-1] == \
        "not measured: NaN loss at iteration 0"
    assert markdown_row(text, "SASA all-attention RetinaNet train time", f"`{GPU_SASA_FULL}`", "bf16")[-1] == \
        "not measured: cut off"
    for precision in ("fp32", "bf16"):  # the SASA layer's targets: its suite was cut off
        for what in ("time", "memory"):
            target = f"LocalSelfAttention2d 256 ch k 7 80x80 fwd+bwd {what} vs 3x3 conv"
            assert markdown_row(text, target, "`sasa_*_80`", precision)[-1] == "not measured: cut off"
    # the configs stage: which config x precision ran finite, which did not, which timed out
    configs = "sasa_convstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"
    assert markdown_row(text, f"`{configs}`", "**not finite**: non-finite gradients at iteration 2")[-1] == \
        "finite, 513 ms (2.60x)"  # its bf16 run, timed, against the conv R50's bf16 step
    assert markdown_row(text, "`trees_SASA_R_26_slim_FPN`", "**timed out**")[-1] == "**timed out**"
    assert "29 of 34 config x precision runs finite" in text
    headline = gpu_record.render_headline(gpu_run)
    assert "NaN loss at iteration 0 in fp32" in headline and "did not finish" in headline
    assert "NVIDIA H200" in text and "Triton 3.6.0" in text and "`35bbeff`" in text
    assert "AADET_LOAN_SECONDS=550 bash tools/gpu_loan.sh first $OUT" in text
