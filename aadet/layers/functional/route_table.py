"""Which route ``impl="auto"`` takes on CUDA: the one measured fastest on that GPU.

The table, ``route_table_cuda.json`` beside this file, is made from a GPU run's production-shape
sweep (``dev/route_table.py docs/runs/gpu/<run>``; the sweep measures every CUDA route of a family
and the 3x3 conv beside it at every attention layer shape of the COCO configs at 640x640, batch 8,
forward + backward, in fp32 and bf16/fp16 autocast). An entry is one (family, compute
capability, precision, query count) with the forward + backward time of each route that was
finite and agreed with the float64 reference, and ``route``: the fastest of them, unless the
family's default is within the measurement's noise of it (then the default).

:func:`measured_route` answers for a call: the entries of the family, of the device's compute
capability and of the call's precision; among them the one whose query count (pixels of the
attended map) is nearest in log scale; its route, where that route can take the call
(registered, runs on CUDA, what it needs importable: :meth:`~.dispatch.Route.usable`, and for
SASA with ``recompute`` a route that can). Otherwise None, and the front end takes its stated
default (:data:`CUDA_DEFAULT_ROUTES`). A device whose capability the table lacks gets the default too: a
table measured on one GPU generation says nothing about another.
"""
import functools
import json
import math
import os
from typing import Dict, List, Optional

import torch

from .dispatch import RouteRegistry

__all__ = [
    "CUDA_DEFAULT_ROUTES",
    "ROUTE_TABLE_FILE",
    "PRECISIONS",
    "capability",
    "load_route_table",
    "measured_route",
    "precision_name",
]

#: What ``impl="auto"`` takes on CUDA where the table has no answer, per family: SDPA (one fused
#: kernel) where a family has it, else its one route. The table keeps it unless another route was
#: measured faster by more than ``dev/aadet_dev/route_table.py``'s noise margin.
CUDA_DEFAULT_ROUTES: Dict[str, str] = {"aa": "fused", "sasa": "fused", "halonet": "fused", "ccnet": "materialized"}

#: The committed table (package data).
ROUTE_TABLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "route_table_cuda.json")

#: torch dtype of the queries -> the precision's name in the sweep and the table (autocast makes
#: the attention's inputs bf16 or fp16; without it they are fp32).
PRECISIONS: Dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def precision_name(dtype: torch.dtype) -> Optional[str]:
    """``"fp32"``, ``"bf16"``, ``"fp16"``, or None (e.g. float64: no measured route)."""
    return PRECISIONS.get(dtype)


def capability(device: torch.device) -> Optional[str]:
    """A CUDA device's compute capability as the table keys it, e.g. ``"9.0"`` (H100, H200);
    None for other devices (no table: the front ends' own rules)."""
    if device.type != "cuda":
        return None
    return _cuda_capability(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=None)
def load_route_table(path: str = ROUTE_TABLE_FILE) -> Dict:
    """The table at ``path`` (read once): ``{"format", "source", "device_name", "entries": [...]}``,
    each entry ``{"family", "capability", "precision", "queries", "route", "times_ms"}``. A
    missing file is an empty table."""
    if not os.path.exists(path):
        return {"format": 1, "entries": []}
    with open(path) as f:
        return json.load(f)


def _nearest(entries: List[Dict], queries: int) -> Dict:
    """The entry whose ``queries`` is nearest ``queries`` in log scale (the smaller on a tie)."""
    target = math.log(max(queries, 1))
    return min(entries, key=lambda e: (abs(math.log(e["queries"]) - target), e["queries"]))


def _table_route(table: Dict, family: str, device_capability: str, precision: str, queries: int) -> Optional[str]:
    """The route of ``table``'s entry for the call (nearest size), or None where it has none."""
    entries = [e for e in table["entries"] if e["family"] == family and e["capability"] == device_capability
               and e["precision"] == precision]
    return _nearest(entries, queries)["route"] if entries else None


#: (id of the table, family, capability, precision, queries) -> the table's route: a layer calls
#: :func:`measured_route` every forward with the same arguments, and on a GPU where the step is
#: bound by launch overhead the lookup must cost nothing. Only for tables that live as long as the
#: process (the committed one, read once), so an id is never reused.
_LOOKUPS: Dict[tuple, Optional[str]] = {}


def measured_route(
    family: str, registry: RouteRegistry, q: torch.Tensor, queries: int, *, recompute: bool = False,
    table: Optional[Dict] = None,
) -> Optional[str]:
    """The table's route for a call of ``family`` (``"aa"``, ``"sasa"``, ``"halonet"``,
    ``"ccnet"``) with queries ``q`` on ``queries`` pixels of the attended map, or None (module
    docstring; always None off CUDA). ``table``: default the committed one (its lookups cached)."""
    precision = precision_name(q.dtype)
    device_capability = capability(q.device)
    if precision is None or device_capability is None:
        return None
    if table is None:
        table = load_route_table()
        key = (id(table), family, device_capability, precision, queries)
        if key not in _LOOKUPS:
            _LOOKUPS[key] = _table_route(table, family, device_capability, precision, queries)
        name = _LOOKUPS[key]
    else:
        name = _table_route(table, family, device_capability, precision, queries)
    if name is None:
        return None
    route = registry.get(name)
    if route is None or not route.cuda or not route.usable():
        return None
    if recompute and name not in registry.recomputing():
        return None
    return name
