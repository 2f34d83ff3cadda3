"""The model table of the docs (params, FLOPs, the papers' numbers, demo results):
``docs/model_table.md``, and the README's summary of it.

One row per config (:class:`aadet.analysis.model_stats.ModelStats`, what ``tools/analyze_model.py``
prints): parameters (total; bottom-up / FPN / head), FLOPs at ``size x size`` (the
papers' FLOPs, 2 per multiply-add, and the attention share; convention in
:mod:`aadet.analysis.flops`), the paper's params / GFLOPs / COCO mAP with our difference, and the
AP50 measured on the demo data's val and test splits where runs are recorded
(``docs/demo_results.json``, see :func:`load_demo_results`).

The rendered table sits between :data:`TABLE_BEGIN` and :data:`TABLE_END` so that a test can
compare it with a fresh count (:func:`parse_markdown`). The README shows a summary of it
(:func:`render_summary`: params, FLOPs, the paper's mAP, demo AP50 with its spread over seeds),
between :data:`SUMMARY_BEGIN` and :data:`SUMMARY_END`; ``dev/update_docs.py`` regenerates it.
"""

import json
import os
from typing import Dict, Optional, Sequence

from aadet.analysis.model_stats import ModelStats

from .demo_results import TEST, VAL, stats_cell

__all__ = [
    "MARKDOWN_COMMAND",
    "TABLE_BEGIN",
    "TABLE_END",
    "COLUMNS",
    "DEMO_COLUMN",
    "FLOP_COLUMNS",
    "row_cells",
    "render_markdown",
    "parse_markdown",
    "load_demo_results",
    "demo_cell",
    "update_demo_column",
    "SUMMARY_BEGIN",
    "SUMMARY_END",
    "SUMMARY_COMMAND",
    "render_summary",
    "splice_summary",
]

#: The command that writes the table, named in the table itself (``make docs``).
MARKDOWN_COMMAND = "python dev/update_docs.py --model-table"
TABLE_BEGIN = "<!-- model-table:begin -->"
TABLE_END = "<!-- model-table:end -->"
SUMMARY_BEGIN = "<!-- model-summary:begin -->"
SUMMARY_END = "<!-- model-summary:end -->"
#: The command that writes the README's summary (``make docs`` runs it after the table).
SUMMARY_COMMAND = "python dev/update_docs.py"

COLUMNS = (
    "Config",
    "Input",
    "Params (M)",
    "Backbone / FPN / head (M)",
    "GFLOPs",
    "Attention GFLOPs",
    "Paper params (M)",
    "Δ params (M)",
    "Paper GFLOPs",
    "Δ GFLOPs",
    "Paper COCO mAP",
    "Demo AP50: val (test)",
)
#: The column filled from ``docs/demo_results.json``.
DEMO_COLUMN = COLUMNS[-1]
#: Columns that need a FLOP count (empty, or without the padded size, when a row was analyzed
#: with ``flops=False``).
FLOP_COLUMNS = frozenset({"Input", "GFLOPs", "Attention GFLOPs", "Δ GFLOPs"})
_NA = "–"


def _size_cell(row: ModelStats) -> str:
    def fmt(h, w):
        return f"{h}" if h == w else f"{h}x{w}"

    cell = fmt(*row.size)
    if row.flops is not None and (row.flops["padded_h"], row.flops["padded_w"]) != tuple(row.size):
        cell += f" (pad {fmt(row.flops['padded_h'], row.flops['padded_w'])})"
    return cell


def _m(n: Optional[float]) -> str:
    return _NA if n is None else f"{n / 1e6:.2f}"


def _delta(ours: float, paper: Optional[float], digits: int) -> str:
    if paper is None:
        return _NA
    d = ours - paper
    return f"{d:+.{digits}f} ({100 * d / paper:+.1f}%)"


def row_cells(row: ModelStats, demo: Optional[Dict[str, object]] = None) -> Dict[str, str]:
    """The row's cells by column name (FLOP columns empty when FLOPs were not counted); ``demo``:
    the config's entry of ``docs/demo_results.json``."""
    p, paper = row.params, row.paper
    cells = {
        "Config": f"`{row.config}`",
        "Input": _size_cell(row),
        "Params (M)": _m(p["total"]),
        "Backbone / FPN / head (M)": f"{_m(p['backbone'])} / {_m(p['fpn'])} / {_m(p['head'])}",
        "Paper params (M)": (
            _NA if paper is None or paper.params_m is None else f"{paper.params_m:.1f}"
        ),
        "Δ params (M)": _delta(p["total"] / 1e6, paper.params_m if paper else None, 2),
        "Paper GFLOPs": _NA if paper is None or paper.gflops is None else f"{paper.gflops:g}",
        "Paper COCO mAP": _NA if paper is None or paper.map is None else f"{paper.map:.1f}",
        DEMO_COLUMN: demo_cell(demo),
    }
    if row.flops is None:
        cells.update({c: "" for c in FLOP_COLUMNS if c != "Input"})
    else:
        g = 2 * row.flops["total"] / 1e9
        cells["GFLOPs"] = f"{g:.1f}"
        cells["Attention GFLOPs"] = f"{2 * row.flops['attention'] / 1e9:.2f}"
        cells["Δ GFLOPs"] = _delta(g, paper.gflops if paper else None, 1)
    return cells


def demo_cell(demo: Optional[Dict[str, object]]) -> str:
    """The demo column's cell of a ``docs/demo_results.json`` entry: val AP50 (test AP50)."""
    if demo is None:
        return _NA
    val, test = (demo.get(split, {}).get("AP50", {}).get("mean") for split in (VAL, TEST))
    if test is None and val is None:
        return _NA
    return (f"{val:.1f}" if val is not None else _NA) + (f" ({test:.1f})" if test is not None else "")


def update_demo_column(text: str, demo_results: Dict[str, Dict[str, object]], command: str) -> str:
    """``text`` (a file holding the rendered table) with the table's preamble and demo column
    made anew from ``demo_results``, every other cell kept: what :func:`render_markdown` would
    give with these results, without building and counting every model again."""
    begin = text.index(TABLE_BEGIN)
    end = text.index(TABLE_END) + len(TABLE_END)
    block = text[begin:end]
    header_at = block.index("| Config |")
    lines = block[header_at:].splitlines()
    col = COLUMNS.index(DEMO_COLUMN)
    out = []
    for i, ln in enumerate(lines):
        if i == 0:
            ln = "| " + " | ".join(COLUMNS) + " |"
        elif i >= 2 and ln.startswith("|"):
            cells = [c.strip() for c in ln.strip().strip("|").split("|")]
            name = os.path.basename(cells[0].strip("`"))
            cells[col] = demo_cell(demo_results.get(name))
            ln = "| " + " | ".join(cells) + " |"
        out.append(ln)
    preamble = render_markdown([], command)[: render_markdown([], command).index("| Config |")]
    return text[:begin] + preamble + "\n".join(out) + text[end:]


def render_markdown(
    rows: Sequence[ModelStats], command: str, demo_results: Optional[Dict[str, Dict[str, object]]] = None
) -> str:
    """The table between the markers, with the command that made it and its conventions; the demo
    column from ``demo_results`` (by config name)."""
    lines = [
        TABLE_BEGIN,
        f"<!-- generated by `{command}`; do not edit by hand -->",
        "",
        "FLOPs at a square input of the side in the Input column (each config's test size: 640 for",
        "COCO, the papers' size; 448 for the demo, a multiple of 32). GFLOPs are the",
        "papers' (2 per multiply-add) of the network from the normalized image to the head outputs:",
        "convolutions, linear layers and attention (each query against all keys for AA, against its",
        "k x k neighbours for SASA; implementation overhead such as halo windows not counted); norms,",
        "pooling, softmax and post-processing not counted (`aadet/analysis/flops.py`). Paper numbers:",
        "AA Table 4/7, SASA Table 2 (RetinaNet from scratch on COCO). Δ = ours - paper.",
        "Demo AP50: COCO box AP at IoU 0.5 on the tree-crown demo's val split, where the recipe was",
        "chosen (test, another site, in brackets), mean over the seeds in `docs/runs/demo` (`docs/demo_results.md`).",
        "",
    ]
    header = "| " + " | ".join(COLUMNS) + " |"
    demo = demo_results or {}
    body = ["| " + " | ".join(row_cells(r, demo.get(os.path.basename(r.config)))[c] for c in COLUMNS) + " |"
            for r in rows]
    sep = "|" + "|".join([":---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"
    lines += [header, sep, *body, "", TABLE_END]
    return "\n".join(lines) + "\n"


def parse_markdown(text: str) -> Dict[str, Dict[str, str]]:
    """Cells by config key and column name, from the table between the markers of ``text``.

    Raises:
        ValueError: when the markers or the header are missing.
    """
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise ValueError(f"no model table: expected lines {TABLE_BEGIN!r} ... {TABLE_END!r}")
    block = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    rows = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("|")]
    if not rows:
        raise ValueError("model table between the markers has no rows")
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    if tuple(header) != COLUMNS:
        raise ValueError(
            f"model table header {header} differs from the tool's columns {list(COLUMNS)}"
        )
    out = {}
    for ln in rows[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        d = dict(zip(header, cells))
        out[d["Config"].strip("`")] = d
    return out


def load_demo_results(path: str) -> Dict[str, Dict[str, float]]:
    """Demo-data results by entry name (``docs/demo_results.json``, written by
    ``dev/update_docs.py``; :func:`aadet_dev.demo_results.build_demo_results`):
    ``{"trees_R_26_slim_FPN": {"AP": 14.2, "AP50": 47.3, "trees_test": {...}, ...}}``.

    A missing file means no results yet.
    Raises ValueError when an entry has no numeric ``"AP"``.
    """
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: expected a JSON object config name -> {{'AP': ...}}; got {type(data).__name__}"
        )
    for name, entry in data.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("AP"), (int, float)):
            raise ValueError(
                f"{path}: entry {name!r} needs a numeric 'AP' (box AP in %); got {entry!r}"
            )
    return data


def render_summary(table_text: str, demo_results: Dict[str, Dict[str, object]]) -> str:
    """The README's results table, between :data:`SUMMARY_BEGIN` / :data:`SUMMARY_END`: per
    config of the model table in ``table_text`` (``docs/model_table.md``), params, GFLOPs and the
    paper's COCO mAP, and from ``demo_results`` (``docs/demo_results.json``) the demo's val and
    test AP50 as mean (min–max) over its seeds."""
    rows = parse_markdown(table_text)
    lines = [
        SUMMARY_BEGIN,
        f"<!-- generated from docs/model_table.md and docs/demo_results.json by `{SUMMARY_COMMAND}`; "
        "do not edit by hand -->",
        "| Config | Params (M) | GFLOPs | Paper COCO mAP | Demo seeds | Demo AP50 val | Demo AP50 test |",
        "|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, cells in rows.items():
        demo = demo_results.get(os.path.basename(key)) or {}
        test, val = demo.get(TEST, {}), demo.get(VAL, {})
        lines.append(
            f"| `{key}` | {cells['Params (M)']} | {cells['GFLOPs']} | {cells['Paper COCO mAP']} "
            f"| {len(demo.get('seeds', [])) or _NA} | {stats_cell(val.get('AP50'), val.get('n', 0))} "
            f"| {stats_cell(test.get('AP50'), test.get('n', 0))} |"
        )
    lines.append(SUMMARY_END)
    return "\n".join(lines)


def splice_summary(readme: str, table_text: str, demo_results: Dict[str, Dict[str, object]]) -> str:
    """``readme`` with its summary block made anew (:func:`render_summary`).

    Raises:
        ValueError: when the README lacks the markers.
    """
    if readme.count(SUMMARY_BEGIN) != 1 or readme.count(SUMMARY_END) != 1:
        raise ValueError(f"expected one {SUMMARY_BEGIN!r} ... {SUMMARY_END!r} block in the README")
    head, rest = readme.split(SUMMARY_BEGIN, 1)
    tail = rest.split(SUMMARY_END, 1)[1]
    return head + render_summary(table_text, demo_results) + tail
