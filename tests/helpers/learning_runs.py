"""The short demo trainings of the learning tests, in one place: what each runs, what it must reach.

``tests/engine/test_training.py`` runs them; ``python tests/helpers/learning_runs.py`` runs the
measurement matrix behind their thresholds (every architecture x seeds x correct and each
broken-attention mutation of ``tests/helpers/broken_attention.py``) and writes one OUTPUT_DIR per
run, to record with
``python dev/record_demo_results.py --into learning DIRS``::

    python tests/helpers/learning_runs.py --out output/learning                     # everything
    python tests/helpers/learning_runs.py --out output/learning --arch aa --seeds 42  # a part

Each run is the architecture's committed demo config (``configs/Demo``) shortened, not changed in
kind: the same model, data, augmentation, batch, optimizer and test pipeline, fewer epochs with the
LR steps at the same fractions (:data:`SHORTEN`).
"""
import argparse
import os
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script too
MUTATIONS = ("relative_zero", "off_by_one", "uniform")  # tests/helpers/broken_attention.py
SEEDS = (42, 7, 123)


class LearningRun(NamedTuple):
    """One learning test: its demo config, the shortening, and what the run must reach.

    ``min_ap50``: val AP50 every correct run must reach, below the worst recorded correct run
    (``tests/engine/test_training.py`` checks it against docs/runs/learning). A smoke threshold:
    runs with the attention broken reach it too (docs/testing.md).
    """

    config: str
    opts: Sequence[str]
    min_ap50: float


def _shorten(epochs: int) -> List[str]:
    """The demo schedule (decay at 41/54 and 49/54 of training) over ``epochs`` epochs."""
    steps = (round(epochs * 41 / 54), round(epochs * 49 / 54))
    return ["SOLVER.EPOCHS", str(epochs), "SOLVER.STEPS_EPOCHS", str(steps),
            "SOLVER.WARMUP_ITERS", "30"]


#: Architecture -> its learning run, on the committed recipe of its demo; the recorded runs behind
#: each threshold (3 seeds each, correct and with each mutation): docs/testing.md.
RUNS: Dict[str, LearningRun] = {
    "conv": LearningRun("trees_R_26_slim_FPN.yaml", _shorten(12), 20.0),
    "aa": LearningRun("trees_AA_R_26_slim_FPN.yaml", _shorten(12), 20.0),
    "sasa": LearningRun("trees_SASA_R_26_slim_FPN.yaml", _shorten(12), 20.0),
    "sasa_full_attention": LearningRun(
        "trees_SASA_full_attention_R_26_slim.yaml",
        # its committed config trains batch 8: 16 epochs are 124 iterations; 160 px crops
        [*_shorten(16), "INPUT.SCALE_JITTER.CROP_SIZE", "160"],
        0.8,  # learns at all: an untrained RetinaNet scores 0
    ),
}


def environment(**extra: str) -> Dict[str, str]:
    """The environment of a run: this checkout's ``aadet`` and ``tools/`` (``aadet_dev``) on
    ``PYTHONPATH``, as a run through ``broken_attention.py`` needs (it starts ``train_net.py``
    from the helper's folder)."""
    return dict(os.environ, PYTHONPATH=REPO, **extra)


def command(arch: str, out: str, seed: Optional[int] = None, mutation: Optional[str] = None) -> List[str]:
    """The command line of one run (``tools/train_net.py``, or through ``broken_attention.py``):
    ``[python, script, (mutation,) "--config-file", CONFIG, KEY, VALUE, ...]``."""
    run = RUNS[arch]
    entry = ([os.path.join(REPO, "tests", "helpers", "broken_attention.py"), mutation] if mutation
             else [os.path.join(REPO, "tools", "train_net.py")])
    seed_opts = ["SEED", str(seed)] if seed is not None else []
    return [sys.executable, *entry, "--config-file", os.path.join(REPO, "configs", "Demo", run.config),
            *seed_opts, "OUTPUT_DIR", out, "MODEL.DEVICE", "cpu", *run.opts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="parent folder of the runs' OUTPUT_DIRs")
    p.add_argument("--arch", nargs="*", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    p.add_argument("--mutations", nargs="*", default=["none", *MUTATIONS], choices=["none", *MUTATIONS])
    args = p.parse_args(argv)
    env = environment()
    os.makedirs(args.out, exist_ok=True)
    failed = 0
    for arch in args.arch:
        for mutation in args.mutations:
            if arch == "conv" and mutation != "none":
                continue  # no attention to break
            for seed in args.seeds:
                name = f"{arch}{'' if mutation == 'none' else '-' + mutation}_s{seed}"
                out = os.path.join(args.out, name)
                if os.path.isfile(os.path.join(out, "run_summary.json")):
                    continue
                cmd = command(arch, out, seed, None if mutation == "none" else mutation)
                print(" ".join(cmd), flush=True)
                with open(out + ".log", "w") as log:
                    rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
                failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
