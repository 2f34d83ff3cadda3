#!/usr/bin/env python
"""The CPU ratios that matter, from one command: SASA layer vs a 3x3 conv, the demo models and
the COCO R50 models vs their conv baselines, each against its target.

    OMP_NUM_THREADS=1 python dev/benchmark_cpu.py --output-json docs/benchmarks_cpu.json \\
        --runs-dir docs/runs/benchmarks

Runs ``dev/benchmark_layers.py`` and ``tools/benchmark.py`` (every case in a fresh process;
what each run measures: :data:`aadet_dev.cpu_report.CPU_RUNS`), one after the other, then
prints the targets table (:data:`~aadet_dev.cpu_report.CPU_TARGETS`) and writes the report
JSON (the layout of ``docs/benchmarks_cuda.json``) and, with ``--runs-dir``, each run's own JSON.
Run it on an otherwise idle machine: the ratios compare wall times within one run. Against a
machine whose own speed drifts, the layer run repeats its cases in rounds and the model runs
interleave their configs iteration by iteration (``--rounds``, ``--interleave``); what remains
shows as each ratio's spread in the table.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from aadet_dev.cpu_report import CPU_RUNS, benchmarks_cpu, render_cpu_markdown
from aadet.benchmark.report import write_json
from aadet.utils.collect_env import git_commit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every case (default 1)")
    p.add_argument("--output-json", metavar="FILE", help="the report (targets, rows, commands)")
    p.add_argument("--runs-dir", metavar="DIR", help="also keep each run's JSON here (<run>_cpu.json)")
    args = p.parse_args(argv)

    # the code measured: taken before the runs, whose own JSON files (--runs-dir) change the tree
    checkout = git_commit(REPO)
    reports, commands = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CPU_RUNS:
            tool, tool_args = CPU_RUNS[name]
            out = os.path.join(args.runs_dir or tmp, f"{name}_cpu.json")
            if args.runs_dir:
                os.makedirs(args.runs_dir, exist_ok=True)
            cmd = [sys.executable, os.path.join(REPO, tool), *tool_args,
                   "--threads", str(args.threads), "--output-json", out]
            commands[name] = " ".join(shlex.quote(c) for c in ["python", tool, *tool_args,
                                                                 "--threads", str(args.threads)])
            print(f"[benchmark_cpu] {commands[name]}", flush=True)
            subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                reports[name] = json.load(f)
    bench = dict(benchmarks_cpu(reports, commands), **checkout)  # + commit, dirty
    print(render_cpu_markdown(bench))
    if args.output_json:
        write_json(args.output_json, bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
