"""Short from-scratch trainings on the built-in tree-crown data must *learn*, and the ones that can
tell must fail with the attention broken.

Each architecture's run is its committed demo config shortened (``tests/helpers/learning_runs.py``,
which holds the runs, their thresholds and the measurement command): it must reach its val AP50 and
cut its loss. Where the measured runs separate -- the worst correct seed above the best broken seed
of a mutation (``tests/helpers/broken_attention.py``) with margin -- the test also trains with that
mutation and asserts it stays below the threshold (``LearningRun.catches``). What each run reached,
per seed and mutation, is in docs/testing.md (generated from docs/runs/learning/), including which
mutations a run does not catch and which test catches them instead
(``tests/layers/test_attention_learning.py``, on the layers themselves, and the float64 exactness
tests).
"""
import json
import os
import subprocess

import pytest

from aadet.utils.run_summary import last_box_metrics

from tests.helpers import REPO
from tests.helpers.learning_runs import MUTATIONS, RUNS, command


def read_metrics(out):
    """The last val evaluation (``{"AP", "AP50", "AP75"}``) and the logged losses of a run."""
    path = os.path.join(out, "metrics.json")
    with open(path) as f:
        losses = [r["total_loss"] for r in map(json.loads, f) if "total_loss" in r]
    return last_box_metrics(path, "trees_val"), losses


def _train(name, out, trees_root, mutation=None):
    env = dict(os.environ, AADET_DATASETS=trees_root, PYTHONPATH=REPO)
    p = subprocess.run(command(name, str(out), mutation=mutation), env=env, capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    m, losses = read_metrics(str(out))
    print(f"{name}{' BROKEN ' + mutation if mutation else ''}: AP {m['AP']:.2f} "
          f"AP50 {m['AP50']:.2f} AP75 {m['AP75']:.2f} loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return m, losses


@pytest.mark.learning  # 1-5 minutes each on 2 cores (docs/testing.md)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_short_training_learns(name, trees_root, tmp_path):
    """The run reaches ``RUNS[name].min_ap50`` on val and cuts its loss by a quarter. The measured
    runs behind each threshold (3 seeds each: the worst correct run, the best broken run of each
    mutation) are stated in the RUNS comment of tests/helpers/learning_runs.py and checked against
    docs/runs/learning by the tests at the end of this file."""
    m, losses = _train(name, tmp_path, trees_root)
    assert m["AP50"] >= RUNS[name].min_ap50, m
    assert losses[-1] < 0.75 * losses[0], losses


@pytest.mark.learning
@pytest.mark.parametrize(
    "name,mutation", [(n, mu) for n in sorted(RUNS) for mu in RUNS[n].catches] or [(None, None)],
)
def test_short_training_with_broken_attention_stays_below(name, mutation, trees_root, tmp_path):
    if name is None:
        pytest.skip("no learning run separates a broken attention (docs/testing.md)")
    m, _ = _train(name, tmp_path, trees_root, mutation)
    assert m["AP50"] < RUNS[name].min_ap50, m


# ----------------------------------------------------------------------------- thresholds vs data
#: AP50 points a threshold keeps from the worst correct run and from the best caught broken run.
MARGIN = 1.0


def _measured(name, mutation=None):
    """The val AP50 of the recorded runs of ``name`` (docs/runs/learning), by seed."""
    from aadet.analysis.demo_results import entry_name
    from aadet.utils.run_summary import load_summaries

    folder = os.path.join(REPO, "docs", "runs", "learning")
    want = entry_name({"config_file": RUNS[name].config, "opts": command(name, "x")[4:],
                       "broken_attention": mutation})
    if not os.path.isdir(folder):
        return {}
    return {s["seed"]: s["metrics"]["trees_val"]["AP50"] for s in load_summaries(folder)
            if entry_name(s) == want}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_thresholds_sit_between_the_measured_runs(name):
    """Each threshold is below every recorded correct run (3 seeds or more) by MARGIN, and above
    every recorded run of each mutation it claims to catch by MARGIN (3 seeds or more)."""
    run = RUNS[name]
    correct = _measured(name)
    assert len(correct) >= 3, (
        f"{name}: {len(correct)} recorded correct runs (python tests/helpers/learning_runs.py)")
    assert min(correct.values()) >= run.min_ap50 + MARGIN, (name, correct)
    for mutation in run.catches:
        broken = _measured(name, mutation)
        assert len(broken) >= 3, f"{name} {mutation}: {len(broken)} recorded runs"
        assert max(broken.values()) <= run.min_ap50 - MARGIN, (name, mutation, broken)


@pytest.mark.parametrize("name", sorted(n for n in RUNS if n != "conv"))  # conv: no attention to break
def test_every_mutation_was_measured_on_the_committed_recipe(name):
    """Whether a test may assert a mutation is decided on today's recipe: each mutation of each
    attention run has 3 recorded seeds or more of exactly the committed run, and the RUNS comment
    of tests/helpers/learning_runs.py states the separation they showed (best broken run per
    mutation against the worst correct run), to one decimal."""
    correct = _measured(name)
    best = {}
    for mutation in MUTATIONS:
        broken = _measured(name, mutation)
        assert len(broken) >= 3, (
            f"{name} {mutation}: {len(broken)} recorded runs on the committed recipe "
            f"(python tests/helpers/learning_runs.py --arch {name} --mutations {mutation})")
        best[mutation] = max(broken.values())
    label = {"aa": "AA", "sasa": "SASA", "sasa_full_attention": "all attention"}[name]
    stated = " / ".join(f"{best[m]:.1f}" for m in MUTATIONS) + f" against {min(correct.values()):.1f}"
    with open(os.path.join(REPO, "tests", "helpers", "learning_runs.py")) as f:
        comment = " ".join(line.strip("#: \n") for line in f if line.startswith("#:"))
    assert f"{label} {stated}" in comment, f"the RUNS comment should say '{label} {stated}'"
