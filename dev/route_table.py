#!/usr/bin/env python
"""Write the CUDA route table that ``impl="auto"`` reads (aadet/layers/functional/route_table.py)
from committed GPU runs' production-shape sweeps, one run per GPU generation:

    python dev/route_table.py docs/runs/gpu/3a55981-h200 --capability 9.0

``--capability`` only for a run whose sweep did not record it (runs before it did); the table
then names the run, its GPU and the capability given. ``--check``: the committed table is what
these runs give (the table's own rules: ``dev/aadet_dev/route_table.py``).
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from aadet_dev.route_table import build_route_table, read_sweep_rows, run_capability  # noqa: E402
from aadet.layers.functional.route_table import ROUTE_TABLE_FILE  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _device_name(run_dir: str) -> str:
    for path in sorted(glob.glob(os.path.join(run_dir, "*stage_sweep.json"))):
        with open(path) as f:
            name = (json.load(f).get("env") or {}).get("device_name")
        if name:
            return name
    raise SystemExit(f"route_table: {run_dir} has no *stage_sweep.json with env.device_name")


def table_for(runs, capability=None) -> dict:
    """The table of ``runs`` (run directories), one per compute capability."""
    tables, runs_made = [], []
    for run in runs:
        recorded = run_capability(run)
        cap = recorded or capability
        if cap is None:
            raise SystemExit(f"route_table: {run} did not record its GPU's compute capability; "
                             "give --capability (e.g. 9.0 for H100/H200)")
        rows = read_sweep_rows(run)
        if not rows:
            raise SystemExit(f"route_table: {run} has no sweep rows (*sweep.jsonl)")
        source = os.path.relpath(os.path.abspath(run), REPO)
        tables.append(build_route_table(rows, capability=cap, device_name=_device_name(run), source=source))
        runs_made.append({"source": source, "device_name": tables[-1]["device_name"], "capability": cap,
                          "capability_recorded": recorded is not None})
    caps = [t["entries"][0]["capability"] for t in tables if t["entries"]]
    if len(set(caps)) != len(caps):
        raise SystemExit(f"route_table: one run per compute capability; got {caps}")
    return {"format": 1, "runs": runs_made, "entries": [e for t in tables for e in t["entries"]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="GPU run records (docs/runs/gpu/<run>), one per compute capability")
    p.add_argument("--capability", help="compute capability of a run that did not record it, e.g. 9.0")
    p.add_argument("--output", default=ROUTE_TABLE_FILE)
    p.add_argument("--check", action="store_true", help="fail if --output differs from what the runs give")
    args = p.parse_args(argv)
    text = json.dumps(table_for(args.runs, args.capability), indent=1) + "\n"
    if args.check:
        with open(args.output) as f:
            if f.read() != text:
                print(f"route_table: {args.output} is not what {args.runs} give; rerun without --check",
                      file=sys.stderr)
                return 1
        return 0
    with open(args.output, "w") as f:
        f.write(text)
    print(f"route_table: {args.output}: {len(json.loads(text)['entries'])} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
