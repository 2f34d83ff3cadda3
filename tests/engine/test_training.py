"""Short from-scratch trainings on the built-in tree-crown data learn at all: smoke tests.

Each architecture's run is its committed demo config shortened (``tests/helpers/learning_runs.py``,
which holds the runs, their thresholds and the measurement command): it must reach its val AP50 and
cut its loss. These tests catch a model or recipe that does not train (a broken loss, data, init
or schedule); they do **not** catch a broken attention: on the recorded runs a model with its
attention broken (``tests/helpers/broken_attention.py``) reaches the thresholds too (docs/testing.md,
generated from docs/runs/learning; ``dev/tests/test_generated_docs.py`` checks that every threshold
sits below the recorded correct runs). The float64 exactness tests and the layer learning test
(``tests/layers/test_attention_learning.py``) catch those; ``tests/layers/test_mutations_are_caught.py``
shows it for every mutation and attention module.
"""
import json
import os
import subprocess

import pytest

from aadet.engine.run_summary import last_box_metrics

from tests.helpers.learning_runs import RUNS, command, environment


def read_metrics(out):
    """The last val evaluation (``{"AP", "AP50", "AP75"}``) and the logged losses of a run."""
    path = os.path.join(out, "metrics.json")
    with open(path) as f:
        losses = [r["total_loss"] for r in map(json.loads, f) if "total_loss" in r]
    return last_box_metrics(path, "trees_val"), losses


def _train(name, out, trees_root, mutation=None):
    env = environment(AADET_DATASETS=trees_root)
    p = subprocess.run(command(name, str(out), mutation=mutation), env=env, capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    m, losses = read_metrics(str(out))
    print(f"{name}{' BROKEN ' + mutation if mutation else ''}: AP {m['AP']:.2f} "
          f"AP50 {m['AP50']:.2f} AP75 {m['AP75']:.2f} loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return m, losses


@pytest.mark.learning  # 1-5 minutes each on 2 cores (docs/testing.md)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_short_training_learns_at_all(name, trees_root, tmp_path):
    """Smoke test: the run reaches ``RUNS[name].min_ap50`` on val (an untrained RetinaNet scores 0)
    and cuts its loss by a quarter. A broken attention passes it too (module docstring)."""
    m, losses = _train(name, tmp_path, trees_root)
    assert m["AP50"] >= RUNS[name].min_ap50, m
    assert losses[-1] < 0.75 * losses[0], losses
