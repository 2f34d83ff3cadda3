"""Constants of the attention routes made once per map size: the key grid's index above all.

AA's logit tables (:func:`~.relative_attention.relative_logit_tables_2d`) are keyed by the row
``j // W`` and the column ``j % W`` of every key ``j`` (SASA's blocked routes, by the row and the
column of a halo window's key). Those two ``[H W]`` index tensors depend only on ``(H, W)`` and
the device, so :func:`grid_key_index` makes them once and hands out the same tensors afterwards;
:func:`grid_of` recognizes them by identity. That keeps a layer's call free of work that is the
same every time, which on a GPU costs host time per launch and, where a route had to *read* an
index to learn its layout (``torch.equal`` on a CUDA tensor), a host-device synchronization per
call:

* the row/column kernels (Triton, C++) learn ``(H, W)`` without comparing the index's contents
  (:func:`row_col_tables_from_index`);
* the SDPA route takes its cached key-side indicators (:func:`grid_indicators`) instead of
  building one-hot matrices each call;
* other such constants (SASA's window masks) go through :func:`cached_constant`.

An index that is not one of these tensors (any caller of the public functions) is read as before.
While tracing, exporting or compiling, nothing is cached (the tensors are made in the graph).
"""
import threading
from collections import OrderedDict
from typing import Callable, Dict, Optional, Sequence, Tuple, TypeVar

import torch

from .dispatch import is_exporting

T = TypeVar("T")

__all__ = ["cached_constant", "grid_indicators", "grid_key_index", "grid_of", "row_col_tables_from_index"]

#: Most bytes of tensors kept per process. Training at a fixed crop needs a few constants per
#: attention map size (well under 1 MiB at 640x640); evaluation at varying image sizes makes new
#: ones per size, and the least recently used go first (a rebuild costs what every call cost before
#: the cache, never a wrong value).
MAX_CACHED_BYTES = 64 * 2 ** 20

_CONSTANTS: "OrderedDict[tuple, Tuple[object, int]]" = OrderedDict()  # key -> (value, its bytes)
_GRID_OF: Dict[int, Tuple[int, int, str]] = {}  # id of a cached index tensor -> (H, W, "row" | "col")
_LOCK = threading.RLock()  # re-entrant: a constant's make() may ask for another (the indicators, the index)


def _caching() -> bool:
    return not (is_exporting() or torch.compiler.is_compiling())


def _tensors(value) -> list:
    return [value] if isinstance(value, torch.Tensor) else [t for t in value if isinstance(t, torch.Tensor)]


def cached_constant(key: tuple, make: Callable[[], T]) -> T:
    """``make()``, made once per ``key`` and handed out again afterwards (read-only: never write
    into it): a tensor (or a tuple of them) that depends only on ``key`` (sizes, dtype, device),
    never on a call's data. ``key`` starts with the name of what it makes. Made outside inference
    mode (an evaluation's constant serves the training after it). Not cached while tracing,
    exporting or compiling (the tensors are made in the graph)."""
    if not _caching():
        return make()
    with _LOCK:  # threads serving one model (a predictor per thread) share the cache
        hit = _CONSTANTS.get(key)
        if hit is not None:
            _CONSTANTS.move_to_end(key)
            return hit[0]
        with torch.inference_mode(False):  # a tensor made in inference mode could never be saved for backward
            value = make()
        _CONSTANTS[key] = (value, sum(t.numel() * t.element_size() for t in _tensors(value)))
        while len(_CONSTANTS) > 1 and sum(size for _, size in _CONSTANTS.values()) > MAX_CACHED_BYTES:
            old, _ = _CONSTANTS.popitem(last=False)[1]
            for t in _tensors(old):
                _GRID_OF.pop(id(t), None)
        return value


def _make_index(h: int, w: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(h * w, device=device)
    index = pos // w, pos % w
    if _caching():
        _GRID_OF[id(index[0])] = (h, w, "row")
        _GRID_OF[id(index[1])] = (h, w, "col")
    return index


def grid_key_index(h: int, w: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)``: ``[H W]`` long tensors ``j // W`` and ``j % W`` on ``device``, the same
    tensors for every call with the same ``(h, w, device)`` (read-only: never write into them)."""
    return cached_constant(("grid_key_index", h, w, torch.device(device)), lambda: _make_index(h, w, device))


def _cached_role(index: torch.Tensor) -> Optional[Tuple[int, int, str]]:
    role = _GRID_OF.get(id(index))
    if role is None:
        return None
    rows, cols = _CONSTANTS.get(("grid_key_index", role[0], role[1], index.device), ((None, None), 0))[0]
    return role if index is (rows if role[2] == "row" else cols) else None


def grid_of(key_index: Sequence[torch.Tensor]) -> Optional[Tuple[int, int, Tuple[str, ...]]]:
    """``(H, W, roles)`` where every tensor of ``key_index`` is an index :func:`grid_key_index`
    handed out for one ``H x W`` grid (``roles``: ``"row"`` / ``"col"`` of each, in order), else
    None (then only reading the index tells its layout)."""
    if not _caching():  # nothing is cached then (and a traced tensor has no lasting identity)
        return None
    roles = [_cached_role(idx) for idx in key_index]
    if not roles or any(r is None for r in roles) or len({r[:2] for r in roles}) != 1:
        return None
    return roles[0][0], roles[0][1], tuple(r[2] for r in roles)


def grid_indicators(h: int, w: int, roles: Sequence[str], dtype: torch.dtype, device) -> torch.Tensor:
    """``[H W, sum M]`` key-side indicators of the SDPA route for a grid's ``roles``: one-hot rows
    of ``j // W`` (``M = H``) for ``"row"``, of ``j % W`` (``M = W``) for ``"col"``,
    concatenated; cached like the index (read-only)."""
    def make():
        rows, cols = grid_key_index(h, w, device)
        parts = [torch.nn.functional.one_hot(rows if r == "row" else cols, h if r == "row" else w) for r in roles]
        return torch.cat(parts, dim=-1).to(dtype)

    return cached_constant(("grid_indicators", h, w, tuple(roles), dtype, torch.device(device)), make)


def row_col_tables_from_index(
    tables: Sequence[torch.Tensor], key_index: Sequence[torch.Tensor], length: int
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], int]:
    """Read ``attention_with_logit_tables``'s ``(tables, key_index)`` as a row-major 2D grid.

    The 2D case of AA is ``tables = [T_row, T_col]`` with ``key_index = [j // W, j % W]``
    (either may be missing, as from ``relative_logit_tables_2d`` with a ``None`` embedding).
    Returns ``(t_row, t_col, width)``; raises ``ValueError`` for any other layout.
    """
    if len(tables) != len(key_index) or len(tables) > 2:
        raise ValueError(
            "the row/column kernels take at most two tables (row, column) with one key index "
            f"each; got {len(tables)} tables and {len(key_index)} indices"
        )
    if not tables:
        return None, None, 1
    grid = grid_of(key_index)  # the index relative_logit_tables_2d hands out: known without reading it
    if grid is not None and grid[0] * grid[1] == length:
        h, w, roles = grid
        found = dict(zip(roles, tables))
        if len(found) == len(tables) and all(t.shape[-1] == (h if r == "row" else w) for r, t in found.items()):
            return found.get("row"), found.get("col"), w
    pos = torch.arange(length, device=key_index[0].device)
    sizes = [t.shape[-1] for t in tables]
    widths = sorted({m for m in sizes} | {length // m for m in sizes if m and length % m == 0})
    for w in widths:  # the first width under which every table is the row or the column table
        if w < 1 or length % w:
            continue
        found = {}
        for t, idx, m in zip(tables, key_index, sizes):
            if tuple(idx.shape) != (length,):
                break
            idx = idx.to(pos.device)
            if "row" not in found and m == length // w and torch.equal(idx, pos // w):
                found["row"] = t
            elif "col" not in found and m == w and torch.equal(idx, pos % w):
                found["col"] = t
            else:
                break
        else:
            return found.get("row"), found.get("col"), w
    raise ValueError(
        "the row/column kernels need tables on a row-major H x W key grid: key_index "
        "[j // W] for a [*, L, H] row table and [j % W] for a [*, L, W] column table; got "
        f"tables {[tuple(t.shape) for t in tables]} with other key indices (L = {length})"
    )
