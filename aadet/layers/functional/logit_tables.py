"""Attention whose logits are a content term plus position tables: the piece AA and SASA share.

Both papers' relative logits factor into per-query tables indexed by a key coordinate::

    logits[n, i, j] = q[n, i] . k[n, j]  +  sum_g  T_g[n, i, idx_g[j]]

AA (global): g in {row, column}, ``T_row[i, y'] = q_i . rel_h[y' - y_i + H - 1]``, ``idx_row[j] = y'_j``.
SASA (blocked local): the same over the rows/columns of a halo window, with out-of-window and
out-of-map entries of the tables set to a large negative number (that is the mask).

Two exact routes compute it:

* ``"fused"`` -- the *augmented dot product*: append the tables to ``q`` and one-hot indicators
  of ``idx_g[j]`` to ``k``; then ``[q, T] . [k, onehot] = q.k + sum_g T_g[i, idx_g[j]]`` and the
  whole logit is one dot product, so :func:`torch.nn.functional.scaled_dot_product_attention` runs
  it with a fused kernel (flash / memory-efficient on CUDA, flash on CPU) that never stores the
  ``[N, Lq, Lk]`` attention matrix. Costs ``sum_g M_g`` extra head dims.
* ``"materialized"`` -- logits, float32 softmax and the weighted sum written out, over chunks of
  queries (peak memory ``N * chunk * Lk``); under autograd each chunk is recomputed in backward
  (activation checkpointing), so training memory is bounded too. Plain tensor ops only: the
  route ``"auto"`` takes for float64 and while tracing/exporting (:mod:`.dispatch`).

:data:`LOGIT_TABLE_BACKENDS` maps each ``impl`` name to its implementation.

Both keep logits and softmax in float32 under autocast (SDPA's kernels accumulate in float32; the
materialized route casts), and masks are a finite ``MASK_VALUE`` that is safe in bf16 and fp16.
"""
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .checks import check_query_chunk
from .dispatch import check_impl, is_exporting, lazy_backend

__all__ = [
    "LOGIT_TABLE_BACKENDS",
    "LOGIT_TABLE_IMPLS",
    "MASK_VALUE",
    "attention_with_logit_tables",
    "auto_logit_table_impl",
]

# Large negative logit used as a mask. Finite (no inf-inf = NaN), representable in fp16
# (|x| < 65504) and far below any real logit, so exp(MASK_VALUE - max) underflows to 0.
MASK_VALUE = -1.0e4

def _indicators(key_index: Sequence[torch.Tensor], sizes: Sequence[int], like: torch.Tensor):
    """Multi-hot key-side indicators ``[Lk, sum(sizes)]`` in the dtype/device of ``like``."""
    parts = [F.one_hot(idx.to(like.device), m).to(like.dtype) for idx, m in zip(key_index, sizes)]
    return torch.cat(parts, dim=-1)


def fused_logit_table_attention(q, k, v, tables, key_index, *, query_chunk: int = 0):
    """The augmented dot product through SDPA (``impl="fused"``; ``query_chunk`` unused)."""
    if tables:
        sizes = [t.shape[-1] for t in tables]
        ind = _indicators(key_index, sizes, k)  # [Lk, M]
        q_aug = torch.cat([q, *[t.to(q.dtype) for t in tables]], dim=-1)  # [N, Lq, d + M]
        k_aug = torch.cat([k, ind.expand(*k.shape[:-1], ind.shape[-1])], dim=-1)  # [N, Lk, d + M]
    else:  # no position term: plain attention
        q_aug, k_aug = q, k
    dv, dqk = v.shape[-1], q_aug.shape[-1]
    if q.device.type == "cpu" and dv < dqk:
        # The CPU flash kernel needs equal head dims for q/k and v; without it SDPA falls back to
        # the math kernel, which stores the full attention matrix. Zero-padding v is exact.
        out = F.scaled_dot_product_attention(q_aug, k_aug, F.pad(v, (0, dqk - dv)), scale=1.0)
        return out[..., :dv]
    return F.scaled_dot_product_attention(q_aug, k_aug, v, scale=1.0)


def _materialized_chunk(q, k, v, *tables_and_index):
    n = len(tables_and_index) // 2
    tables, key_index = tables_and_index[:n], tables_and_index[n:]
    ct = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for references
    with torch.autocast(device_type=q.device.type, enabled=False):
        logits = torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2))  # [N, Lq, Lk]
        for t, idx in zip(tables, key_index):
            logits = logits + t.to(ct).index_select(-1, idx.to(t.device))
        weights = torch.softmax(logits, dim=-1)
        out = torch.matmul(weights, v.to(ct))
    return out.to(v.dtype)


def materialized_logit_table_attention(q, k, v, tables, key_index, *, query_chunk: int = 0):
    """Explicit float32 logits and softmax (``impl="materialized"``), ``query_chunk`` queries at a
    time (0 = all): peak memory ``N * query_chunk * Lk``; under autograd each chunk is recomputed
    in backward, unless tracing/exporting (the chunks are then unrolled into the graph)."""
    lq, chunk = q.shape[-2], query_chunk
    if chunk <= 0 or chunk >= lq:
        return _materialized_chunk(q, k, v, *tables, *key_index)
    outs = []
    need_grad = torch.is_grad_enabled() and not is_exporting() and any(
        t.requires_grad for t in (q, k, v, *tables)
    )
    for s in range(0, lq, chunk):
        sl = slice(s, min(s + chunk, lq))
        args = (q[..., sl, :], k, v, *[t[..., sl, :] for t in tables], *key_index)
        if need_grad:
            outs.append(checkpoint(_materialized_chunk, *args, use_reentrant=False))
        else:
            outs.append(_materialized_chunk(*args))
    return torch.cat(outs, dim=-2)


#: ``impl`` name -> implementation ``fn(q, k, v, tables, key_index, *, query_chunk) -> out`` on
#: checked arguments (shapes as in :func:`attention_with_logit_tables`). Adding a route is one
#: file and one line here.
LOGIT_TABLE_BACKENDS: Dict[str, Callable[..., torch.Tensor]] = {
    "fused": fused_logit_table_attention,
    "materialized": materialized_logit_table_attention,
    # Flash attention with the row/column tables added in-kernel (no head widening); CUDA, or
    # CPU under Triton's interpreter (tests).
    "triton": lazy_backend("logit_tables_triton", "triton_attention_with_logit_tables", drop=("query_chunk",)),
    # torch's flex_attention with the tables in its score_mod; backward on CUDA only.
    "flex": lazy_backend("logit_tables_flex", "flex_attention_with_logit_tables", drop=("query_chunk",)),
}

#: Allowed values of ``impl`` (the one definition; AA layers and the config import it).
LOGIT_TABLE_IMPLS = ("auto",) + tuple(LOGIT_TABLE_BACKENDS)


def auto_logit_table_impl(q: torch.Tensor) -> str:
    """What ``impl="auto"`` runs: ``"materialized"`` for float64 (references, gradcheck: no fused
    kernel worth using) and while tracing/exporting (plain tensor ops only), else ``"fused"``."""
    return "materialized" if q.dtype == torch.float64 or is_exporting() else "fused"


def attention_with_logit_tables(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: List[torch.Tensor],
    key_index: List[torch.Tensor],
    *,
    impl: str = "auto",
    query_chunk: int = 0,
) -> torch.Tensor:
    """``softmax(q . k + sum_g tables[g][..., key_index[g]]) v`` over the key axis, exactly.

    Args:
        q: ``[*, Lq, d]`` queries (already scaled; no scaling happens here).
        k: ``[*, Lk, d]`` keys.
        v: ``[*, Lk, dv]`` values.
        tables: list of ``[*, Lq, M_g]`` query-side logit tables (may be empty).
        key_index: list of ``[Lk]`` long tensors in ``[0, M_g)``: the table column of each key.
        impl: one of :data:`LOGIT_TABLE_IMPLS`: ``"fused"`` (augmented dot product through
            SDPA), ``"materialized"`` (explicit float32 logits, chunked over queries),
            ``"triton"`` (flash attention with the tables added in the kernel; 2D row/column
            tables only; CUDA), ``"flex"`` (``flex_attention`` score_mod; backward on CUDA only) or
            ``"auto"`` (:func:`auto_logit_table_impl`: fused, except for float64 inputs and
            while tracing/exporting).
        query_chunk: queries per chunk of the materialized route (0 = all at once); it bounds
            that route's peak memory to ``N * query_chunk * Lk`` logits. The fused route never
            stores the logits and ignores it.

    Returns:
        ``[*, Lq, dv]``.
    """
    check_impl(impl, LOGIT_TABLE_IMPLS)
    if len(tables) != len(key_index):
        raise ValueError(f"got {len(tables)} tables but {len(key_index)} key indices")
    check_query_chunk(query_chunk)
    fn = LOGIT_TABLE_BACKENDS[auto_logit_table_impl(q) if impl == "auto" else impl]
    return fn(q, k, v, tables, key_index, query_chunk=query_chunk)
