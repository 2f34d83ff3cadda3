#!/usr/bin/env python
"""Parameters and FLOPs of aadet models (aadet-config aware), next to the papers' numbers.

    python tools/analyze_model.py --config-file configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep.yaml
    python tools/analyze_model.py --all                      # every config under configs/
    python tools/analyze_model.py --all --no-flops           # parameters only (seconds)
    python tools/analyze_model.py --config-file CFG --size 800 MODEL.AA.KAPPA 0.25

Detectron2's ``tools/analyze_model.py`` builds its config with plain ``get_cfg()`` (no aadet
keys) and its fvcore counter has no handler for attention; this tool loads configs with
``aadet.engine.load_config`` and counts attention by the papers' formulas (convention in
``aadet/analysis/flops.py``). FLOPs are the papers' (2 per multiply-add); the multiply-adds
themselves (fvcore's "flops") are printed too. Runs on CPU; a 640x640 count takes 1-15 s a model.
"""

import argparse
import logging
import os
import sys
import time
import warnings

warnings.filterwarnings(
    "ignore", category=FutureWarning
)  # torch.jit deprecation (detectron2, fvcore)

import aadet  # noqa: E402,F401  (registers the models)
from aadet.analysis.model_stats import analyze_config, list_configs  # noqa: E402
from aadet.benchmark.report import write_json  # noqa: E402
from aadet.engine.defaults import parse_args_with_opts  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--config-file", nargs="+", metavar="FILE", help="one or more config files")
    g.add_argument(
        "--all", action="store_true", help="every model config under configs/ (Base-* excluded)"
    )
    p.add_argument(
        "--size",
        type=int,
        nargs="+",
        default=None,
        metavar="PX",
        help="input size for FLOPs: S (SxS) or H W (default: each config's test size, "
        "INPUT.MAX_SIZE_TEST square: 640 for COCO, the papers' size)",
    )
    p.add_argument("--no-flops", action="store_true", help="parameters only")
    p.add_argument("--json", metavar="FILE", help="also write all numbers (exact counts) as JSON")
    p.add_argument("opts", nargs=argparse.REMAINDER, default=[], help="config overrides KEY VALUE ..., every config")
    return p


def _paper_delta(ours: float, paper, digits: int) -> str:
    if paper is None:
        return "not in the paper"
    return f"{paper:g} (ours {ours - paper:+.{digits}f}, {100 * (ours - paper) / paper:+.1f}%)"


def _text_report(row) -> str:
    p, f = row.params, row.flops
    lines = [
        f"== {row.config}",
        f"  params      {p['total']:>12,d}  (backbone {p['backbone']:,d} / FPN {p['fpn']:,d} / head {p['head']:,d}"
        + (f" / other {p['other']:,d}" if p["other"] else "")
        + ")",
    ]
    if f is not None:
        lines.append(
            f"  FLOPs @{row.size[0]}x{row.size[1]}: {2 * f['total'] / 1e9:.2f} GFLOPs (paper convention, 2/MAC) = "
            f"{f['total'] / 1e9:.2f} GMACs; backbone {f['backbone'] / 1e9:.2f} / FPN {f['fpn'] / 1e9:.2f} / "
            f"head {f['head'] / 1e9:.2f} GMACs"
        )
        lines.append(
            f"  attention   {f['attention'] / 1e9:.3f} GMACs (in the total); implementation overhead "
            f"{f['overhead'] / 1e9:.3f} GMACs (not in the total)"
        )
        if f.get("unsupported_ops"):
            lines.append(f"  WARNING: ops fvcore could not count: {f['unsupported_ops']}")
    paper = row.paper
    if paper is not None:
        gflops = 2 * f["total"] / 1e9 if f is not None else None
        lines.append(
            f"  paper ({paper.source}): params (M) {_paper_delta(p['total'] / 1e6, paper.params_m, 2)}; "
            + (f"GFLOPs {_paper_delta(gflops, paper.gflops, 1)}; " if gflops is not None else "")
            + f"COCO mAP {paper.map if paper.map is not None else 'not given'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args_with_opts(build_parser(), argv)  # overrides after --configs / --size too
    logging.getLogger("fvcore").setLevel(logging.ERROR)
    logging.getLogger("detectron2").setLevel(logging.ERROR)
    size = None
    if args.size is not None:
        if len(args.size) not in (1, 2) or min(args.size) < 32:
            raise SystemExit(f"--size takes S or H W (each >= 32); got {args.size}")
        size = (args.size[0], args.size[-1])
    if args.all:
        configs = list_configs(os.path.join(REPO, "configs"))
    else:
        configs = args.config_file
        missing = [c for c in configs if not os.path.isfile(c)]
        if missing:
            raise SystemExit(f"config file(s) not found: {missing}")
    rows = []
    for c in configs:
        t0 = time.perf_counter()
        row = analyze_config(c, size, flops=not args.no_flops, opts=args.opts)
        rows.append(row)
        print(_text_report(row) + f"\n  ({time.perf_counter() - t0:.1f} s)", flush=True)
    if args.json:
        write_json(args.json, {"rows": [r.to_json() for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
