"""HaloNet attention as batched matmuls with its own backward: the ``"bmm"`` route (pure PyTorch).

Computes :func:`~aadet.layers.functional.halo_attention.halo_attention_2d` on the blocks of
:mod:`.halonet_blocks`, written for the CPU: blocked attention is dense within a block, so each step
is one batched matmul over all ``M = B Nh nblk`` blocks (``Pq`` queries, ``L = Uh Uw`` window
keys, ``d`` channels) that BLAS runs near full rate, and the few elementwise passes over the
``[M, Pq, L]`` logits are all there is besides. What the plain-ops route
(:mod:`.halonet_materialized`) leaves to autograd is done here by hand, which halves its time:

* channels-first maps: ``q, k, v`` are read as ``[B Nh, d, H, W]`` (a view of the layer's
  projections), the keys' windows copied straight into the ``[M, d, L]`` layout the logits'
  matmul wants, the output written as a channels-first map (a view for the layer's head merge);
* position terms and border mask in the row and column tables: ``row[.., p, u] = q_p . rel_h[..]``
  with ``-inf`` on window rows outside the map (columns likewise), added to the logits in two
  broadcast passes; the mask costs nothing more (a key is outside iff its row or its column is);
* backward: ``dV = P^T dO``, ``dP = dO V^T``, the softmax's backward, ``dQ = dS K``, ``dK^T = Q^T
  dS`` as batched matmuls on contiguous blocks; the tables' gradients are ``dS`` summed over
  the window's columns / rows, scattered to the embedding rows; the windows' gradients are
  folded back onto the maps (overlapping halos summed) with ``ceil(U / b)`` slab additions per
  axis instead of ``unfold``'s generic backward.

Saved for backward: the blocks ``q [M, Pq, d]``, the windows ``k [M, d, L]`` and ``v [M, L, dv]``
and the softmax output ``[M, Pq, L]`` (``(b + 2h)^2`` per query). Arithmetic in float32 with
autocast off, or float64 for float64 inputs (the exactness tests); output in ``v``'s dtype. A
custom autograd Function: it does not export.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..precision import compute_dtype, grads_in_input_dtypes, input_dtypes
from .halonet_blocks import (
    HaloGeometry, halo_geometry, halo_keys_all_inside, halo_line_validity, halo_relative_index,
)

__all__ = ["bmm_halo_attention"]


def _channels_first(x: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    """``[B, Nh, H, W, c]`` -> ``[B Nh, c, H, W]`` in ``ct`` (a view of a channels-first map)."""
    b, nh, h, w, c = x.shape
    return x.to(ct).permute(0, 1, 4, 2, 3).reshape(b * nh, c, h, w)


def _from_channels_first(x: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """``[B Nh, c, H, W]`` -> ``[B, Nh, H, W, c]`` (a view)."""
    n, c, h, w = x.shape
    return x.view(geo.batch, geo.heads, c, h, w).permute(0, 1, 3, 4, 2)


def _query_blocks(x: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """``[N, c, Ho, Wo]`` -> ``[N nblk, Pq, c]`` (zero-padded to whole blocks; a copy)."""
    (nby, nbx), (bqh, bqw), (ho, wo) = geo.grid, geo.query_tile, geo.out_hw
    n, c = x.shape[:2]
    x = F.pad(x, (0, nbx * bqw - wo, 0, nby * bqh - ho))
    x = x.view(n, c, nby, bqh, nbx, bqw).permute(0, 2, 4, 3, 5, 1)  # [N, nby, nbx, bq_h, bq_w, c]
    return x.reshape(n * nby * nbx, bqh * bqw, c)


def _unblock(x: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """Inverse of :func:`_query_blocks`: ``[N nblk, Pq, c]`` -> ``[N, c, Ho, Wo]``."""
    (nby, nbx), (bqh, bqw), (ho, wo) = geo.grid, geo.query_tile, geo.out_hw
    n, c = x.shape[0] // (nby * nbx), x.shape[-1]
    x = x.view(n, nby, nbx, bqh, bqw, c).permute(0, 5, 1, 3, 2, 4)  # [N, c, nby, bq_h, nbx, bq_w]
    return x.reshape(n, c, nby * bqh, nbx * bqw)[:, :, :ho, :wo]


def _windows(x: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """``[N, c, H, W]`` -> ``[N, nby, nbx, c, Uh, Uw]``: each block's window, a view of the map
    zero-padded by the halo and to whole blocks."""
    (nby, nbx), (bkh, bkw), (h, w), hs = geo.grid, geo.key_tile, geo.key_hw, geo.halo
    uh, uw = geo.window
    x = F.pad(x, (hs, nbx * bkw - w + hs, hs, nby * bkh - h + hs))
    return x.unfold(2, uh, bkh).unfold(3, uw, bkw).permute(0, 2, 3, 1, 4, 5)


def _fold(g: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """Adjoint of :func:`_windows`: ``[N, nby, nbx, c, Uh, Uw]`` -> ``[N, c, H, W]``, the
    windows' overlaps summed.

    Along each axis, window line ``u`` of block ``n`` is map line ``n bk - h + u``: the window
    lines ``[j bk, (j + 1) bk)`` of all blocks land on consecutive, disjoint map lines, so each of
    the ``ceil(U / bk)`` such slabs is one strided ``add_`` (columns first, then rows).
    """
    (nby, nbx), (bkh, bkw), (h, w), hs = geo.grid, geo.key_tile, geo.key_hw, geo.halo
    uh, uw = geo.window
    n, c = g.shape[0], g.shape[3]
    g = g.permute(0, 1, 3, 4, 2, 5)  # [N, nby, c, Uh, nbx, Uw]
    cols = g.new_zeros(n, nby, c, uh, (nbx + (uw + bkw - 1) // bkw) * bkw)  # padded map columns
    for j in range(0, uw, bkw):
        span = min(bkw, uw - j)
        cols[..., j:j + nbx * bkw].unflatten(-1, (nbx, bkw))[..., :span].add_(g[..., j:j + span])
    cols = cols.permute(0, 2, 1, 3, 4)  # [N, c, nby, Uh, Wp]
    out = g.new_zeros(n, c, (nby + (uh + bkh - 1) // bkh) * bkh, cols.shape[-1])  # padded map
    for i in range(0, uh, bkh):
        span = min(bkh, uh - i)
        out[:, :, i:i + nby * bkh].unflatten(2, (nby, bkh))[:, :, :, :span].add_(cols[:, :, :, i:i + span])
    return out[:, :, hs:hs + h, hs:hs + w]


def _position_tables(qb, rel_h, rel_w, geo: HaloGeometry):
    """``row [N, nblk, Pq, Uh]`` / ``col [.., Uw]`` (broadcastable; None, None if there is
    nothing to add): ``q . rel`` (or 0) with ``-inf`` on window lines outside the map."""
    (nby, nbx), (uh, uw) = geo.grid, geo.window
    nblk, pq = nby * nbx, qb.shape[1]
    row = col = None
    if rel_h is not None:
        idx_r, idx_c = halo_relative_index(geo, qb.device)
        dr = qb.shape[-1] // 2
        rh = torch.matmul(qb[..., :dr], rel_h.t())  # [M, Pq, R]
        rw = torch.matmul(qb[..., dr:], rel_w.t())
        row = torch.gather(rh, -1, idx_r.expand(qb.shape[0], pq, uh)).view(-1, nblk, pq, uh)
        col = torch.gather(rw, -1, idx_c.expand(qb.shape[0], pq, uw)).view(-1, nblk, pq, uw)
    if not halo_keys_all_inside(geo):
        valid_r, valid_c = halo_line_validity(geo, qb.device)  # [nby, Uh], [nbx, Uw]
        out_r = ~valid_r[:, None, None, :].expand(nby, nbx, 1, uh).reshape(nblk, 1, uh)
        out_c = ~valid_c[None, :, None, :].expand(nby, nbx, 1, uw).reshape(nblk, 1, uw)
        if row is None:
            row = qb.new_zeros(nblk, 1, uh)
            col = qb.new_zeros(nblk, 1, uw)
        row = row.masked_fill(out_r, float("-inf"))
        col = col.masked_fill(out_c, float("-inf"))
    return row, col


class _HaloBmm(torch.autograd.Function):
    """See the module docstring. ``q [B, Nh, Ho, Wo, d]``, ``k [B, Nh, H, W, d]``, ``v [B, Nh,
    H, W, dv]``, ``rel_h``/``rel_w`` or None, ``geo`` -> ``[B, Nh, Ho, Wo, dv]``."""

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, geo: HaloGeometry):
        ctx.dtypes = input_dtypes(q, k, v, rel_h, rel_w)
        ct = compute_dtype(q.dtype)
        (nby, nbx), (uh, uw) = geo.grid, geo.window
        m = geo.batch * geo.heads * nby * nbx
        with torch.autocast(device_type=q.device.type, enabled=False):
            if rel_h is not None:
                rel_h, rel_w = rel_h.to(ct), rel_w.to(ct)
            qb = _query_blocks(_channels_first(q, ct), geo)  # [M, Pq, d]
            d, pq = qb.shape[-1], qb.shape[1]
            kbt = _windows(_channels_first(k, ct), geo).reshape(m, d, uh * uw)  # [M, d, L]
            vb = _windows(_channels_first(v, ct), geo).permute(0, 1, 2, 4, 5, 3)
            vb = vb.reshape(m, uh * uw, v.shape[-1])  # [M, L, dv]
            logits = torch.bmm(qb, kbt)  # [M, Pq, L]
            row, col = _position_tables(qb, rel_h, rel_w, geo)
            if row is not None:
                grid = logits.view(-1, nby * nbx, pq, uh, uw)
                grid.add_(row[..., :, None]).add_(col[..., None, :])
            probs = torch.softmax(logits, dim=-1)
            del logits
            out = _unblock(torch.bmm(probs, vb), geo)  # [B Nh, dv, Ho, Wo]
        ctx.save_for_backward(qb, kbt, vb, probs, rel_h, rel_w)
        ctx.geo = geo
        return _from_channels_first(out, geo).to(ctx.dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        qb, kbt, vb, probs, rel_h, rel_w = ctx.saved_tensors
        geo: HaloGeometry = ctx.geo
        need_q, need_k, need_v, need_rh, need_rw, _ = ctx.needs_input_grad
        ct = probs.dtype
        (nby, nbx), (uh, uw) = geo.grid, geo.window
        n = geo.batch * geo.heads
        gq = gk = gv = grh = grw = None
        with torch.autocast(device_type=probs.device.type, enabled=False):
            gob = _query_blocks(_channels_first(grad_out, ct), geo)  # [M, Pq, dv]
            if need_v:
                gvb = torch.bmm(probs.transpose(1, 2), gob)  # [M, L, dv]
                gvb = gvb.view(n, nby, nbx, uh, uw, -1).permute(0, 1, 2, 5, 3, 4)
                gv = _from_channels_first(_fold(gvb, geo), geo)
            if need_q or need_k or need_rh or need_rw:
                gs = torch._softmax_backward_data(torch.bmm(gob, vb.transpose(1, 2)), probs, -1, ct)
                if need_k:
                    gkbt = torch.bmm(qb.transpose(1, 2), gs)  # [M, d, L]
                    gk = _fold(gkbt.view(n, nby, nbx, -1, uh, uw), geo)
                    gk = _from_channels_first(gk, geo)
                gqb = torch.bmm(gs, kbt.transpose(1, 2)) if need_q else None  # [M, Pq, d]
                if rel_h is not None:
                    gqb, grh, grw = _relative_gradients(gs, qb, rel_h, rel_w, gqb, geo)
                if need_q:
                    gq = _from_channels_first(_unblock(gqb, geo), geo)
        return (*grads_in_input_dtypes(ctx, gq, gk, gv, grh, grw), None)


def _relative_gradients(gs, qb, rel_h, rel_w, gqb: Optional[torch.Tensor], geo: HaloGeometry):
    """Through the position tables: the logits' gradient ``gs [M, Pq, L]`` summed over the
    window's columns (rows) is the row (column) table's, scattered onto the embedding rows it
    was gathered from. Adds the query's share to ``gqb`` (if given); returns ``(gqb, grad rel_h,
    grad rel_w)``."""
    (uh, uw), m, pq = geo.window, gs.shape[0], gs.shape[1]
    idx_r, idx_c = halo_relative_index(geo, gs.device)
    grid = gs.view(m, pq, uh, uw)
    rows = gs.new_zeros(m, pq, rel_h.shape[0]).scatter_add_(-1, idx_r.expand(m, pq, uh), grid.sum(-1))
    cols = gs.new_zeros(m, pq, rel_w.shape[0]).scatter_add_(-1, idx_c.expand(m, pq, uw), grid.sum(-2))
    dr = qb.shape[-1] // 2
    if gqb is not None:
        gqb[..., :dr].add_(torch.matmul(rows, rel_h))
        gqb[..., dr:].add_(torch.matmul(cols, rel_w))
    grh = rows.reshape(-1, rows.shape[-1]).t() @ qb[..., :dr].reshape(-1, dr)
    grw = cols.reshape(-1, cols.shape[-1]).t() @ qb[..., dr:].reshape(-1, qb.shape[-1] - dr)
    return gqb, grh, grw


def bmm_halo_attention(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride):
    """Batched matmuls with a hand-written backward (``impl="bmm"``), a route of
    :data:`~aadet.layers.functional.halo_attention.HALO_ATTENTION_BACKENDS`."""
    geo = halo_geometry(q.shape, k.shape, block_size, halo_size, query_stride)
    return _HaloBmm.apply(q, k, v, rel_h, rel_w, geo)
