"""Global 2D relative self-attention: the attention of Attention Augmented convolutions.

Paper: Bello, Zoph, Vaswani, Shlens, Le, "Attention Augmented Convolutional Networks", ICCV 2019
(Section 3.2 and Appendix A.3, Figures 7-8: ``rel_to_abs`` / ``relative_logits_1d`` /
``relative_logits``).

For a ``[H, W]`` map flattened to ``HW`` positions, the attention logits of one head are::

    logits[(y, x), (y', x')] = q[y, x] . k[y', x']
                             + q[y, x] . rel_h[y' - y + H - 1]      # relative height
                             + q[y, x] . rel_w[x' - x + W - 1]      # relative width

with ``rel_h`` ``[2H-1, d]`` and ``rel_w`` ``[2W-1, d]`` learned embeddings of the offset *key
minus query* (the paper's ``r^H_{l-i}``, ``r^W_{m-j}``). The paper's memory-efficient algorithm
never stores ``[HW, HW, d]``: one einsum of ``q`` with ``rel`` gives ``[.., L, 2L-1]`` logits
per query row, and ``rel_to_abs`` (a pad-and-reshape) turns the relative column index into the
absolute key coordinate (ported line by line in :mod:`.reference`). We multiply ``q`` by both
axes' embeddings in one matmul and take each query's window of it as a strided view (the
offset ``j - i + L - 1`` is affine in the query and the key: no pad, no gather), and never tile
the ``[.., HW, H]`` / ``[.., HW, W]`` tables to ``[HW, HW]``: they are handed, with the
row/column of every key (:func:`~.key_grid.grid_key_index`, made once per map size), to a
route of :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables` (its
registry, :func:`~aadet.layers.functional.logit_tables.logit_table_backend`), which adds them
inside a fused attention kernel (or a chunked float32 softmax).

No scaling happens here: the caller scales ``q`` (by ``dkh ** -0.5``) *before*, so the relative
logits see the scaled query, exactly as in the paper's code.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .checks import (
    check_query_chunk,
    check_query_positions,
    check_relative_embedding,
    check_relative_qk,
    check_relative_v,
)
from .dispatch import AUTO, is_exporting
from .key_grid import grid_key_index
from .logit_tables import LOGIT_TABLE_BACKENDS, logit_table_backend
from .precision import compute_dtype

__all__ = [
    "diagonal_window_view",
    "relative_logit_tables_2d",
    "relative_windows",
    "relative_table_for_length",
    "relative_self_attention_2d",
    "relative_self_attention_2d_unchecked",
    "relative_attention_weights_2d",
]


def relative_logit_tables_2d(
    q: torch.Tensor, rel_h: Optional[torch.Tensor], rel_w: Optional[torch.Tensor]
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per-query row/column logit tables and the row/column of each key.

    Returns ``(tables, key_index)`` for
    :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables`:

    * ``Th[b, n, y*W + x, y'] = q[b, n, y, x] . rel_h[y' - y + H - 1]`` ``[B, Nh, HW, H]``, keyed
      by ``y' = j // W``;
    * ``Tw[b, n, y*W + x, x'] = q[b, n, y, x] . rel_w[x' - x + W - 1]`` ``[B, Nh, HW, W]``, keyed
      by ``x' = j % W``.

    A ``None`` embedding contributes no table. Tables are computed in float32 (float64 for
    float64 ``q``) with autocast off, so large logits keep their precision under bf16 autocast.

    Args:
        q: ``[B, Nh, H, W, d]`` (already scaled) queries.
        rel_h: ``[2H - 1, d]`` or None.
        rel_w: ``[2W - 1, d]`` or None.
    """
    b, nh, h, w, d = q.shape
    embeddings = [(e, axis) for e, axis in ((rel_h, "row"), (rel_w, "col")) if e is not None]
    if not embeddings:
        return [], []
    ct = compute_dtype(q.dtype)
    rows, cols = grid_key_index(h, w, q.device)
    with torch.autocast(device_type=q.device.type, enabled=False):
        # One product of every query with every embedding of both axes, [B, Nh, H, W, M] with
        # M = (2H - 1) + (2W - 1): twice the products of the query's own windows, in one matmul
        # whose gradients are plain matmuls (no gather, whose backward on CUDA is an
        # index_put-with-sort), for a handful of launches a call instead of ~25.
        # (Exporting, the windows are gathered instead: ONNX has no strided view.)
        qc = q.to(ct)
        exporting = is_exporting()
        if not exporting:
            rel = torch.cat([e.to(ct) for e, _ in embeddings]) if len(embeddings) > 1 else embeddings[0][0].to(ct)
            full = torch.matmul(qc, rel.t()).contiguous()  # [B, Nh, H, W, M]
        tables, key_index, start = [], [], 0
        for e, axis in embeddings:
            length = h if axis == "row" else w
            if exporting:
                table = torch.einsum("bnyxd,yjd->bnyxj" if axis == "row" else "bnyxd,xjd->bnyxj",
                                     qc, relative_windows(e.to(ct), length))
            else:
                # row y meets rel[y' - y + L - 1] at key row y' (columns alike)
                table = diagonal_window_view(full, -3 if axis == "row" else -2, length, start + length - 1)
            tables.append(table.reshape(b, nh, h * w, length))  # [B, Nh, HW, H | W]
            key_index.append(rows if axis == "row" else cols)
            start += e.shape[0]
    return tables, key_index


def diagonal_window_view(x: torch.Tensor, dim: int, size: int, offset: int) -> torch.Tensor:
    """``out[..., a, ..., j] = x[..., a, ..., offset + j - a]`` for ``j < size``, ``a`` the index
    along ``dim``: each query's window of its offset logits (last axis of ``x``, contiguous), the
    key coordinate ``j`` in place of the offset (AA's ``rel_to_abs``), as a strided view (a step
    along ``dim`` moves one column less far). The caller keeps every ``offset + j - a`` inside
    the last axis (SASA's blocked routes zero-pad it first)."""
    shape, stride = list(x.shape), list(x.stride())
    shape[-1] = size
    stride[dim] -= 1
    return x.as_strided(shape, stride, x.storage_offset() + offset)


def relative_windows(rel: torch.Tensor, length: int) -> torch.Tensor:
    """``[2L - 1, d] -> [L, L, d]``: ``out[i, j] = rel[j - i + L - 1]``, the embedding of the
    offset key ``j`` minus query ``i`` along an axis of length ``L`` (gathered; gradients
    accumulate back into ``rel``)."""
    if rel.dim() != 2 or rel.shape[0] != 2 * length - 1:
        raise ValueError(f"rel must have shape [2L-1, d] with 2L-1 = {2 * length - 1}; got {tuple(rel.shape)}")
    i = torch.arange(length, device=rel.device)
    return rel[i[None, :] - i[:, None] + length - 1]


def relative_table_for_length(table: torch.Tensor, length: int) -> torch.Tensor:
    """The ``[2L - 1, d]`` embeddings a length-``L`` axis uses from a ``[2 Lmax - 1, d]`` table.

    For ``L <= Lmax`` this is the centre slice (offsets ``-(L-1) .. L-1``; a view). For
    ``L > Lmax`` offsets beyond ``Lmax - 1`` are clipped onto the table's ends (Shaw et al.'s
    clipping). Callers that do not want clipping must check ``L <= Lmax`` themselves.

    Args:
        table: ``[2 * Lmax - 1, d]``.
        length: ``L >= 1``.
    """
    rows = table.shape[0]
    if rows % 2 != 1:
        raise ValueError(f"table must have an odd number of rows 2*Lmax-1; got {rows}")
    if length < 1:
        raise ValueError(f"length must be >= 1; got {length}")
    lmax = (rows + 1) // 2
    if length <= lmax:
        return table.narrow(0, lmax - length, 2 * length - 1)
    offsets = torch.arange(-(length - 1), length, device=table.device)
    idx = offsets.clamp(-(lmax - 1), lmax - 1) + (lmax - 1)
    return table.index_select(0, idx)


def relative_self_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor] = None,
    rel_w: Optional[torch.Tensor] = None,
    *,
    impl: str = AUTO,
    query_chunk: int = 0,
) -> torch.Tensor:
    """Global multi-head self-attention over a 2D map with 2D relative logits (AA, Sec. 3.2).

    ``out[y, x] = sum_{y', x'} softmax_{y', x'}(q[y,x].k[y',x'] + q[y,x].rel_h[y'-y+H-1]
    + q[y,x].rel_w[x'-x+W-1]) v[y', x']`` for every batch element and head.

    Args:
        q: ``[B, Nh, H, W, dk]`` queries, already scaled (no scaling happens here).
        k: ``[B, Nh, H, W, dk]`` keys.
        v: ``[B, Nh, H, W, dv]`` values.
        rel_h: ``[2H - 1, dk]`` height embeddings (shared across heads), or None for no
            height term.
        rel_w: ``[2W - 1, dk]`` width embeddings, or None for no width term.
        impl: ``"auto"`` or a route of
            :data:`~aadet.layers.functional.logit_tables.LOGIT_TABLE_BACKENDS`; see
            :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables`.
        query_chunk: queries per chunk of the materialized route (0 = all); bounds its peak
            memory (``B * Nh * query_chunk * HW`` logits), which matters where that route runs:
            float64, ``impl="materialized"``, and tracing/export under ``"auto"``.

    Returns:
        ``[B, Nh, H, W, dv]``.
    """
    check_relative_qk(q, k)
    check_relative_v(q, v)
    b, nh, h, w, dk = q.shape
    check_relative_embedding("rel_h", rel_h, h, "H", dk)
    check_relative_embedding("rel_w", rel_w, w, "W", dk)
    check_query_chunk(query_chunk)
    LOGIT_TABLE_BACKENDS.check(impl)
    return relative_self_attention_2d_unchecked(q, k, v, rel_h, rel_w, impl, query_chunk)


def relative_self_attention_2d_unchecked(q, k, v, rel_h, rel_w, impl: str, query_chunk: int) -> torch.Tensor:
    """:func:`relative_self_attention_2d` on arguments its caller has checked: what a layer
    calls in its forward, having checked ``impl`` and ``query_chunk`` when it was built and made
    ``q, k, v`` and the embeddings itself."""
    b, nh, h, w, dk = q.shape
    tables, key_index = relative_logit_tables_2d(q, rel_h, rel_w)
    out = logit_table_backend(impl, q)(
        q.reshape(b, nh, h * w, dk),  # [B, Nh, HW, dk]
        k.reshape(b, nh, h * w, dk),  # [B, Nh, HW, dk]
        v.reshape(b, nh, h * w, v.shape[-1]),  # [B, Nh, HW, dv]
        tables,
        key_index,
        query_chunk=query_chunk,
    )  # [B, Nh, HW, dv]
    return out.reshape(b, nh, h, w, v.shape[-1])


def relative_attention_weights_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    query_yx: Union[torch.Tensor, Sequence[Sequence[int]]],
) -> torch.Tensor:
    """Attention probabilities of selected queries, for visualization (AA, Appendix A.4).

    Costs ``O(P * HW)``, not ``O((HW)^2)``: only the ``P`` requested rows of the attention
    matrix are computed (in float32, or float64 for float64 inputs).

    Args:
        q: ``[B, Nh, H, W, dk]`` (already scaled) queries.
        k: ``[B, Nh, H, W, dk]`` keys.
        rel_h: ``[2H - 1, dk]`` or None.
        rel_w: ``[2W - 1, dk]`` or None.
        query_yx: ``[P, 2]`` integer ``(y, x)`` query positions on the ``[H, W]`` map.

    Returns:
        ``[B, Nh, P, H, W]``: for each query, a distribution over key positions (sums to 1).
    """
    check_relative_qk(q, k)
    b, nh, h, w, dk = q.shape
    check_relative_embedding("rel_h", rel_h, h, "H", dk)
    check_relative_embedding("rel_w", rel_w, w, "W", dk)
    yx = check_query_positions(query_yx, h, w, q.device)
    ys, xs = yx[:, 0], yx[:, 1]
    ct = compute_dtype(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qp = q[:, :, ys, xs].to(ct)  # [B, Nh, P, dk]
        logits = torch.einsum("bnpd,bnyxd->bnpyx", qp, k.to(ct))  # [B, Nh, P, H, W]
        if rel_h is not None:
            idx = torch.arange(h, device=q.device)[None, :] - ys[:, None] + h - 1  # [P, H]
            rh = rel_h.to(ct)[idx]  # [P, H, dk]
            logits = logits + torch.einsum("bnpd,pyd->bnpy", qp, rh)[..., :, None]
        if rel_w is not None:
            idx = torch.arange(w, device=q.device)[None, :] - xs[:, None] + w - 1  # [P, W]
            rw = rel_w.to(ct)[idx]  # [P, W, dk]
            logits = logits + torch.einsum("bnpd,pxd->bnpx", qp, rw)[..., None, :]
        weights = torch.softmax(logits.reshape(b, nh, -1, h * w), dim=-1)  # [B, Nh, P, HW]
    return weights.reshape(b, nh, -1, h, w)
