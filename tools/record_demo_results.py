#!/usr/bin/env python
"""Record demo results (the model table's "Demo AP" column) from finished training runs.

    python tools/record_demo_results.py trees_R_26_slim_FPN output/demo_s42 output/demo_s7 output/demo_s123 \\
        --note "3 seeds, 2 CPU cores, 2026-11-23"

Reads each run directory's ``metrics.json`` (its last evaluation) and ``config.yaml`` (SEED), and
writes the entry (means, AP50 spread, every run; :func:`aadet.analysis.model_table.demo_result_from_runs`)
under the config's name into ``docs/demo_results.json`` (``--file``), keeping the other entries.
Then regenerate the model table: ``python tools/analyze_model.py --all --markdown > docs/model_table.md``.
"""
import argparse
import json
import os
import sys

from aadet.analysis.model_table import demo_result_from_runs, load_demo_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config_name", help="config file name without .yaml, e.g. trees_R_26_slim_FPN")
    p.add_argument("runs", nargs="+", help="finished OUTPUT_DIRs of that config (one per seed)")
    p.add_argument("--file", default=os.path.join(REPO, "docs", "demo_results.json"))
    p.add_argument("--note", default="", help="where/when measured (machine, date)")
    args = p.parse_args(argv)
    name = os.path.splitext(os.path.basename(args.config_name))[0]
    try:
        entry = demo_result_from_runs(args.runs, args.note)
    except ValueError as e:
        print(f"record_demo_results: {e}", file=sys.stderr)
        return 1
    data = load_demo_results(args.file)
    data[name] = entry
    with open(args.file, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    runs = ", ".join(f"{r['AP50']:.1f} (seed {r['seed']})" for r in entry["runs"])
    print(f"{name}: AP50 mean {entry['AP50']:.2f} [{runs}] -> {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
