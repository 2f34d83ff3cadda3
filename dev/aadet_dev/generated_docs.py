"""Every generated block of the docs, made from the committed data: what ``dev/update_docs.py``
writes or checks (and ``dev/record_demo_results.py`` runs after adding runs).

From the run summaries under ``docs/runs/demo`` (:mod:`aadet_dev.demo_results`):
``docs/demo_results.json``, the noise and headline tables of ``docs/demo_results.md``, the demo
column of ``docs/model_table.md`` and the README's results table; from ``docs/runs/learning``: the
learning table of ``docs/testing.md``; from ``docs/benchmarks_cpu.json`` and the runs under
``docs/runs/benchmarks``: every table of ``BENCHMARKS.md`` (:data:`BENCHMARK_RUNS`) and its GPU
targets (the GPU run ``docs/benchmarks_cuda.json`` once there is one); from the COCO configs, the
model table and ``docs/benchmarks_cuda.json``: the cost tables of ``docs/reproduce_coco.md``
(:mod:`aadet_dev.cost`); from the newest GPU run record under ``docs/runs/gpu``: BENCHMARKS.md's
GPU run section and the README's GPU line (:mod:`aadet_dev.gpu_record`); from the CUDA route
table (``aadet/layers/functional/route_table_cuda.json``): BENCHMARKS.md's route table. The model table's other
columns are kept as committed, or, with ``model_table``, counted again from every config.
"""
import difflib
import json
import os
from typing import Callable, Dict

from aadet.analysis.model_stats import analyze_config, list_configs
from aadet.benchmark.report import render_model_table
from aadet.layers.functional.route_table import load_route_table

from . import cost, gpu_record
from .benchmark_tables import (
    render_layer_tables,
    render_profile_ops,
    render_profile_parts,
    spread_line,
)
from .cpu_report import render_cpu_markdown
from .route_table import render_route_table
from .gpu_report import render_benchmarks_markdown, render_targets_markdown
from .demo_results import (
    DEMOS,
    build_demo_results,
    render_headline_table,
    render_learning_table,
    render_noise_table,
    replace_block,
)
from .model_table import (
    MARKDOWN_COMMAND,
    render_markdown,
    splice_summary,
    update_demo_column,
)

__all__ = ["BENCHMARK_RUNS", "MUTATIONS", "committed_override", "generated_files", "stale_files", "write"]

#: The broken-attention mutations of tests/helpers/broken_attention.py: the learning table's columns.
MUTATIONS = ("relative_zero", "off_by_one", "uniform")


#: BENCHMARKS.md's blocks from the runs under ``docs/runs/benchmarks``: block -> (run JSON, table).
#: ``layers``, ``demo`` and ``coco`` are the runs of ``dev/benchmark_cpu.py``, which names them.
BENCHMARK_RUNS: Dict[str, tuple] = {
    "layers": ("layers_cpu.json", render_layer_tables),
    "demo": ("demo_cpu.json", render_model_table),
    "coco": ("coco_cpu.json", render_model_table),
    "layers-aa": ("layers_aa_cpu.json", render_layer_tables),
    "layers-aa20": ("layers_aa20_cpu.json", render_layer_tables),
    "layers-halo": ("layers_halo_cpu.json", render_layer_tables),
    "layers-stem": ("layers_stem_cpu.json", render_layer_tables),
    "profile": ("profile_demo_cpu.json", lambda r: render_profile_parts(r) + "\n" + render_profile_ops(r)),
}


def _gpu_record(repo: str):
    """The newest GPU run record under ``docs/runs/gpu`` (:func:`gpu_record.load_record`), or None."""
    folder = gpu_record.latest_record(os.path.join(repo, "docs", "runs", "gpu"))
    return None if folder is None else gpu_record.load_record(folder, repo)


def _benchmarks_md(text: str, repo: str, record=None) -> str:
    """BENCHMARKS.md with every generated block made anew from the committed runs (``record``: the
    GPU run record, :func:`_gpu_record`)."""
    docs = os.path.join(repo, "docs")
    with open(os.path.join(docs, "benchmarks_cpu.json")) as f:
        cpu = json.load(f)
    text = replace_block(text, "cpu", render_cpu_markdown(cpu))
    for name, (file, render) in BENCHMARK_RUNS.items():
        with open(os.path.join(docs, "runs", "benchmarks", file)) as f:
            report = json.load(f)
        body = render(report)
        if name in cpu["runs"]:
            body = f"Its `{name}` run: `{cpu['runs'][name]['command']}`\n\n" + body
        if name != "profile":
            body += "\n" + spread_line(report)
        text = replace_block(text, name, body)
    cuda_json = os.path.join(docs, "benchmarks_cuda.json")
    if os.path.isfile(cuda_json):
        with open(cuda_json) as f:
            gpu = render_benchmarks_markdown(json.load(f))
    else:
        gpu = gpu_record.render_targets_intro(record) + render_targets_markdown()
    text = replace_block(text, "gpu", gpu)
    text = replace_block(text, "route-table", render_route_table(load_route_table()))
    return replace_block(text, "gpu-run", gpu_record.render_record(record))


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


def generated_files(repo: str, model_table: bool = False) -> Dict[str, str]:
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
        rows = [analyze_config(c) for c in list_configs(os.path.join(repo, "configs"))]
        out[table_md] = render_markdown(rows, MARKDOWN_COMMAND, results)
    else:
        out[table_md] = update_demo_column(_read(table_md), results, MARKDOWN_COMMAND)
    record = _gpu_record(repo)
    readme = os.path.join(repo, "README.md")
    out[readme] = replace_block(splice_summary(_read(readme), out[table_md], results), "gpu-headline",
                                gpu_record.render_headline(record))
    bench_md = os.path.join(repo, "BENCHMARKS.md")
    out[bench_md] = _benchmarks_md(_read(bench_md), repo, record)
    coco_md, cuda_json = os.path.join(docs, "reproduce_coco.md"), os.path.join(docs, "benchmarks_cuda.json")
    bench = None
    if os.path.isfile(cuda_json):
        with open(cuda_json) as f:
            bench = json.load(f)
    coco = cost.render_block(cost.coco_configs(repo), cost.read_model_table(out[table_md]),
                             os.path.relpath(table_md, repo), bench)
    out[coco_md] = cost.replace_block(_read(coco_md), coco)
    return out


def stale_files(repo: str, model_table: bool = False) -> Dict[str, str]:
    """``{path: unified diff}`` of the generated files that differ from the committed ones."""
    stale = {}
    for path, text in generated_files(repo, model_table).items():
        old = _read(path) if os.path.isfile(path) else ""
        if old != text:
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(), path, "generated", lineterm="")
            stale[path] = "\n".join(list(diff)[:40])
    return stale


def write(repo: str, model_table: bool = False) -> None:
    """Rewrite the generated files that are out of date."""
    for path, text in generated_files(repo, model_table).items():
        if not os.path.isfile(path) or _read(path) != text:
            with open(path, "w") as f:
                f.write(text)
            print(f"updated {os.path.relpath(path, repo)}")
