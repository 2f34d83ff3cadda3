"""A tiny training of the demo config in a subprocess (``train_worker.py``), shared by the
reliability, EMA and test-time augmentation tests."""
import os
import subprocess
import sys

from tests.helpers import REPO, TOOLS

DEMO = os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml")
#: GN in the backbone and FPN for the tests of mechanics (resume, compile, test-time augmentation)
#: that compare two computations of one model: the demo's BN does not normalize a random model in
#: eval mode (running statistics at their initial 0 and 1), so its outputs are ill-conditioned
#: (near-tied scores, boxes far apart for a rounding), and in train mode on 2-image batches it
#: grows float32 rounding (a resumed run 2.9% off by iteration 12, against 0.3% with GN).
WELL_CONDITIONED = ["MODEL.RESNETS.NORM", "GN", "MODEL.FPN.NORM", "GN"]
# A tiny, fast variant of the demo: small crops, batch 2, every iteration logged.
TINY = [*WELL_CONDITIONED,
    "SOLVER.EPOCHS", "0", "SOLVER.STEPS_EPOCHS", "()", "SOLVER.MAX_ITER", "16",
    "SOLVER.STEPS", "(12,)", "SOLVER.WARMUP_ITERS", "4", "SOLVER.IMS_PER_BATCH", "2",
    "SOLVER.CHECKPOINT_PERIOD", "6", "SOLVER.LOG_PERIOD", "1",
    "INPUT.SCALE_JITTER.CROP_SIZE", "128", "INPUT.SCALE_JITTER.LONG_SIDE_RANGE", "(112, 160)",
    "DATALOADER.NUM_WORKERS", "0", "DATASETS.TEST", "()", "MODEL.DEVICE", "cpu",
]


def run_worker(out, *args, opts=(), check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, TOOLS]))
    cmd = [sys.executable, os.path.join(REPO, "tests", "helpers", "train_worker.py"), str(out),
           "--config-file", DEMO, "--data-root", env.get("AADET_DATASETS", ""), *args, "--", *TINY, *opts]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-4000:]
    return p
