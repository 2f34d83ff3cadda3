#!/usr/bin/env python
"""Regenerate every generated block of the docs from the committed data, or check them.

    python tools/update_docs.py                          # rewrite what is out of date
    python tools/update_docs.py --check                  # change nothing; exit 1 with a diff if stale
    python tools/update_docs.py --model-table [--check]  # and count every model again (minutes)

From the run summaries under ``docs/runs/demo`` (:mod:`aadet_tools.demo_results`):
``docs/demo_results.json``, the noise and headline tables of ``docs/demo_results.md``, the demo
column of ``docs/model_table.md`` and the README's results table; from ``docs/runs/learning``: the
learning table of ``docs/testing.md``; from ``docs/benchmarks_cpu.json``: the CPU targets table of
``BENCHMARKS.md``. The model table's other columns are kept as committed, or, with ``--model-table``,
counted again from every config (``tools/analyze_model.py``; ``make docs``).
``tools/record_demo_results.py`` adds runs and calls this.
"""
import argparse
import difflib
import json
import os
import sys
from typing import Callable, Dict

from aadet_tools.cpu_report import render_cpu_markdown
from aadet_tools.demo_results import (
    DEMOS,
    build_demo_results,
    render_headline_table,
    render_learning_table,
    render_noise_table,
    replace_block,
)
from aadet_tools.model_table import (
    MARKDOWN_COMMAND,
    list_configs,
    render_markdown,
    splice_summary,
    update_demo_column,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The broken-attention mutations of tests/helpers/broken_attention.py: the learning table's columns.
MUTATIONS = ("relative_zero", "off_by_one", "uniform")


def committed_override(repo: str) -> Callable[[str, str, str], bool]:
    """``same(config_file, key, value)``: whether overriding ``key`` with ``value`` leaves the
    config file (relative to ``repo``) as it is committed (an override that changes nothing)."""
    from aadet.engine import load_config

    base: Dict[str, object] = {}

    def get(cfg, key):
        for part in key.split("."):
            cfg = cfg[part]
        return cfg

    def same(config_file: str, key: str, value: str) -> bool:
        path = os.path.join(repo, config_file)
        cpu = ["MODEL.DEVICE", "cpu"]  # no device warning: only the recipe is compared
        if path not in base:
            base[path] = load_config(path, cpu, freeze=False)
        try:
            return get(load_config(path, [*cpu, key, value], freeze=False), key) == get(base[path], key)
        except (KeyError, ValueError):
            return False

    return same


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def generated_files(repo: str = REPO, model_table: bool = False) -> Dict[str, str]:
    """``{path: text}`` of every generated file, made anew from the committed data (and with
    ``model_table``, the model table's parameters and FLOPs counted anew from the configs)."""
    docs = os.path.join(repo, "docs")
    same = committed_override(repo)
    results = build_demo_results(os.path.join(docs, "runs", "demo"), same)
    out = {os.path.join(docs, "demo_results.json"): json.dumps(results, indent=1) + "\n"}
    demo_md = os.path.join(docs, "demo_results.md")
    text = replace_block(_read(demo_md), "noise", render_noise_table(results))
    out[demo_md] = replace_block(text, "headline", render_headline_table(results, DEMOS))
    testing_md = os.path.join(docs, "testing.md")
    learning = build_demo_results(os.path.join(docs, "runs", "learning"), same)
    out[testing_md] = replace_block(_read(testing_md), "learning", render_learning_table(learning, MUTATIONS))
    table_md = os.path.join(docs, "model_table.md")
    if model_table:
        import analyze_model

        rows = [analyze_model.analyze_config(c, demo_results=results)
                for c in list_configs(os.path.join(repo, "configs"))]
        out[table_md] = render_markdown(rows, MARKDOWN_COMMAND)
    else:
        out[table_md] = update_demo_column(_read(table_md), results, MARKDOWN_COMMAND)
    readme = os.path.join(repo, "README.md")
    out[readme] = splice_summary(_read(readme), out[table_md], results)
    bench_md, bench_json = os.path.join(repo, "BENCHMARKS.md"), os.path.join(docs, "benchmarks_cpu.json")
    with open(bench_json) as f:
        out[bench_md] = replace_block(_read(bench_md), "cpu", render_cpu_markdown(json.load(f)))
    return out


def stale_files(repo: str = REPO, model_table: bool = False) -> Dict[str, str]:
    """``{path: unified diff}`` of the generated files that differ from the committed ones."""
    stale = {}
    for path, text in generated_files(repo, model_table).items():
        old = _read(path) if os.path.isfile(path) else ""
        if old != text:
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(), path, "generated", lineterm="")
            stale[path] = "\n".join(list(diff)[:40])
    return stale


def write(repo: str = REPO, model_table: bool = False) -> None:
    """Rewrite the generated files that are out of date."""
    for path, text in generated_files(repo, model_table).items():
        if not os.path.isfile(path) or _read(path) != text:
            with open(path, "w") as f:
                f.write(text)
            print(f"updated {os.path.relpath(path, repo)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if out of date")
    p.add_argument("--model-table", action="store_true",
                   help="count every config's parameters and FLOPs again (minutes on a CPU)")
    args = p.parse_args(argv)
    try:
        if not args.check:
            write(model_table=args.model_table)
            return 0
        stale = stale_files(model_table=args.model_table)
    except ValueError as e:
        print(f"update_docs: {e}", file=sys.stderr)
        return 1
    if stale:
        print("out of date (run python tools/update_docs.py):\n" + "\n".join(stale.values()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
