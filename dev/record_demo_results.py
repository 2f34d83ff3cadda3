#!/usr/bin/env python
"""Record finished demo runs under docs/runs/ and regenerate every demo figure from them.

    python dev/record_demo_results.py output/runs/trees_R_26_slim_FPN_s42 ...   # add runs
    python dev/record_demo_results.py --into learning output/learning/*/        # learning tests

Each run directory's ``run_summary.json`` (written by every training run) is copied to
``docs/runs/<into>/<run directory name>.json`` (``--into``: ``demo``, the default, or ``learning``
for the learning tests' measurements, ``tests/helpers/learning_runs.py``); then the docs' tables
are regenerated from all of them, as ``dev/update_docs.py`` does.
"""
import argparse
import os
import shutil
import sys

from aadet_dev.generated_docs import write
from aadet.engine.run_summary import SUMMARY_FILE, load_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Where summaries go, by ``--into``.
KINDS = ("demo", "learning")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="finished OUTPUT_DIRs to add (each has run_summary.json)")
    p.add_argument("--into", choices=KINDS, default="demo", help="which docs/runs/ folder")
    args = p.parse_args(argv)
    for run in args.runs:
        src = os.path.join(run, SUMMARY_FILE)
        try:
            summary = load_summary(src)
        except (OSError, ValueError) as e:
            print(f"record_demo_results: {run}: {e}", file=sys.stderr)
            return 1
        if os.path.isabs(summary["config_file"]):  # the config lay outside the aadet checkout that ran
            print(f"record_demo_results: {run}: config_file {summary['config_file']} is outside the checkout "
                  "whose aadet ran (a second worktree with aadet imported from another: set PYTHONPATH to "
                  "the worktree); a record names a config of this repository", file=sys.stderr)
            return 1
        dst = os.path.join(REPO, "docs", "runs", args.into,
                           os.path.basename(os.path.normpath(run)) + ".json")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        print(f"{src} -> {dst}")
    try:
        write(REPO)
    except ValueError as e:
        print(f"record_demo_results: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
