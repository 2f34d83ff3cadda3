"""The benchmark report shared by ``tools/benchmark.py`` and ``dev/benchmark_layers.py``:
ratios to a reference result, markdown, JSON.

A benchmark run is a JSON-able ``report`` dict: the run's settings, ``"env"``
(:func:`aadet.benchmark.timing.environment_info`) and ``"results"``, one dict per case (a failed
case carries ``"error"``, a case not run ``"skipped"``). Each tool says which results are compared
with which (the conv baseline config; the naive layer) and which numbers; this module does the rest:

* :func:`ratios` -- ``result / reference`` for named (dotted) metric paths, ``None`` where the
  reference is zero or a value is missing, a metric left out where either has no such section;
* :func:`index_results` -- the successful results by a key, to find references;
* :func:`header_line`, :func:`markdown_table`, :func:`fmt`, :func:`mib` -- the markdown;
* :func:`render_model_table` -- ``tools/benchmark.py``'s table;
* :func:`write_report` -- JSON (``--output-json``) and markdown (``--output-md``, else stdout),
  exit status 1 when a case failed.
"""

import json
import os
import sys
from typing import Callable, Dict, Hashable, Iterable, Mapping, Optional, Sequence

from .timing import report_peak_memory

__all__ = [
    "MISSING",
    "ratio",
    "ratios",
    "index_results",
    "fmt",
    "mib",
    "header_line",
    "markdown_table",
    "write_json",
    "write_report",
    "render_model_table",
]

#: What a table cell shows for a number that was not measured or has no reference.
MISSING = "–"


def ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    """``value / reference``, or None when either is None or the reference is 0."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


_ABSENT = object()


def _lookup(d: Mapping, path: str):
    for part in path.split("."):
        if not isinstance(d, Mapping) or part not in d:
            return _ABSENT
        d = d[part]
    return d


def ratios(
    result: Mapping, reference: Mapping, metrics: Mapping[str, str]
) -> Dict[str, Optional[float]]:
    """``{name: result[path] / reference[path]}`` for ``name, path`` in ``metrics``.

    A path is dotted (``"train.median_s"``). A metric whose section or key is absent from either
    dict is left out (e.g. no ``"train"`` when the run skipped training); a present value of None
    or a zero reference gives None (:func:`ratio`).
    """
    out = {}
    for name, path in metrics.items():
        a, b = _lookup(result, path), _lookup(reference, path)
        if a is _ABSENT or b is _ABSENT:
            continue
        out[name] = ratio(a, b)
    return out


def index_results(
    results: Iterable[Mapping], key: Callable[[Mapping], Hashable]
) -> Dict[Hashable, Mapping]:
    """The results that ran (no ``"error"``, no ``"skipped"``) by ``key(result)``; a repeated
    key is an error (a reference must be unique)."""
    out: Dict[Hashable, Mapping] = {}
    for r in results:
        if "error" in r or "skipped" in r:
            continue
        k = key(r)
        if k in out:
            raise ValueError(f"two benchmark results share the key {k!r}")
        out[k] = r
    return out


def fmt(x: Optional[float], spec: str, scale: float = 1.0) -> str:
    """``format(x * scale, spec)``, or :data:`MISSING` for None."""
    return MISSING if x is None else format(x * scale, spec)


def mib(num_bytes: Optional[float]) -> Optional[float]:
    """Bytes in MiB (None stays None)."""
    return None if num_bytes is None else num_bytes / 2**20


def header_line(report: Mapping, peak_memory: str) -> str:
    """``"Device: <name> (<device>), torch <v>, <n> thread(s)"`` + the AMP mode and what peak
    memory means (``peak_memory``, :func:`aadet.benchmark.timing.peak_memory_meaning`)."""
    env = report["env"]
    amp = f"; AMP autocasts to {report['amp_dtype']}" if report.get("amp_dtype") else ""
    return (
        f"Device: {env['device_name']} ({report['device']}), torch {env['torch']}, "
        f"{env['torch_threads']} thread(s){amp}; peak memory: {peak_memory}"
    )


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], align: Optional[str] = None
) -> str:
    """A GitHub markdown table; ``align`` one char per column, ``l`` or ``r`` (default: l then r)."""
    align = align or ("l" + "r" * (len(headers) - 1))
    if len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one of 'l'/'r' per column ({len(headers)}); got {align!r}")
    sep = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(sep) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, table has {len(headers)} columns: {row}")
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out) + "\n"


def write_json(path: str, obj) -> None:
    """Write ``obj`` as indented JSON, atomically (temp file + rename)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def write_report(report: Mapping, markdown: str, output_json: str = "", output_md: str = "") -> int:
    """Write a benchmark report as JSON and markdown (markdown to stdout without ``output_md``).

    Returns the exit status: 1 if any result carries an ``"error"``, else 0.
    """
    if output_json:
        write_json(output_json, report)
    if output_md:
        os.makedirs(os.path.dirname(os.path.abspath(output_md)), exist_ok=True)
        with open(output_md, "w") as f:
            f.write(markdown)
    else:
        sys.stdout.write(markdown)
    return 1 if any("error" in r for r in report.get("results", [])) else 0


def _amp_cell(r) -> str:
    return r.get("amp_dtype", "on") if r["amp"] else "off"


def render_model_table(report: dict) -> str:
    """``tools/benchmark.py``'s report as a markdown table (times in ms, memory in MiB, ratios to the
    baseline)."""
    cpu = report["device"].startswith("cpu")
    headers = [
        "Config",
        "AMP",
        "Params (M)",
        "Train ms/iter",
        "× base",
        "img/s",
        "Train peak MiB",
        "× base",
        "Infer ms/batch",
        "× base",
        "Infer peak MiB",
        "× base",
    ]
    if cpu:  # process CPU time: steadier than wall time on a shared machine
        headers[5:5] = ["Train CPU ms", "× base"]
        headers += ["Infer CPU ms", "× base"]
    rows = []
    for r in report["results"]:
        name = os.path.splitext(os.path.basename(r["config"]))[0]
        if "error" in r:
            rows.append(
                [f"`{name}`", _amp_cell(r), "error: " + r["error"][:80]]
                + [""] * (len(headers) - 3)
            )
            continue
        tr, inf, rt = r.get("train", {}), r.get("inference", {}), r.get("ratios", {})
        row = [
            f"`{name}`",
            _amp_cell(r),
            fmt(r["params"], ".2f", 1e-6),
            fmt(tr.get("median_s"), ".1f", 1e3),
            fmt(rt.get("train_time"), ".2f") + _range(r, "train_time"),
            fmt(tr.get("images_per_s"), ".2f"),
            fmt(mib(tr.get("peak_bytes")), ".0f"),
            fmt(rt.get("train_peak_mem"), ".2f"),
            fmt(inf.get("median_s"), ".1f", 1e3),
            fmt(rt.get("inference_time"), ".2f"),
            fmt(mib(inf.get("peak_bytes")), ".0f"),
            fmt(rt.get("inference_peak_mem"), ".2f"),
        ]
        if cpu:
            row[5:5] = [
                fmt(tr.get("cpu_median_s"), ".1f", 1e3),
                fmt(rt.get("train_cpu_time"), ".2f"),
            ]
            row += [
                fmt(inf.get("cpu_median_s"), ".1f", 1e3),
                fmt(rt.get("inference_cpu_time"), ".2f"),
            ]
        rows.append(row)
    rounds = report.get("rounds", 1)
    median = (f"median of {report['iters']} iterations after {report['warmup']} warm-up" if rounds == 1 else
              f"{rounds} rounds over the configs in turn, each case in each round {report['iters']} "
              f"iterations after {report['warmup']} warm-up; the median of the rounds' medians, the "
              "train-time ratio's range over the rounds in brackets")
    if report.get("interleave"):
        median += (" (the configs' processes taking turns iteration by iteration; the train-time "
                   "ratio is the median, in brackets the interquartile range, of each iteration's "
                   "time over the baseline's of the same turn)")
    head = (
        header_line(report, report_peak_memory(report))
        + f". Input {report['size'][0]}x{report['size'][1]}, batch {report['batch']}, {median}; baseline "
        f"`{os.path.splitext(os.path.basename(report['baseline']))[0]}`.\n\n"
    )
    return head + markdown_table(headers, rows, align="ll" + "r" * (len(headers) - 2))


def _range(result: dict, metric: str) -> str:
    """`` (lo-hi)``: the ratio's spread (over the rounds, or the interleaved pairs' interquartile
    range), else ``""``."""
    lo_hi = result.get("ratio_ranges", {}).get(metric)
    return "" if not lo_hi else " ({:.2f}-{:.2f})".format(*lo_hi)
