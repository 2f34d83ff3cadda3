"""The benchmark report shared by ``tools/benchmark.py`` and ``tools/benchmark_layers.py``:
ratios to a reference result, markdown, JSON.

A benchmark run is a JSON-able ``report`` dict: the run's settings, ``"env"``
(:func:`aadet_tools.timing.environment_info`) and ``"results"``, one dict per case (a failed
case carries ``"error"``, a case not run ``"skipped"``). Each tool says which results are compared
with which (the conv baseline config; the naive layer) and which numbers; this module does the rest:

* :func:`ratios` -- ``result / reference`` for named (dotted) metric paths, ``None`` where the
  reference is zero or a value is missing, a metric left out where either has no such section;
* :func:`index_results` -- the successful results by a key, to find references;
* :func:`header_line`, :func:`markdown_table`, :func:`fmt`, :func:`mib` -- the markdown;
* :func:`write_report` -- JSON (``--output-json``) and markdown (``--output-md``, else stdout),
  exit status 1 when a case failed.
"""

import json
import os
import sys
from typing import Callable, Dict, Hashable, Iterable, Mapping, Optional, Sequence

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
    memory means (``peak_memory``, :func:`aadet_tools.timing.peak_memory_meaning`)."""
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
