"""Short from-scratch training runs on the built-in tree-crown data must *learn*: each reaches a
stated AP50 on the val split (a source image never seen in training) and cuts its loss.

These runs are a few percent of the demo's schedule (the full `make demo` run reaches AP50 23.6,
README), so their AP is small; what they prove is that detections appear where an untrained
model has none (AP50 0)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The demo recipe shortened to 15 epochs of 8 images (117 iterations, about 80 s on 2 cores).
SHORT = ["SOLVER.IMS_PER_BATCH", "8", "SOLVER.BASE_LR", "0.03", "SOLVER.EPOCHS", "15",
         "SOLVER.STEPS_EPOCHS", "(11, 14)", "SOLVER.WARMUP_ITERS", "30"]
# SASA's local attention costs about 2x a conv on CPU: 8 epochs of 192 px crops (62 iterations, 53 s).
SASA_SHORT = ["SOLVER.EPOCHS", "8", "SOLVER.STEPS_EPOCHS", "(6, 7)", "SOLVER.WARMUP_ITERS", "20",
              "INPUT.SCALE_JITTER.CROP_SIZE", "192"]
# The all-attention model (attention stem, backbone, FPN and head) learns more slowly: twice the
# epochs on 160 px crops (124 iterations, about 145 s on 2 cores).
SASA_FULL_SHORT = ["SOLVER.EPOCHS", "16", "SOLVER.STEPS_EPOCHS", "(12, 15)", "SOLVER.WARMUP_ITERS", "20",
                   "INPUT.SCALE_JITTER.CROP_SIZE", "160"]
# config, extra overrides, AP50 the run must reach. Measured on these exact runs (fixed seed,
# 2 cores): conv 1.34, AA 2.14, SASA 0.71, SASA all-attention 0.98 AP50 -- an untrained
# RetinaNet scores 0 (its prior probability 0.01 is below the test score threshold 0.05).
# Thresholds are about half of that.
RUNS = {
    "conv": ("trees_R_50_slim_FPN.yaml", [], 0.7),
    "aa": ("trees_AA_R_50_slim_FPN.yaml", [], 1.0),
    "sasa": ("trees_SASA_R_26_slim_FPN.yaml", SASA_SHORT, 0.35),
    "sasa_full_attention": ("trees_SASA_full_attention_R_26_slim.yaml", SASA_FULL_SHORT, 0.5),
}


def read_metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        rows = [json.loads(line) for line in f]
    evals = [r for r in rows if "bbox/AP50" in r]
    losses = [r["total_loss"] for r in rows if "total_loss" in r]
    assert evals, "no evaluation in metrics.json"
    return evals[-1], losses


@pytest.mark.slow  # 80-145 s each on 2 cores
@pytest.mark.parametrize("name", sorted(RUNS))
def test_short_training_learns(name, trees_root, tmp_path):
    config, overrides, min_ap50 = RUNS[name]
    env = dict(os.environ, AADET_DATASETS=trees_root, PYTHONPATH=REPO)
    cmd = [sys.executable, os.path.join(REPO, "tools", "train_net.py"),
           "--config-file", os.path.join(REPO, "configs", "Demo", config),
           "OUTPUT_DIR", str(tmp_path), "MODEL.DEVICE", "cpu", *SHORT, *overrides]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    m, losses = read_metrics(str(tmp_path))
    print(f"{name}: AP {m['bbox/AP']:.2f} AP50 {m['bbox/AP50']:.2f} AP75 {m['bbox/AP75']:.2f}")
    assert m["bbox/AP50"] >= min_ap50, m
    assert losses[-1] < 0.75 * losses[0], losses  # measured: 0.63x (conv), 0.56x (SASA), 0.62x (all attention)
