"""The one test that reads the committed docs: every generated block equals what
``tools/update_docs.py`` makes from the committed data today, and that data is today's.

* the generated blocks (demo results, learning table, the model table counted again, README's
  results table, BENCHMARKS' tables, the COCO cost tables) are up to date (``make docs``
  fixes them);
* every run summary under ``docs/runs`` was made with the config that its file and overrides
  give today: a changed config invalidates its numbers instead of keeping them;
* every demo config has its three seeds.
"""
import os

import pytest

from aadet_tools.demo_results import DEMOS, SEEDS, TEST, VAL, build_demo_results, recipe_opts
from aadet_tools.generated_docs import committed_override

from tests.helpers import REPO, load_tool

RUNS = os.path.join(REPO, "docs", "runs")


@pytest.mark.slow  # counts every config's parameters and FLOPs (minutes)
def test_generated_docs_are_up_to_date(capsys):
    assert load_tool("update_docs").main(["--check", "--model-table"]) == 0, capsys.readouterr().err


def test_every_demo_config_has_its_seeds():
    results = build_demo_results(os.path.join(RUNS, "demo"), committed_override(REPO))
    for name in DEMOS:
        assert name in results, f"no run of {name} under docs/runs/demo"
        assert sorted(results[name]["seeds"]) == sorted(SEEDS), (name, results[name]["seeds"])
        assert results[name][VAL]["n"] == results[name][TEST]["n"] == len(SEEDS), name


def _all_summaries():
    from aadet_tools.run_summary import load_summaries

    return [s for kind in ("demo", "learning") if os.path.isdir(os.path.join(RUNS, kind))
            for s in load_summaries(os.path.join(RUNS, kind))]


@pytest.mark.parametrize("summary", _all_summaries(), ids=lambda s: s["_file"])
def test_summary_was_made_with_todays_config(summary):
    """Resolve the summary's config file and overrides as tools/train_net.py does: the keys that
    differ from the defaults must be the ones the run recorded."""
    from aadet.engine import apply_epoch_schedule, get_aadet_cfg, load_config
    from aadet_tools.run_summary import config_diff

    opts = [x for kv in recipe_opts(summary.get("opts", [])) for x in kv]
    cfg = load_config(os.path.join(REPO, summary["config_file"]), opts, freeze=False)
    if not summary.get("eval_only"):
        apply_epoch_schedule(cfg)
    assert config_diff(cfg, get_aadet_cfg()) == summary["config_diff"], (
        f"{summary['_file']}: {summary['config_file']} has changed since this run; run it again "
        "and record it (docs/demo_results.md shows the commands)"
    )
