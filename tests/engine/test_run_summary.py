"""Run summaries (``aadet/engine/run_summary.py``): ``tools/train_net.py`` writes one after every
training and ``--eval-only`` run, with every field the demo results read back; a run that stops
before its last iteration writes none."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from aadet.engine import get_aadet_cfg
from aadet.engine.run_summary import SUMMARY_FILE, RunSummaryHook, load_summary, write_run_summary

from tests.helpers import REPO
from tests.helpers.tiny_training import DEMO, TINY

#: What dev/aadet_dev/demo_results.py and the docs' tables read of a summary.
FIELDS = {"config_file", "opts", "config_diff", "seed", "commit", "dirty", "machine", "eval_only",
          "iterations", "train_seconds", "cpu_seconds", "load_average", "metrics"}
BOX = {"bbox": {"AP": 10.0, "AP50": 20.0, "AP75": 5.0, "APs": 1.0}}


def _cfg(tmp_path, datasets=("trees_val",)):
    cfg = get_aadet_cfg()
    cfg.OUTPUT_DIR, cfg.DATASETS.TEST, cfg.SEED = str(tmp_path), datasets, 7
    cfg.MODEL.RESNETS.DEPTH = 26
    return cfg


def _trainer(cfg, max_iter, results=None):
    return SimpleNamespace(cfg=cfg, iter=0, start_iter=0, max_iter=max_iter, last_eval_results=results)


def test_the_hook_writes_the_summary_after_the_last_iteration(tmp_path):
    cfg = _cfg(tmp_path)
    hook = RunSummaryHook(os.path.join(REPO, "configs", "Demo", "x.yaml"), ["SEED", "7"])
    hook.trainer = _trainer(cfg, max_iter=3, results=BOX)
    hook.before_train()
    for it in range(3):
        hook.trainer.iter = it
        hook.after_step()
    hook.after_train()
    s = load_summary(os.path.join(tmp_path, SUMMARY_FILE))
    assert FIELDS <= set(s)
    assert s["config_file"] == "configs/Demo/x.yaml" and s["opts"] == ["SEED", "7"] and s["seed"] == 7
    # what differs from the defaults, but where a run executes or writes (SEED, OUTPUT_DIR)
    assert s["config_diff"] == {"DATASETS.TEST": ["trees_val"], "MODEL.RESNETS.DEPTH": 26}
    assert s["iterations"] == 3 and not s["eval_only"] and s["train_seconds"] >= 0 and s["cpu_seconds"] >= 0
    assert s["metrics"] == {"trees_val": {"AP": 10.0, "AP50": 20.0, "AP75": 5.0}}


def test_a_run_stopped_early_writes_no_summary(tmp_path):
    hook = RunSummaryHook("", [])
    hook.trainer = _trainer(_cfg(tmp_path), max_iter=3)
    hook.before_train()
    hook.after_step()  # iteration 0 of 3, then a crash
    hook.after_train()
    assert not os.path.exists(os.path.join(tmp_path, SUMMARY_FILE))


def test_an_evaluation_writes_its_metrics_per_dataset(tmp_path):
    cfg = _cfg(tmp_path, ("trees_val", "trees_test"))
    path = write_run_summary(cfg, "", [], {"trees_val": BOX, "trees_test": BOX}, eval_only=True)
    s = load_summary(path)
    assert s["eval_only"] and s["iterations"] == 0 and set(s["metrics"]) == {"trees_val", "trees_test"}


@pytest.mark.slow  # a training in a subprocess
def test_train_net_registers_the_hook(data_env, tmp_path):
    """A real (two-iteration) training of ``tools/train_net.py`` ends with its summary."""
    opts = [*TINY, "SOLVER.MAX_ITER", "2", "SOLVER.STEPS", "()", "SOLVER.WARMUP_ITERS", "1",
            "OUTPUT_DIR", str(tmp_path)]
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "train_net.py"), "--config-file", DEMO, *opts],
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / SUMMARY_FILE) as f:
        s = json.load(f)
    assert FIELDS <= set(s) and s["iterations"] == 2 and s["metrics"] == {} and not s["eval_only"]
    assert s["config_file"] == "configs/Demo/trees_R_26_slim_FPN.yaml" and s["opts"] == opts
