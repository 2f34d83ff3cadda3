"""HaloNet attention with its logits written out: the ``"materialized"`` route.

Computes :func:`~aadet.layers.functional.halo_attention.halo_attention_2d` on the block layout
of :mod:`.halonet_blocks`: per block one batched matmul for the content logits ``qb kb^T [N, nblk,
Pq, L]``, the row and column position tables added by broadcasting over the ``Uh x Uw`` window,
the keys outside the map set to ``-inf``, a softmax over the window and one batched matmul with
the values. Blocked attention is dense within a block, so these are ``Pq x d x L`` matmuls that
BLAS runs near full rate; autograd differentiates them (saving the block copies and the softmax
output, ``N nblk Pq L`` values: ``(b + 2h)^2`` per query).

Arithmetic in float32 with autocast off, or float64 for float64 inputs; output in ``v``'s dtype.
Plain differentiable tensor ops only (the windows gathered by index while exporting), so it
exports.
"""
import torch

from .halonet_blocks import (
    HaloGeometry,
    halo_geometry,
    halo_key_validity,
    halo_key_windows,
    halo_query_blocks,
    halo_relative_tables,
    halo_unblock,
)

__all__ = ["halo_logits", "materialized_halo_attention"]


def halo_logits(q, k, rel_h, rel_w, geo: HaloGeometry) -> torch.Tensor:
    """``[N, nblk, Pq, L]`` logits of every block's queries over its window, keys outside the map
    at ``-inf``, in ``q``'s dtype (the caller casts). Arguments as
    :func:`materialized_halo_attention`'s."""
    qb = halo_query_blocks(q, geo)  # [N, nblk, Pq, d]
    kb = halo_key_windows(k, geo)  # [N, nblk, L, d]
    logits = torch.matmul(qb, kb.transpose(-1, -2))  # [N, nblk, Pq, L]
    if rel_h is not None:
        row, col = halo_relative_tables(qb, rel_h, rel_w, geo)  # [N, nblk, Pq, Uh], [.., Uw]
        uh, uw = geo.window
        logits = logits.view(*logits.shape[:-1], uh, uw) + row[..., :, None] + col[..., None, :]
        logits = logits.flatten(-2)
    valid = halo_key_validity(geo, q.device)  # [nblk, L] or None
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return logits


def materialized_halo_attention(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride):
    """Explicit logits and softmax (``impl="materialized"``) on checked arguments: ``q [B, Nh,
    ceil(H/s), ceil(W/s), d]``, ``k [B, Nh, H, W, d]``, ``v [B, Nh, H, W, dv]``, ``rel_h [2(b + h)
    - 1, d//2]``, ``rel_w [2(b + h) - 1, d - d//2]`` (or both None) -> ``[B, Nh, ceil(H/s),
    ceil(W/s), dv]``."""
    geo = halo_geometry(q.shape, k.shape, block_size, halo_size, query_stride)
    ct = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for references
    with torch.autocast(device_type=q.device.type, enabled=False):
        if rel_h is not None:
            rel_h, rel_w = rel_h.to(ct), rel_w.to(ct)
        probs = torch.softmax(halo_logits(q.to(ct), k.to(ct), rel_h, rel_w, geo), dim=-1)
        out = torch.matmul(probs, halo_key_windows(v.to(ct), geo))  # [N, nblk, Pq, dv]
    return halo_unblock(out, geo).to(v.dtype)
