"""Short from-scratch training runs on the built-in tree-crown data must *learn*: each reaches a
stated AP50 on the val split (a source image never seen in training) and cuts its loss.

``AADET_BREAK_ATTENTION=MUTATION`` runs the same trainings with the attention deliberately broken
(``tests/broken_attention.py``: relative embeddings zeroed, windows one pixel off, uniform
attention), and the README's "Learning tests" table lists what each broken run reached. The SASA
backbone run fails with zeroed relative embeddings and with uniform attention (a window one pixel off
is learned around: the float64 exactness tests catch it). The AA and all-attention runs pass broken:
AA's attention is 20% of its channels, and the all-attention model learns about as far without
relative positions even over the whole demo. ``tests/test_attention_learning.py`` is the learning
test that catches them on the layers themselves: every mutation for SASA, zeroed relative embeddings
and uniform attention for AA (its global attention learns around a one-row shift)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The shared demo recipe (configs/Demo/Base-Trees.yaml: AdamW 2e-3, batch 8) shortened to 16 epochs
# (124 iterations), decayed at 11 and 14, with the papers' flip 0.5 (the demos mirror every tile for
# their val image; the thresholds below were measured with flip 0.5).
SHORT = ["SOLVER.EPOCHS", "16", "SOLVER.STEPS_EPOCHS", "(11, 14)", "SOLVER.WARMUP_ITERS", "30",
         "SOLVER.IMS_PER_BATCH", "8", "INPUT.SCALE_JITTER.FLIP_PROB", "0.5"]
# SASA's local attention costs about 2x a conv on CPU: 192 px crops. The SASA demo zero-initializes
# its residual blocks; this run keeps the papers' init, because with the zero-init a broken attention
# learns as far in 124 iterations (AP50 13.7 correct, 15.8 relative_zero, 13.7 uniform; machine B,
# 2026-11-24): every block starts as its shortcut, and so short a run does without attention.
SASA_SHORT = ["INPUT.SCALE_JITTER.CROP_SIZE", "192", "MODEL.RESNETS.ZERO_INIT_RESIDUAL", "False"]
# The all-attention model (attention stem, backbone, FPN and head): 160 px crops, with its demo
# config's zero-init (it learns more in 124 iterations than with the papers' init: AP50 2.6 / 1.8 on
# seeds 42 / 7 against 1.0). It only checks that the model learns at all: a broken attention learns as
# far here (1.4 relative_zero, 0.9 uniform, 0.65 off_by_one; seed 42), and even after the whole demo
# (relative_zero 27.2 against 24.2-32.8 correct): README "Learning tests".
SASA_FULL_SHORT = ["INPUT.SCALE_JITTER.CROP_SIZE", "160"]
# config, extra overrides, AP50 the run must reach. Measured on these exact runs (seed 42, 2 cores;
# 2026-11-23, all attention 2026-11-25 on machine B): conv 16.7, AA 18.3, SASA 10.0, all attention 2.6 AP50
# (an untrained RetinaNet scores 0: its prior probability 0.01 is below the test score threshold
# 0.05); broken runs: README "Learning tests".
RUNS = {
    "conv": ("trees_R_26_slim_FPN.yaml", [], 10.0),
    "aa": ("trees_AA_R_26_slim_FPN.yaml", [], 12.0),
    "sasa": ("trees_SASA_R_26_slim_FPN.yaml", SASA_SHORT, 6.0),
    "sasa_full_attention": ("trees_SASA_full_attention_R_26_slim.yaml", SASA_FULL_SHORT, 0.5),
}


def read_metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        rows = [json.loads(line) for line in f]
    evals = [r for r in rows if "bbox/AP50" in r]
    losses = [r["total_loss"] for r in rows if "total_loss" in r]
    assert evals, "no evaluation in metrics.json"
    return evals[-1], losses


@pytest.mark.learning  # 3-10 minutes each on 2 cores (README: Learning tests)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_short_training_learns(name, trees_root, tmp_path):
    config, overrides, min_ap50 = RUNS[name]
    env = dict(os.environ, AADET_DATASETS=trees_root, PYTHONPATH=REPO)
    broken = os.environ.get("AADET_BREAK_ATTENTION")
    entry = (["tests/broken_attention.py", broken] if broken else ["tools/train_net.py"])
    cmd = [sys.executable, os.path.join(REPO, entry[0]), *entry[1:],
           "--config-file", os.path.join(REPO, "configs", "Demo", config),
           "OUTPUT_DIR", str(tmp_path), "MODEL.DEVICE", "cpu", *SHORT, *overrides]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    m, losses = read_metrics(str(tmp_path))
    print(f"{name}{' BROKEN ' + broken if broken else ''}: AP {m['bbox/AP']:.2f} "
          f"AP50 {m['bbox/AP50']:.2f} AP75 {m['bbox/AP75']:.2f} loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert m["bbox/AP50"] >= min_ap50, m
    assert losses[-1] < 0.75 * losses[0], losses
