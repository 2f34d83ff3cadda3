#!/usr/bin/env python
"""Regenerate every generated block of the docs from the committed data, or check them.

    python dev/update_docs.py                          # rewrite what is out of date
    python dev/update_docs.py --check                  # change nothing; exit 1 with a diff if stale
    python dev/update_docs.py --model-table [--check]  # and count every model again (minutes)

Which blocks, from which data: ``dev/aadet_dev/generated_docs.py``. The model table's columns
other than the demo results are kept as committed, or, with ``--model-table``, counted again from
every config (``make docs``). ``dev/record_demo_results.py`` adds runs and regenerates too.
"""
import argparse
import os
import sys

from aadet_dev.generated_docs import stale_files, write

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if out of date")
    p.add_argument("--model-table", action="store_true",
                   help="count every config's parameters and FLOPs again (minutes on a CPU)")
    args = p.parse_args(argv)
    try:
        if not args.check:
            write(REPO, model_table=args.model_table)
            return 0
        stale = stale_files(REPO, model_table=args.model_table)
    except ValueError as e:
        print(f"update_docs: {e}", file=sys.stderr)
        return 1
    if stale:
        print("out of date (run python dev/update_docs.py):\n" + "\n".join(stale.values()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
