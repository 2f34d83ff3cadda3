"""The CUDA route table from a GPU run's sweep rows (``aadet/layers/functional/route_table.py``
reads it; ``dev/route_table.py`` writes it).

A sweep row (:mod:`aadet_dev.sweep`) is one (layer shape, route, precision): ``family``,
``route``, ``precision``, ``output`` ``[C, H, W]`` (the attended map: ``H W`` queries), ``ok``
(finite and within tolerance of the float64 reference) and ``time_s`` (forward + backward). The
3x3 conv rows and the stem's are not routes. For each (family, precision, query count), a route
counts only where it was ok at every shape of that class, and its time is the sum over those
shapes; ``times_ms`` every counted route's time, and the table's ``route`` the fastest, unless
the family's default (``CUDA_DEFAULT_ROUTES``) was counted and is within :data:`NOISE_MARGIN` of
it: a route is chosen over the default only on a difference larger than the timing's noise.
"""
import glob
import json
import os
from collections import defaultdict
from typing import Dict, Iterable, List, Optional

from aadet.benchmark.report import markdown_table
from aadet.layers.functional.route_table import CUDA_DEFAULT_ROUTES

from .sweep import CONV

__all__ = [
    "NOISE_MARGIN",
    "SWEEP_ROWS_GLOB",
    "build_route_table",
    "read_sweep_rows",
    "render_route_table",
    "run_capability",
]

#: The sweep's rows in a committed GPU run record (one file per loan call: first_, second_).
SWEEP_ROWS_GLOB = "*sweep.jsonl"
#: Families whose layers call no registered front end (no routes to choose).
NOT_ROUTED = ("stem",)
#: How much faster (relative) a route must be than the family's default to be chosen over it. The
#: sweep times each case once (a median of its steps); its run-to-run spread on a GPU is not
#: measured yet, and steps of a few ms vary by several percent with clocks and launch overhead.
NOISE_MARGIN = 0.10


def read_sweep_rows(run_dir: str) -> List[Dict]:
    """Every sweep row of the run record ``run_dir`` (``docs/runs/gpu/<run>``), files in name order."""
    rows = []
    for path in sorted(glob.glob(os.path.join(run_dir, SWEEP_ROWS_GLOB))):
        with open(path) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def run_capability(run_dir: str) -> Optional[str]:
    """The compute capability the run's sweep stage recorded (``env["capability"]`` of a
    ``*_stage_sweep.json``), or None where it predates that field."""
    for path in sorted(glob.glob(os.path.join(run_dir, "*stage_sweep.json"))):
        with open(path) as f:
            cap = (json.load(f).get("env") or {}).get("capability")
        if cap:
            return cap
    return None


def build_route_table(rows: Iterable[Dict], *, capability: str, device_name: str, source: str) -> Dict:
    """The table (``route_table.py``'s format) of one GPU's sweep ``rows`` (module docstring)."""
    # (family, precision, queries) -> shape key -> route -> time (s), ok rows only; None: failed
    classes: Dict[tuple, Dict[str, Dict[str, Optional[float]]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row["route"] == CONV or row["family"] in NOT_ROUTED:
            continue
        _, h, w = row["output"]
        timed = row.get("ok") and row.get("time_s") is not None
        classes[(row["family"], row["precision"], h * w)][row["key"]][row["route"]] = (
            row["time_s"] if timed else None)
    entries = []
    for (family, precision, queries), shapes in sorted(classes.items()):
        routes = set().union(*(set(r) for r in shapes.values()))
        counted = {
            route: sum(times[route] for times in shapes.values())
            for route in routes
            if all(times.get(route) is not None for times in shapes.values())
        }
        if not counted:
            continue
        route = min(counted, key=lambda r: (counted[r], r))
        default = CUDA_DEFAULT_ROUTES.get(family)
        if default in counted and counted[default] <= (1 + NOISE_MARGIN) * counted[route]:
            route = default
        entries.append({
            "family": family, "capability": capability, "precision": precision, "queries": queries,
            "shapes": len(shapes), "route": route,
            "times_ms": {r: round(t * 1e3, 3) for r, t in sorted(counted.items(), key=lambda kv: kv[1])},
        })
    return {"format": 1, "source": source, "device_name": device_name, "entries": entries}


def render_route_table(table: Dict) -> str:
    """BENCHMARKS.md's block: the table ``impl="auto"`` reads on CUDA, one row per entry."""
    if not table.get("entries"):
        return "No route table is committed: `auto` takes each family's stated default on CUDA.\n"
    runs = ", ".join(f"[{r['source']}]({r['source']}/) ({r['device_name']})" for r in table["runs"])
    rows = []
    for e in sorted(table["entries"], key=lambda e: (e["capability"], e["family"], e["precision"], e["queries"])):
        times = ", ".join(f"{r} {ms:.1f}" for r, ms in e["times_ms"].items())
        rows.append((e["family"], e["capability"], e["precision"], e["queries"], e["shapes"], f"`{e['route']}`", times))
    given = [r["capability"] for r in table["runs"] if not r["capability_recorded"]]
    command = " ".join(["python dev/route_table.py", *(r["source"] for r in table["runs"]),
                        *(["--capability", given[0]] if given else [])])
    head = (f"From {runs}: per family, compute capability, precision and attended map size (query "
            "pixels), forward + backward ms summed over the configs' layer shapes of that size at 640x640, "
            "batch 8 (one median each), for the routes that were finite and exact at all of them; `auto` "
            "takes the `auto` column's route at the nearest size (`aadet/layers/functional/route_table.py`): "
            f"the fastest, or the default where that is within {NOISE_MARGIN:.0%} of it. Made by `{command}`:\n\n")
    return head + markdown_table(
        ("family", "capability", "precision", "map (px)", "shapes", "auto", "ms by route"), rows, "lllrrll") + "\n"
