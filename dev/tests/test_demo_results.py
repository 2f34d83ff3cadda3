"""The demo results' mechanics on made-up summaries: grouping, means, ranges, ratios, the noise
of a split, the record tool (the committed docs themselves: dev/tests/test_generated_docs.py)."""
import copy
import json
import math
import os

import pytest

from aadet_dev.demo_results import (
    BASELINE,
    SPLIT_OBJECTS,
    TEST,
    VAL,
    build_demo_results,
    entry_name,
    recipe_opts,
    render_headline_table,
    render_noise_table,
    replace_block,
    sampling_error,
)
from aadet_dev.generated_docs import committed_override
from aadet.engine.run_summary import box_metrics_by_dataset, last_box_metrics

from tests.helpers import REPO, load_dev


# ----------------------------------------------------------------------------- the mechanics
def _summary(config, seed, val50, test50, opts=(), seconds=300.0, file=None):
    return {
        "format": 1,
        "config_file": f"configs/Demo/{config}.yaml",
        "opts": ["SEED", str(seed), "OUTPUT_DIR", "/x", *opts],
        "config_diff": {},
        "seed": seed,
        "commit": "0123456789abcdef",
        "machine": {"cpu": "Test CPU", "cpu_count": 2, "torch_threads": 2},
        "eval_only": False,
        "iterations": 10,
        "train_seconds": seconds,
        "cpu_seconds": 2 * seconds,  # both threads busy: the CPU to itself
        "metrics": {VAL: {"AP": val50 / 3, "AP50": val50, "AP75": 1.0},
                    TEST: {"AP": test50 / 3, "AP50": test50, "AP75": 2.0}},
        "_file": file or f"{config}_s{seed}.json",
    }


def _write(folder, summaries):
    os.makedirs(folder, exist_ok=True)
    for s in summaries:
        s = dict(s)
        name = s.pop("_file")
        with open(os.path.join(folder, name), "w") as f:
            json.dump(s, f)


def test_entries_means_ranges_and_ratios(tmp_path):
    alt = ["INPUT.SCALE_JITTER.FLIP_PROB", "0.5"]
    runs = [
        _summary(BASELINE, 42, 40.0, 20.0), _summary(BASELINE, 7, 44.0, 30.0),
        _summary(BASELINE, 123, 42.0, 25.0),
        _summary(BASELINE, 42, 30.0, 26.0, alt, file="a_s42.json"),
        _summary("trees_AA_R_26_slim_FPN", 42, 21.0, 10.0, seconds=600.0),
    ]
    runs[1]["cpu_seconds"] = 100.0  # CPU shared: its time does not count
    _write(tmp_path, runs)
    res = build_demo_results(str(tmp_path))
    assert sorted(res) == sorted([BASELINE, f"{BASELINE} INPUT.SCALE_JITTER.FLIP_PROB=0.5",
                                  "trees_AA_R_26_slim_FPN"])
    base = res[BASELINE]
    assert base["seeds"] == [42, 7, 123]  # 42, 7, 123 first, in that order
    assert base[VAL]["AP50"] == {"mean": 42.0, "min": 40.0, "max": 44.0}
    assert base[TEST]["AP50"] == {"mean": 25.0, "min": 20.0, "max": 30.0} and base[TEST]["n"] == 3
    assert (base["AP"], base["AP50"]) == (pytest.approx(42.0 / 3, abs=0.01), 42.0)  # val: the instrument
    assert base["train_minutes"] == {"mean": 5.0, "min": 5.0, "max": 5.0} and base["timed_runs"] == 2
    assert base["machines"] == ["Test CPU, 2 cores"]
    rows = render_headline_table(res, [BASELINE, "trees_AA_R_26_slim_FPN", "trees_missing"]).splitlines()
    e_val, e_test = sampling_error(42.0, SPLIT_OBJECTS[VAL]), sampling_error(25.0, SPLIT_OBJECTS[TEST])
    assert f"| 42.0 ±{e_val:.1f} (40.0–44.0) | 1.00x | 25.0 ±{e_test:.1f} (20.0–30.0) |" in rows[2]
    assert "| 0.50x |" in rows[3] and "(1 run)" in rows[3] and "| 10.0 (1 run) |" in rows[3]
    assert rows[4].startswith("| `trees_missing` | 0 | not run")
    assert not any(" on Test CPU" in r for r in rows[2:])  # one CPU: the header names it
    assert rows[0].endswith("| Training (min, Test CPU) |")
    runs[4]["machine"] = dict(runs[4]["machine"], cpu="Other CPU, model 9")
    _write(tmp_path, runs)
    rows = render_headline_table(build_demo_results(str(tmp_path)), [BASELINE, "trees_AA_R_26_slim_FPN"]).splitlines()
    assert rows[2].endswith("| 5.0 (5.0–5.0) on Test CPU |") and rows[3].endswith("| 10.0 (1 run) on Other CPU |")
    assert rows[0].endswith("| Training (min) |")


def test_the_table_rounds_once_from_the_runs(tmp_path):
    """A number rounded to 2 decimals and then shown with 1 can land on the wrong side: 42.5517 ->
    42.55 -> "42.5", 38.746 -> 38.75 -> "38.8", 8.9533 min -> 8.95 -> "8.9". The table shows each
    number rounded once from the runs: 42.6, 38.7, 9.0."""
    runs = [_summary(BASELINE, 42, 42.5517, 38.746, seconds=8.9533 * 60),
            _summary(BASELINE, 7, 50.0, 30.0, seconds=10 * 60)]
    _write(tmp_path, runs)
    row = render_headline_table(build_demo_results(str(tmp_path)), [BASELINE]).splitlines()[2]
    assert "(42.6–50.0)" in row and "(30.0–38.7)" in row and "| 9.5 (9.0–10.0) |" in row, row


def test_sampling_error_is_binomial_over_the_split_objects(tmp_path):
    assert sampling_error(30.0, 37) == pytest.approx(100 * math.sqrt(0.3 * 0.7 / 37))  # 7.5 points
    assert sampling_error(0.0, 37) == 0.0 and sampling_error(46.0, 414) < sampling_error(46.0, 37)
    _write(tmp_path, [_summary(BASELINE, s, v, t) for s, v, t in ((42, 40.0, 20.0), (7, 44.0, 30.0))])
    rows = render_noise_table(build_demo_results(str(tmp_path))).splitlines()
    n = SPLIT_OBJECTS[TEST]
    assert f"| `{TEST}` | {n} | {100 / n:.1f} | ±{sampling_error(25.0, n):.1f} (at 25.0) | 10.0 (20.0–30.0) |" in rows


def test_overrides_that_change_nothing_leave_the_name():
    opts = ["SEED", "7", "OUTPUT_DIR", "o", "MODEL.DEVICE", "cpu", "MODEL.WEIGHTS", "w.pth",
            "INPUT.MIN_SIZE_TEST", "400", "SOLVER.IMS_PER_BATCH", "4"]
    assert recipe_opts(opts) == (("INPUT.MIN_SIZE_TEST", "400"), ("SOLVER.IMS_PER_BATCH", "4"))
    s = _summary(BASELINE, 7, 1.0, 1.0, opts[8:])
    assert entry_name(s) == f"{BASELINE} INPUT.MIN_SIZE_TEST=400 SOLVER.IMS_PER_BATCH=4"
    committed = {"SOLVER.IMS_PER_BATCH": "4"}  # what the config file sets today
    assert entry_name(s, lambda f, k, v: committed.get(k) == v) == f"{BASELINE} INPUT.MIN_SIZE_TEST=400"
    assert entry_name(dict(s, broken_attention="uniform")).endswith(" broken=uniform")


def test_committed_override_loads_the_config(tmp_path):
    same = committed_override(REPO)
    conv = f"configs/Demo/{BASELINE}.yaml"
    assert same(conv, "SOLVER.IMS_PER_BATCH", "4") and not same(conv, "SOLVER.IMS_PER_BATCH", "8")
    assert same(conv, "MODEL.RESNETS.NORM", "GN") and not same(conv, "MODEL.RESNETS.NORM", "BN")


def test_record_tool_adds_runs(tmp_path, monkeypatch, capsys):
    tool = load_dev("record_demo_results")
    monkeypatch.setattr(tool, "REPO", str(tmp_path))
    monkeypatch.setattr(tool, "write", lambda repo: None)  # the docs: test_generated_docs.py
    run = tmp_path / "out" / f"{BASELINE}_s42"
    _write(run, [dict(_summary(BASELINE, 42, 40.0, 20.0), _file="run_summary.json")])
    assert tool.main([str(run)]) == 0
    assert os.path.isfile(tmp_path / "docs" / "runs" / "demo" / f"{BASELINE}_s42.json")
    assert tool.main(["--into", "learning", str(run)]) == 0
    assert os.path.isfile(tmp_path / "docs" / "runs" / "learning" / f"{BASELINE}_s42.json")
    (tmp_path / "empty").mkdir()  # a folder without a summary is named, nothing is written
    assert tool.main([str(tmp_path / "empty")]) == 1
    assert "empty" in capsys.readouterr().err
    # a run whose config lay outside the checkout that ran (an absolute config_file) is refused
    elsewhere = tmp_path / "out" / f"{BASELINE}_s7"
    _write(elsewhere, [dict(_summary(BASELINE, 7, 40.0, 20.0), config_file="/elsewhere/configs/Demo/x.yaml",
                            _file="run_summary.json")])
    assert tool.main([str(elsewhere)]) == 1
    assert "outside the checkout" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "docs" / "runs" / "demo" / f"{BASELINE}_s7.json")


def test_replace_block_needs_its_markers():
    text = "a\n<!-- generated:x:begin -->\nold\n<!-- generated:x:end -->\nb\n"
    assert replace_block(text, "x", "new\n") == (
        "a\n<!-- generated:x:begin -->\nnew\n<!-- generated:x:end -->\nb\n")
    with pytest.raises(ValueError, match="generated:y:begin"):
        replace_block(text, "y", "")


# ----------------------------------------------------------------------------- reading results
def test_box_metrics_of_one_and_of_several_datasets(tmp_path):
    one = {"bbox": {"AP": 1.0, "AP50": 2.0, "AP75": 0.5, "APs": 9.0}}
    assert box_metrics_by_dataset(one, ["trees_val"]) == {
        "trees_val": {"AP": 1.0, "AP50": 2.0, "AP75": 0.5}}
    two = {"trees_val": copy.deepcopy(one), "trees_test": {"bbox": {"AP": 3.0, "AP50": 4.0, "AP75": 1.0}}}
    assert box_metrics_by_dataset(two, ["trees_val", "trees_test"])["trees_test"]["AP50"] == 4.0
    with pytest.raises(ValueError, match="trees_x"):
        box_metrics_by_dataset(two, ["trees_x"])
    path = tmp_path / "metrics.json"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"iteration": 1, "total_loss": 1.0},
        {"iteration": 2, "trees_val/bbox/AP": 1.0, "trees_val/bbox/AP50": 2.0, "trees_val/bbox/AP75": 0.0,
         "trees_test/bbox/AP": 3.0, "trees_test/bbox/AP50": 4.0, "trees_test/bbox/AP75": 5.0},
    ]) + "\n")
    assert last_box_metrics(str(path), "trees_test") == {"AP": 3.0, "AP50": 4.0, "AP75": 5.0}
    with pytest.raises(ValueError, match="no bbox/AP50"):
        last_box_metrics(str(path))
