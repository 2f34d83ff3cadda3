"""Every demo figure in the docs comes from a run summary committed under docs/runs/.

* the generated files (``docs/demo_results.json``, the tables of ``docs/demo_results.md`` and
  ``README.md``) equal what ``tools/record_demo_results.py`` makes from ``docs/runs/`` today;
* every summary was made with the config that its file and overrides give today (a changed config
  invalidates its numbers instead of keeping them);
* no AP figure is typed into the docs' prose outside the generated blocks;
* the grouping, means, ranges and ratios themselves, on made-up summaries.
"""
import copy
import json
import os
import re

import pytest

from aadet.analysis.demo_results import (
    BASELINE,
    TEST,
    VAL,
    build_demo_results,
    entry_name,
    recipe_opts,
    summary_recipe_opts,
    render_results_table,
    render_variant_table,
    replace_block,
)
from aadet.analysis.model_table import COLUMNS, MARKDOWN_COMMAND, SUMMARY_BEGIN, SUMMARY_END, TABLE_END, render_markdown
from aadet.utils.run_summary import box_metrics_by_dataset, config_diff, last_box_metrics, load_summaries

from tests.helpers import REPO, load_tool

RUNS = os.path.join(REPO, "docs", "runs", "demo")
LEARNING_RUNS = os.path.join(REPO, "docs", "runs", "learning")


def _tool():
    return load_tool("record_demo_results")


# ----------------------------------------------------------------------------- the committed docs
def test_generated_files_are_up_to_date(capsys):
    assert _tool().main(["--check"]) == 0, capsys.readouterr().err


def test_every_demo_config_has_recorded_runs():
    results = build_demo_results(RUNS)
    for name in _tool().DEMOS:
        assert name in results, f"no run of {name} under docs/runs"
        assert TEST in results[name] and VAL in results[name], name


def _all_summaries():
    return [s for d in (RUNS, LEARNING_RUNS) if os.path.isdir(d) for s in load_summaries(d)]


@pytest.mark.parametrize(
    "summary", _all_summaries(), ids=lambda s: s["_file"] if isinstance(s, dict) else str(s)
)
def test_summary_was_made_with_todays_config(summary):
    """Resolve the summary's config file and overrides as tools/train_net.py does: the keys that
    differ from the defaults must be the ones the run recorded."""
    from aadet.engine import apply_epoch_schedule, get_aadet_cfg, load_config

    opts = [x for kv in summary_recipe_opts(summary) for x in kv]
    cfg = load_config(os.path.join(REPO, summary["config_file"]), opts, freeze=False)
    if not summary.get("eval_only"):
        apply_epoch_schedule(cfg)
    assert config_diff(cfg, get_aadet_cfg()) == summary["config_diff"], (
        f"{summary['_file']}: {summary['config_file']} has changed since this run; run it again "
        "and record it (docs/demo_results.md shows the commands)"
    )


_PROSE_AP = re.compile(r"\bAP(50|75)?\b[^|\n]{0,12}?\b\d+\.\d\b")


@pytest.mark.parametrize("doc", ["README.md", "docs/demo_results.md", "docs/testing.md"])
def test_no_ap_figure_is_typed_into_prose(doc):
    """Demo AP figures live only in generated blocks: outside them no line pairs 'AP'/'AP50' with a
    decimal number (the model table, generated too, is left out as well)."""
    path = os.path.join(REPO, doc)
    if not os.path.isfile(path):
        pytest.skip(f"{doc} does not exist")
    text = open(path).read()
    text = re.sub(r"<!-- ([\w:-]+):begin -->.*?<!-- \1:end -->", "", text, flags=re.S)
    text = re.sub(r"<!-- demo-results:(\w+):begin -->.*?<!-- demo-results:\1:end -->", "", text,
                  flags=re.S)
    text = re.sub(r"<!-- model-table:begin -->.*?<!-- model-table:end -->", "", text, flags=re.S)
    hits = [ln for ln in text.splitlines() if _PROSE_AP.search(ln)]
    assert not hits, f"{doc}: AP figures outside generated blocks:\n" + "\n".join(hits[:10])


# ----------------------------------------------------------------------------- the mechanics
def _summary(config, seed, val50, test50, opts=(), seconds=300.0, file=None):
    return {
        "format": 1,
        "config_file": f"configs/Demo/{config}.yaml",
        "opts": ["SEED", str(seed), "OUTPUT_DIR", "/x", *opts],
        "config_diff": {},
        "seed": seed,
        "commit": "0123456789abcdef",
        "machine": {"cpu": "Test CPU", "cpu_count": 2},
        "eval_only": False,
        "iterations": 10,
        "train_seconds": seconds,
        "load_average": [1.9, 1.5, 1.0],
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
    runs[1]["load_average"] = [3.5, 2.0, 1.0]  # CPU shared: its time does not count
    _write(tmp_path, runs)
    res = build_demo_results(str(tmp_path))
    assert sorted(res) == sorted([BASELINE, f"{BASELINE} INPUT.SCALE_JITTER.FLIP_PROB=0.5",
                                  "trees_AA_R_26_slim_FPN"])
    base = res[BASELINE]
    assert base["seeds"] == [42, 7, 123]  # 42, 7, 123 first, in that order
    assert base[VAL]["AP50"] == {"mean": 42.0, "min": 40.0, "max": 44.0}
    assert base[TEST]["AP50"] == {"mean": 25.0, "min": 20.0, "max": 30.0} and base[TEST]["n"] == 3
    assert (base["AP"], base["AP50"], base["split"]) == (pytest.approx(25.0 / 3, abs=0.01), 25.0, TEST)
    assert base["train_minutes"] == {"mean": 5.0, "min": 5.0, "max": 5.0} and base["timed_runs"] == 2
    assert base["machines"] == ["Test CPU, 2 cores"]
    table = render_results_table(res, [BASELINE, "trees_AA_R_26_slim_FPN", "trees_missing"])
    rows = table.splitlines()
    assert "| 25.0 (20.0–30.0) | 42.0 (40.0–44.0) | 1.00x (baseline) |" in rows[2]
    assert "| 10.0 (1 run) | 21.0 (1 run) | 0.40x / 0.50x |" in rows[3]
    assert "| 10.0 (1 run) |" in rows[3] and rows[4].startswith("| `trees_missing` | 0 | not run")
    choices = render_variant_table(res, [(BASELINE, f"{BASELINE} INPUT.SCALE_JITTER.FLIP_PROB=0.5")])
    row = choices.splitlines()[2]
    assert "`INPUT.SCALE_JITTER.FLIP_PROB=0.5`" in row
    assert "42.0 / 30.0 (+12.0)" in row and "25.0 / 26.0 (-1.0)" in row and row.endswith("| no |")


def test_recipe_opts_leave_out_where_a_run_executes():
    opts = ["SEED", "7", "OUTPUT_DIR", "o", "MODEL.DEVICE", "cpu", "MODEL.WEIGHTS", "w.pth",
            "INPUT.MIN_SIZE_TEST", "400"]
    assert recipe_opts(opts) == (("INPUT.MIN_SIZE_TEST", "400"),)
    s = _summary(BASELINE, 7, 1.0, 1.0, ["INPUT.MIN_SIZE_TEST", "400"])
    assert entry_name(s) == f"{BASELINE} INPUT.MIN_SIZE_TEST=400"


def test_runs_before_a_recipe_change_keep_their_old_value_in_their_name():
    """RECIPE_CHANGES (GN -> BN): a run that recorded GN without setting it is today's config with
    GN; one that set BN on its command line is today's config; an explicit setting stays."""
    old = dict(_summary(BASELINE, 7, 1.0, 1.0),
               config_diff={"MODEL.RESNETS.NORM": "GN", "MODEL.FPN.NORM": "GN"})
    assert entry_name(old) == f"{BASELINE} MODEL.RESNETS.NORM=GN MODEL.FPN.NORM=GN"
    bn = ["MODEL.RESNETS.NORM", "BN", "MODEL.FPN.NORM", "BN"]
    ahead = dict(_summary(BASELINE, 7, 1.0, 1.0, bn),
                 config_diff={"MODEL.RESNETS.NORM": "BN", "MODEL.FPN.NORM": "BN"})
    assert summary_recipe_opts(ahead) == () and entry_name(ahead) == BASELINE
    gn = dict(_summary(BASELINE, 7, 1.0, 1.0, ["MODEL.FPN.NORM", "GN"]),
              config_diff={"MODEL.RESNETS.NORM": "BN", "MODEL.FPN.NORM": "GN"})
    assert entry_name(gn) == f"{BASELINE} MODEL.FPN.NORM=GN"
    variant = dict(old, opts=["INPUT.MIN_SIZE_TEST", "400"])  # a variant of the old recipe
    assert entry_name(variant) == f"{entry_name(old)} INPUT.MIN_SIZE_TEST=400"
    elsewhere = dict(old, config_file="configs/Demo/trees_SASA_full_attention_R_26_slim.yaml")
    assert entry_name(elsewhere) == "trees_SASA_full_attention_R_26_slim"  # not a changed config


def test_record_tool_adds_runs_and_checks(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    blocks = "".join(f"<!-- demo-results:{b}:begin -->\n<!-- demo-results:{b}:end -->\n"
                     for b in ("headline", "choices", "gn"))
    (repo / "docs" / "demo_results.md").write_text("# x\n" + blocks)
    table = render_markdown([], MARKDOWN_COMMAND).replace(  # one row: the conv demo
        "\n\n" + TABLE_END, f"\n| `Demo/{BASELINE}` |" + " 1 |" * (len(COLUMNS) - 1) + "\n\n" + TABLE_END)
    (repo / "docs" / "model_table.md").write_text(table)
    (repo / "README.md").write_text(f"# r\n{SUMMARY_BEGIN}\n{SUMMARY_END}\n")
    run = tmp_path / "out" / f"{BASELINE}_s42"
    _write(run, [dict(_summary(BASELINE, 42, 40.0, 20.0), _file="run_summary.json")])
    tool = _tool()
    runs_dir = str(repo / "docs" / "runs")
    args = ["--runs-dir", runs_dir, "--repo", str(repo)]
    assert tool.main([*args, "--check"]) == 1  # README block empty, json missing
    assert tool.main([str(run), *args]) == 0
    assert os.path.isfile(os.path.join(runs_dir, "demo", f"{BASELINE}_s42.json"))
    assert "20.0 (1 run)" in (repo / "README.md").read_text()
    assert json.loads((repo / "docs" / "demo_results.json").read_text())[BASELINE]["AP50"] == 20.0
    assert tool.main([*args, "--check"]) == 0
    # a hand edit of a generated number is caught
    readme = (repo / "README.md").read_text().replace("20.0 (1 run)", "21.0 (1 run)")
    (repo / "README.md").write_text(readme)
    assert tool.main([*args, "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    # a folder without a summary is named, nothing is written
    (tmp_path / "empty").mkdir()
    assert tool.main([str(tmp_path / "empty"), *args]) == 1


def test_replace_block_needs_its_markers():
    text = "a\n<!-- demo-results:x:begin -->\nold\n<!-- demo-results:x:end -->\nb\n"
    assert replace_block(text, "x", "new\n") == (
        "a\n<!-- demo-results:x:begin -->\nnew\n<!-- demo-results:x:end -->\nb\n")
    with pytest.raises(ValueError, match="demo-results:y:begin"):
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
