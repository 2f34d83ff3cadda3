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
  (activation checkpointing), so training memory is bounded too.

Both keep logits and softmax in float32 under autocast (SDPA's kernels accumulate in float32; the
materialized route casts), and masks are a finite ``MASK_VALUE`` that is safe in bf16 and fp16.
"""
from typing import List, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["LOGIT_TABLE_IMPLS", "MASK_VALUE", "attention_with_logit_tables", "is_exporting"]

# Large negative logit used as a mask. Finite (no inf-inf = NaN), representable in fp16
# (|x| < 65504) and far below any real logit, so exp(MASK_VALUE - max) underflows to 0.
MASK_VALUE = -1.0e4

# Allowed values of ``impl`` (the one definition; AA layers and the config import it).
LOGIT_TABLE_IMPLS = ("auto", "fused", "materialized")


def is_exporting() -> bool:
    """True while ``torch.jit.trace``, ``torch.onnx.export`` or ``torch.export`` records the model.

    ``impl="auto"`` then picks the materialized routes: plain differentiable tensor ops only (no
    custom ``autograd.Function``, no ``scaled_dot_product_attention``), which trace and export to
    ONNX (opset 17).
    """
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return True
    is_exp = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exp()) if is_exp is not None else False


def _indicators(key_index: Sequence[torch.Tensor], sizes: Sequence[int], like: torch.Tensor):
    """Multi-hot key-side indicators ``[Lk, sum(sizes)]`` in the dtype/device of ``like``."""
    parts = [F.one_hot(idx.to(like.device), m).to(like.dtype) for idx, m in zip(key_index, sizes)]
    return torch.cat(parts, dim=-1)


def _fused(q, k, v, tables, key_index):
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


def _materialized(q, k, v, tables, key_index, chunk):
    lq = q.shape[-2]
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
        impl: ``"fused"`` (augmented dot product through SDPA), ``"materialized"`` (explicit
            float32 logits, chunked over queries) or ``"auto"`` (fused unless float64 or
            ``query_chunk`` is given on a device without fused kernels).
        query_chunk: queries per chunk for the materialized route (0 = all at once).

    Returns:
        ``[*, Lq, dv]``.
    """
    if impl not in LOGIT_TABLE_IMPLS:
        raise ValueError(f"impl must be one of {LOGIT_TABLE_IMPLS}; got {impl!r}")
    if len(tables) != len(key_index):
        raise ValueError(f"got {len(tables)} tables but {len(key_index)} key indices")
    if impl == "auto":
        # float64 (tests, gradcheck) has no fused kernel worth using; export wants plain ops.
        impl = "materialized" if q.dtype == torch.float64 or is_exporting() else "fused"
    if impl == "fused":
        return _fused(q, k, v, tables, key_index)
    return _materialized(q, k, v, tables, key_index, query_chunk)
