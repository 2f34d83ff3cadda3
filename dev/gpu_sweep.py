#!/usr/bin/env python
"""The production-shape sweep (``dev/aadet_dev/sweep.py``): every attention layer shape of the
configs at their own size, every CUDA route of its family and the 3x3 conv beside it, fp32 / bf16 /
fp16, one JSON row per case appended to ``--out`` as it is measured.

    python dev/gpu_sweep.py --out output/sweep.jsonl --seconds 200      # the COCO configs, 640, batch 8
    python dev/gpu_sweep.py --out sweep.jsonl --configs configs/Demo/*.yaml --device cpu --size 64 \\
        --batch 1 --iters 1   # the CPU dry run

A second run with the same ``--out`` measures only the cases the first did not reach.
"""
import argparse
import glob
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.jit deprecation (detectron2, fvcore)

import torch  # noqa: E402

from aadet_dev.gpu_report import BENCHMARK_CONFIGS  # noqa: E402
from aadet_dev.sweep import PRECISIONS, collect_layers, plan_cases, routes_of, run_sweep  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The configs whose layers the sweep takes by default: the COCO configs (the papers' size).
DEFAULT_CONFIGS = "configs/COCO-Detection/*.yaml"


def default_configs() -> list:
    """The COCO configs, those of the benchmark targets first (their layers are measured first,
    what a call cut at its budget must have), HaloNet's next, then the rest."""
    rest = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, DEFAULT_CONFIGS)))
    first = [c for c in BENCHMARK_CONFIGS if c in rest] + [c for c in rest if "halo_" in c]
    return first + [c for c in rest if c not in first]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=None,
                   help=f"YAML configs (default {DEFAULT_CONFIGS}, the benchmark targets' first)")
    p.add_argument("--out", required=True, help="JSON lines: one row per case, appended")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=int, default=None, help="input side (default: each config's test size)")
    p.add_argument("--batch", type=int, default=8, help="the batch a device trains (default 8)")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--iters", type=int, default=3, help="timed steps a case (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps a case, the checked one first (default 1)")
    p.add_argument("--seconds", type=float, default=float("inf"), help="stop before a case that would not fit")
    p.add_argument("--plan", action="store_true", help="print the shapes and the number of cases, measure nothing")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    configs = args.configs or [os.path.join(REPO, c) for c in default_configs()]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--device cpu for a dry run)")
    shapes = collect_layers(configs, size=args.size, device=args.device)
    cases = plan_cases(shapes, args.device, args.precisions)
    print(f"[sweep] {len(shapes)} layer shapes from {len(configs)} configs, {len(cases)} cases "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    plan_path = os.path.splitext(args.out)[0] + ".plan.json"
    with open(plan_path, "w") as f:
        json.dump({"cases": len(cases), "precisions": args.precisions, "batch": args.batch,
                   "shapes": [dict(s.row(), routes=list(routes_of(s, args.device))) for s in shapes]}, f, indent=1)
    if args.plan:
        for s in shapes:
            print(f"  {s['family']:8s} {s['key']}  ({len(s['configs'])} layers)")
        return 0
    left = args.seconds - (time.perf_counter() - t0)
    counts = run_sweep(shapes, args.out, batch=args.batch, device=args.device, seconds=left,
                       iters=args.iters, warmup=args.warmup, precisions=args.precisions,
                       log=lambda m: print(m, flush=True))
    print(f"[sweep] {counts}", flush=True)
    return 0 if counts["failed"] == 0 and counts["left"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
