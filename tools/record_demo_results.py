#!/usr/bin/env python
"""Record finished demo runs under docs/runs/ and regenerate every demo figure from them.

    python tools/record_demo_results.py output/runs/trees_R_26_slim_FPN_s42 ...   # add runs
    python tools/record_demo_results.py                                           # regenerate
    python tools/record_demo_results.py --into learning output/learning/*/        # learning tests
    python tools/record_demo_results.py --check     # exit 1 if a generated file is out of date

Each run directory's ``run_summary.json`` (written by every training run) is copied to
``docs/runs/<into>/<run directory name>.json`` (``--into``: ``demo``, the default, or ``learning``
for the learning tests' measurements, ``tests/helpers/learning_runs.py``). Then, from the summaries
(:mod:`aadet.analysis.demo_results`): ``docs/demo_results.json``, the generated tables of
``docs/demo_results.md``, the demo column of the model table (``docs/model_table.md``) and the
README's results table (its summary), from ``docs/runs/demo``; the learning table of
``docs/testing.md``, from ``docs/runs/learning``.
"""
import argparse
import difflib
import json
import os
import shutil
import sys

from aadet.analysis.demo_results import (
    BASELINE,
    RECIPE_CHANGES,
    build_demo_results,
    render_learning_table,
    render_results_table,
    render_variant_table,
    replace_block,
)
from aadet.analysis.model_table import MARKDOWN_COMMAND, splice_summary, update_demo_column
from aadet.utils.run_summary import SUMMARY_FILE, load_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The committed demo configs, in the order of the headline table.
DEMOS = (
    BASELINE,
    "trees_AA_R_26_slim_FPN",
    "trees_SASA_R_26_slim_FPN",
    "trees_SASA_full_attention_R_26_slim",
)
#: The demo recipe the choices below were made with and re-judged in: GN in the backbone and FPN,
#: before GN -> BN (:data:`~aadet.analysis.demo_results.RECIPE_CHANGES`); runs recorded before
#: the change are named with these overrides.
GN = " ".join(f"{key}={old}" for key, (old, _) in RECIPE_CHANGES.items())
BN = " ".join(f"{key}={new}" for key, (_, new) in RECIPE_CHANGES.items())  # as committed now
GN_BASELINE = f"{BASELINE} {GN}"
_SASA_GN_CPP = f"trees_SASA_R_26_slim_FPN {GN} MODEL.SASA.IMPL=cpp"

#: Recipe choices made on val, re-judged on test: (chosen entry, alternative entry).
CHOICES = (
    (GN_BASELINE, f"{GN_BASELINE} INPUT.SCALE_JITTER.FLIP_PROB=0.5"),
    (GN_BASELINE, f"{GN_BASELINE} INPUT.MIN_SIZE_TEST=400 INPUT.MAX_SIZE_TEST=400"),
    (GN_BASELINE, f"{GN_BASELINE} TEST.BBOX_VOTE.ENABLED=False"),
    (GN_BASELINE, f"{GN_BASELINE} TEST.BBOX_VOTE.VOTE_TH=0.6"),
    (GN_BASELINE, f"{GN_BASELINE} SOLVER.LR_SCHEDULER_NAME=WarmupCosineLR SOLVER.STEPS_EPOCHS=()"),
    (GN_BASELINE, f"{GN_BASELINE} SOLVER.IMS_PER_BATCH=8"),
    (GN_BASELINE, BASELINE),  # GN against BN: did not hold, so the demos were trained with BN ...
    (GN_BASELINE, f"{GN_BASELINE} SOLVER.OPTIMIZER=SGD SOLVER.BASE_LR=0.0025 SOLVER.WEIGHT_DECAY=0.0001"),
    # the SASA demo's zero-initialized residual blocks, on the route its runs take today (cpp)
    (_SASA_GN_CPP, f"{_SASA_GN_CPP} MODEL.RESNETS.ZERO_INIT_RESIDUAL=False"),
    # ... and each attention demo's norm, judged on its own runs: BN for AA and SASA, GN kept
    # for all attention (on the C++ kernels, the route the BN runs took; all attention's GN runs
    # predate the SASA kernel)
    (f"trees_AA_R_26_slim_FPN {GN} MODEL.AA.IMPL=cpp", "trees_AA_R_26_slim_FPN"),
    (_SASA_GN_CPP, "trees_SASA_R_26_slim_FPN"),
    ("trees_SASA_full_attention_R_26_slim", f"trees_SASA_full_attention_R_26_slim {BN}"),
)


#: The headline of the GN recipe (every demo trained before GN -> BN; the all-attention demo kept
#: it), the attention demos on the routes before and after the C++ kernels: same recipe and
#: seeds, ratios to its conv demo.
GN_HEADLINE = (
    GN_BASELINE,
    f"trees_AA_R_26_slim_FPN {GN}",
    f"trees_AA_R_26_slim_FPN {GN} MODEL.AA.IMPL=cpp",
    f"trees_SASA_R_26_slim_FPN {GN}",
    _SASA_GN_CPP,
    "trees_SASA_full_attention_R_26_slim",  # kept GN: the committed config
)

#: The broken-attention mutations of tests/helpers/broken_attention.py, the learning table's columns.
MUTATIONS = ("relative_zero", "off_by_one", "uniform")
#: Where summaries go, by ``--into``.
KINDS = ("demo", "learning")


def generated_files(runs_dir: str, repo: str):
    """``{path: new text}`` of every file generated from the summaries under ``runs_dir``."""
    results = build_demo_results(os.path.join(runs_dir, "demo"))
    out = {os.path.join(repo, "docs", "demo_results.json"): json.dumps(results, indent=1) + "\n"}
    learning_md = os.path.join(repo, "docs", "testing.md")
    if os.path.isfile(learning_md):
        learning = build_demo_results(os.path.join(runs_dir, "learning"))
        with open(learning_md) as f:
            out[learning_md] = replace_block(
                f.read(), "learning", render_learning_table(learning, MUTATIONS)
            )
    headline = render_results_table(results, DEMOS)
    demo_md, table_md = (os.path.join(repo, "docs", n) for n in ("demo_results.md", "model_table.md"))
    if os.path.isfile(demo_md):
        with open(demo_md) as f:
            text = replace_block(f.read(), "headline", headline)
        text = replace_block(text, "choices", render_variant_table(results, CHOICES))
        out[demo_md] = replace_block(text, "gn", render_results_table(results, GN_HEADLINE, GN_BASELINE))
    if os.path.isfile(table_md):
        with open(table_md) as f:
            out[table_md] = update_demo_column(f.read(), results, MARKDOWN_COMMAND)
        readme = os.path.join(repo, "README.md")
        if os.path.isfile(readme):
            with open(readme) as f:
                out[readme] = splice_summary(f.read(), out[table_md], results)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="finished OUTPUT_DIRs to add (each has run_summary.json)")
    p.add_argument("--into", choices=KINDS, default="demo", help="which docs/runs/ folder")
    p.add_argument("--runs-dir", default=os.path.join(REPO, "docs", "runs"))
    p.add_argument("--repo", default=REPO, help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if out of date")
    args = p.parse_args(argv)
    if args.check and args.runs:
        p.error("--check takes no run directories")
    for kind in KINDS:
        os.makedirs(os.path.join(args.runs_dir, kind), exist_ok=True)
    for run in args.runs:
        src = os.path.join(run, SUMMARY_FILE)
        try:
            load_summary(src)
        except (OSError, ValueError) as e:
            print(f"record_demo_results: {run}: {e}", file=sys.stderr)
            return 1
        dst = os.path.join(args.runs_dir, args.into, os.path.basename(os.path.normpath(run)) + ".json")
        shutil.copyfile(src, dst)
        print(f"{src} -> {dst}")
    try:
        files = generated_files(args.runs_dir, args.repo)
    except ValueError as e:
        print(f"record_demo_results: {e}", file=sys.stderr)
        return 1
    stale = []
    for path, text in files.items():
        old = open(path).read() if os.path.isfile(path) else ""
        if old == text:
            continue
        if args.check:
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(), path, "generated", lineterm="")
            stale.append("\n".join(list(diff)[:40]))
        else:
            with open(path, "w") as f:
                f.write(text)
            print(f"updated {path}")
    if stale:
        print("out of date (run tools/record_demo_results.py):\n" + "\n".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
