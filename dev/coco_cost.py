#!/usr/bin/env python
"""GPU-hours, wall-clock and memory of every COCO config's schedule on one 8-GPU node, and the
batch / LR rule on other GPU counts (docs/reproduce_coco.md shows the output).

    python dev/coco_cost.py                      # markdown: assumptions, cost table, scaling table
    python dev/coco_cost.py --write docs/reproduce_coco.md   # replace the doc's generated block
    python dev/coco_cost.py --gpu V100           # estimates from the V100 reference instead
    python dev/coco_cost.py --bench docs/benchmarks_cuda.json --count-flops

A config benchmarked in ``docs/benchmarks_cuda.json`` (``make gpu-check``: 640x640, 8 images a GPU)
gets a "measured" row; the others are "estimated" from FLOPs and public reference measurements.
FLOPs are read from ``docs/model_table.md`` (``--count-flops`` counts them again: minutes). The
method and every constant: ``dev/aadet_dev/cost.py``.
"""
import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.jit deprecation (detectron2)

import aadet  # noqa: E402, F401
from aadet_dev import cost  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def render(args) -> str:
    """The block for ``args`` (``--gpu``, ``--bench``, ``--model-table``, ``--count-flops``)."""
    configs = cost.coco_configs(REPO)
    if args.count_flops:
        flops, flops_from = cost.count_flops(configs), "counted now (--count-flops)"
    else:
        with open(args.model_table) as f:
            flops = cost.read_model_table(f.read())
        flops_from = os.path.relpath(args.model_table, REPO)
    bench = None
    if os.path.isfile(args.bench):
        with open(args.bench) as f:
            bench = json.load(f)
    return cost.render_block(configs, flops, flops_from, bench, args.gpu)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", choices=sorted(cost.REFERENCES), default="A100",
                   help="the GPU the estimated rows are for (its reference measurement)")
    p.add_argument("--bench", default=os.path.join(REPO, "docs", "benchmarks_cuda.json"),
                   help="benchmark JSON of `make gpu-check` (measured rows where it has the config)")
    p.add_argument("--model-table", default=os.path.join(REPO, "docs", "model_table.md"),
                   help="FLOPs and parameters per config (dev/update_docs.py --model-table)")
    p.add_argument("--count-flops", action="store_true",
                   help="count FLOPs by building every COCO model instead of reading the model table")
    p.add_argument("--write", metavar="FILE",
                   help=f"replace the {cost.BEGIN} ... {cost.END} block of FILE instead of printing")
    args = p.parse_args(argv)
    try:
        block = render(args)
        if not args.write:
            sys.stdout.write(block)
            return 0
        with open(args.write) as f:
            text = f.read()
        text = cost.replace_block(text, block)
    except ValueError as e:
        print(f"coco_cost: {e}", file=sys.stderr)
        return 1
    with open(args.write, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
