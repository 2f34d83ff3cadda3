"""Runs ``tools/train_net.py``'s training for the reliability tests, in a subprocess:

  python tests/helpers/train_worker.py OUT_DIR [--num-gpus N] [--resume] [--compile] [--die-at ITER] [--save-ranks] \
      -- KEY VALUE ...

Runs with this checkout and ``tools/`` on ``PYTHONPATH`` (``tiny_training.run_worker``).
``--die-at ITER`` SIGKILLs the process right after iteration ITER (a hard crash: no cleanup, no
final checkpoint). ``--save-ranks`` makes every rank save its model's state dict to
OUT_DIR/rank{R}.pth after training, so a test can check that DDP ranks stayed in sync.
"""
import argparse
import os
import signal
import sys

import torch
from detectron2.engine import HookBase, launch
from detectron2.utils import comm

import train_net
from aadet.data import register_trees
from aadet.engine import Trainer


class DieAt(HookBase):
    def __init__(self, it):
        self.it = it

    def after_step(self):
        if self.trainer.iter == self.it:
            os.kill(os.getpid(), signal.SIGKILL)


def worker(a, ta):
    register_trees(a.data_root)
    cfg = train_net.setup(ta)
    trainer = Trainer(cfg)
    if a.die_at is not None:
        trainer.register_hooks([DieAt(a.die_at)])
    trainer.resume_or_load(resume=ta.resume)
    trainer.train()
    if a.save_ranks:
        model = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
        torch.save(model.state_dict(), os.path.join(a.out, f"rank{comm.get_rank()}.pth"))


def main():
    argv = sys.argv[1:]
    opts = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--num-gpus", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--save-ranks", action="store_true")
    a = ap.parse_args(argv)
    ta = train_net.build_parser().parse_args(
        ["--config-file", a.config_file, "--num-gpus", str(a.num_gpus)]
        + (["--resume"] if a.resume else [])
        + (["--compile"] if a.compile else [])
        + ["OUTPUT_DIR", a.out] + opts
    )
    launch(worker, a.num_gpus, dist_url="auto", args=(a, ta))


if __name__ == "__main__":
    main()
