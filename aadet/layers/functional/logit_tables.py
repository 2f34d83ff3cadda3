"""Attention whose logits are a content term plus position tables: the piece AA and SASA share.

Both papers' relative logits factor into per-query tables indexed by a key coordinate::

    logits[n, i, j] = q[n, i] . k[n, j]  +  sum_g  T_g[n, i, idx_g[j]]

AA (global): g in {row, column}, ``T_row[i, y'] = q_i . rel_h[y' - y_i + H - 1]``, ``idx_row[j] = y'_j``.
SASA (blocked local): the same over the rows/columns of a halo window, with out-of-window and
out-of-map entries of the tables set to a large negative number (that is the mask:
:data:`~.backends.sasa_blocked.MASK_VALUE`).

:func:`attention_with_logit_tables` checks its arguments once (:mod:`.checks`) and dispatches on
``impl`` through :data:`LOGIT_TABLE_BACKENDS`, one exact implementation per file under
``backends/``; ``"auto"`` is :func:`auto_logit_table_impl`. The other public functions built on
these routes (AA's :func:`~.relative_attention.relative_self_attention_2d`, SASA's blocked routes)
call :func:`logit_table_backend` / the route functions directly, on arguments they have checked.
All keep logits and softmax in float32 under autocast.
"""
from typing import Callable, List

import torch

from .backends import aa_cpp
from .backends.aa_cpp import cpp_attention_with_logit_tables
from .backends.aa_materialized import materialized_attention_with_logit_tables
from .backends.aa_sdpa import sdpa_attention_with_logit_tables
from .checks import check_logit_tables, check_query_chunk
from .dispatch import AUTO, Route, RouteRegistry, is_exporting, lazy_backend
from .route_table import CUDA_DEFAULT_ROUTES, measured_route

__all__ = [
    "LOGIT_TABLE_BACKENDS",
    "attention_with_logit_tables",
    "auto_logit_table_impl",
    "logit_table_backend",
]

#: ``impl`` name -> :class:`~.dispatch.Route` whose ``fn(q, k, v, tables, key_index, *,
#: query_chunk) -> out`` runs on checked arguments (shapes as in
#: :func:`attention_with_logit_tables`): the one list of AA's routes (``impl`` of the AA layers,
#: ``MODEL.AA.IMPL``, the export check). Adding a route is one file and one entry here.
LOGIT_TABLE_BACKENDS = RouteRegistry("attention with logit tables", {
    "fused": Route(
        sdpa_attention_with_logit_tables,
        "the augmented dot product (tables appended to ``q``, one-hot indicators of ``idx_g[j]`` "
        "to ``k``) through fused SDPA, which never stores the ``[N, Lq, Lk]`` attention matrix; "
        "costs ``sum_g M_g`` extra head dims (:mod:`.backends.aa_sdpa`)",
    ),
    "materialized": Route(
        materialized_attention_with_logit_tables,
        "logits, float32 softmax and the weighted sum written out over chunks of queries "
        "(``query_chunk``), recomputed in backward; plain tensor ops, so it exports "
        "(:mod:`.backends.aa_materialized`)",
        exports=True,
    ),
    "triton": Route(
        lazy_backend(
            "backends.aa_triton", "triton_attention_with_logit_tables", drop=("query_chunk",)
        ),
        "flash attention with AA's row/column tables added in the kernel (no head widening); "
        "CUDA, or CPU under Triton's interpreter (:mod:`.backends.aa_triton`)",
        requires=("triton",),
    ),
    "flex": Route(
        lazy_backend(
            "backends.aa_flex", "flex_attention_with_logit_tables", drop=("query_chunk",)
        ),
        "``flex_attention`` with the tables in its ``score_mod``; backward on CUDA only "
        "(:mod:`.backends.aa_flex`)",
        requires=("triton",),  # compiled by Inductor, which generates Triton on CUDA
    ),
    "cpp": Route(
        cpp_attention_with_logit_tables,
        "a C++ kernel with AA's row/column tables added inside the softmax (no head widening); "
        "CPU tensors, 2D row/column tables only, compiled on first use "
        "(:mod:`.backends.aa_cpp`)",
        cuda=False,
    ),
})
__doc__ = LOGIT_TABLE_BACKENDS.document(__doc__, "LOGIT_TABLE_BACKENDS")


def auto_logit_table_impl(q: torch.Tensor) -> str:
    """What ``impl="auto"`` runs: ``"materialized"`` for float64 (references, gradcheck: no fused
    kernel worth using) and while tracing/exporting (plain tensor ops only); on CPU the C++ kernel
    ``"cpp"`` where it builds (the fastest exact CPU route by BENCHMARKS.md's AA layer table); on
    CUDA the route measured fastest for the GPU, precision and query count ``Lq``
    (:func:`~.route_table.measured_route`), else the default (:data:`~.route_table.CUDA_DEFAULT_ROUTES`);
    else ``"fused"`` (SDPA; on CPU with one warning where the kernel did not build)."""
    if q.dtype == torch.float64 or is_exporting():
        return "materialized"
    measured = measured_route("aa", LOGIT_TABLE_BACKENDS, q, q.shape[-2])
    if measured is not None:
        return measured
    if q.device.type == "cuda":
        return CUDA_DEFAULT_ROUTES["aa"]
    if q.device.type == "cpu" and aa_cpp.KERNEL.available():
        return "cpp"
    return "fused"


def logit_table_backend(impl: str, q: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The implementation a checked ``impl`` names, ``"auto"`` resolved for queries ``q``."""
    return LOGIT_TABLE_BACKENDS[auto_logit_table_impl(q) if impl == AUTO else impl].fn


def attention_with_logit_tables(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: List[torch.Tensor],
    key_index: List[torch.Tensor],
    *,
    impl: str = AUTO,
    query_chunk: int = 0,
) -> torch.Tensor:
    """``softmax(q . k + sum_g tables[g][..., key_index[g]]) v`` over the key axis, exactly.

    Args:
        q: ``[*, Lq, d]`` queries (already scaled; no scaling happens here).
        k: ``[*, Lk, d]`` keys.
        v: ``[*, Lk, dv]`` values.
        tables: list of ``[*, Lq, M_g]`` query-side logit tables (may be empty).
        key_index: list of ``[Lk]`` long tensors in ``[0, M_g)``: the table column of each key.
        impl: ``"auto"`` (:func:`auto_logit_table_impl`) or a route of
            :data:`LOGIT_TABLE_BACKENDS` (the module docstring lists them).
        query_chunk: queries per chunk of the materialized route (0 = all at once); it bounds
            that route's peak memory to ``N * query_chunk * Lk`` logits. The fused route never
            stores the logits and ignores it.

    Returns:
        ``[*, Lq, dv]``.
    """
    LOGIT_TABLE_BACKENDS.check(impl)
    check_logit_tables(q, k, v, tables, key_index)
    check_query_chunk(query_chunk)
    return logit_table_backend(impl, q)(q, k, v, tables, key_index, query_chunk=query_chunk)
