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

from ..precision import compute_dtype
from .halonet_blocks import HaloGeometry, halo_block_terms, halo_geometry, halo_key_windows, halo_unblock

__all__ = ["halo_logits", "halo_probs", "materialized_halo_attention"]


def halo_logits(q, k, rel_h, rel_w, geo: HaloGeometry) -> torch.Tensor:
    """``[N, nblk, Pq, L]`` logits of every block's queries over its window, keys outside the map
    at ``-inf``, in ``q``'s dtype (the caller casts); ``q, k, rel_h, rel_w`` as for
    :func:`~aadet.layers.functional.halo_attention.halo_attention_2d`."""
    qb, kb, row, col, valid = halo_block_terms(q, k, rel_h, rel_w, geo)
    logits = torch.matmul(qb, kb.transpose(-1, -2))  # [N, nblk, Pq, L]
    if row is not None:
        uh, uw = geo.window
        logits = logits.view(*logits.shape[:-1], uh, uw) + row[..., :, None] + col[..., None, :]
        logits = logits.flatten(-2)
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return logits


def halo_probs(q, k, rel_h, rel_w, geo: HaloGeometry) -> torch.Tensor:
    """The softmax of :func:`halo_logits` in the compute dtype (:mod:`..precision`); call it with
    autocast off."""
    ct = compute_dtype(q.dtype)
    if rel_h is not None:
        rel_h, rel_w = rel_h.to(ct), rel_w.to(ct)
    return torch.softmax(halo_logits(q.to(ct), k.to(ct), rel_h, rel_w, geo), dim=-1)


def materialized_halo_attention(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride):
    """Explicit logits and softmax (``impl="materialized"``), a route of
    :data:`~aadet.layers.functional.halo_attention.HALO_ATTENTION_BACKENDS`."""
    geo = halo_geometry(q.shape, k.shape, block_size, halo_size, query_stride)
    with torch.autocast(device_type=q.device.type, enabled=False):
        probs = halo_probs(q, k, rel_h, rel_w, geo)
        out = torch.matmul(probs, halo_key_windows(v.to(probs.dtype), geo))  # [N, nblk, Pq, dv]
    return halo_unblock(out, geo).to(v.dtype)
