"""Attention within non-overlapping ``b x b`` blocks: the attention of SASA's stem.

Paper: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019,
Section 3.2. Pixel ``(y, x)`` attends to every in-map pixel of its block ``(y // b, x // b)``
with SASA's relative logits (offsets ``-(b-1) .. b-1``)::

    logit = q . k' + q[:dk//2] . rel_h[y' - y + b - 1] + q[dk//2:] . rel_w[x' - x + b - 1]

With only ``b^2`` keys per query (16 for the stem's ``b = 4``), logits and the float32 softmax
are written out with batched matmuls: plain tensor ops, so the stem traces and exports as is.

* :func:`block_attention`: on tensors already in block layout ``[N blocks, Nh, b*b, d]`` (what
  :class:`~aadet.layers.SpatiallyAwareAttentionStem` calls, its projections computed in blocks);
  :func:`add_block_relative_logits` and :func:`block_softmax` are its two steps, shared with the
  stem's factorized route; :func:`block_attention_probs` returns its probabilities (analysis);
* :func:`map_to_blocks` / :func:`blocks_to_map` / :func:`block_padding_mask`: the block layout
  (zero-padded to multiples of ``b``; padded pixels are masked out of the softmax);
* :func:`block_self_attention_2d`: the same attention on ``[B, Nh, H, W, d]`` maps.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .checks import check_block_attention, check_block_map
from .precision import compute_dtype

__all__ = [
    "add_block_relative_logits",
    "block_attention",
    "block_attention_unchecked",
    "block_attention_probs",
    "block_padding_mask",
    "block_self_attention_2d",
    "block_softmax",
    "blocks_to_map",
    "map_to_blocks",
]


def block_attention(q, k, v, rel_h, rel_w, block_size: int, key_padding_mask=None) -> torch.Tensor:
    """Attention among the ``b x b`` pixels of each block, on tensors in block layout.

    The logit of query pixel ``(a, c)`` and key pixel ``(a', c')`` of a block is
    ``q . k + q[:dk//2] . rel_h[a' - a + b - 1] + q[dk//2:] . rel_w[c' - c + b - 1]``; with only
    ``b^2`` keys per query, logits and the float32 softmax are written out (batched matmuls).

    Args:
        q, k: ``[N, Nh, b*b, dk]`` (``N`` blocks; pixels of a block row-major); v: ``[N, Nh, b*b, dv]``.
        rel_h: ``[2b - 1, dk//2]`` or None (with ``rel_w``); rel_w: ``[2b - 1, dk - dk//2]``.
        block_size: ``b``.
        key_padding_mask: optional bool, broadcastable to ``[N, 1, 1, b*b]``: True for keys to
            exclude (pixels outside the map in blocks cut by its border). Every block must keep
            at least one key.

    Returns:
        ``[N, Nh, b*b, dv]`` in ``v``'s dtype.
    """
    check_block_attention(q, k, v, rel_h, rel_w, block_size)
    return block_attention_unchecked(q, k, v, rel_h, rel_w, block_size, key_padding_mask)


def block_attention_unchecked(q, k, v, rel_h, rel_w, block_size: int, key_padding_mask=None) -> torch.Tensor:
    """:func:`block_attention` on arguments its caller has checked or made itself (the stem's
    forward, :func:`block_self_attention_2d`)."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        probs = _block_probs(q, k, rel_h, rel_w, block_size, key_padding_mask)  # [N, Nh, P, P]
        out = torch.matmul(probs, v.to(probs.dtype))
    return out.to(v.dtype)


def block_attention_probs(q, k, rel_h, rel_w, block_size: int, key_padding_mask=None) -> torch.Tensor:
    """The attention probabilities of :func:`block_attention` (its arguments but ``v``; an
    analysis/test helper).

    Returns:
        ``[N, Nh, b*b, b*b]`` (query pixel, key pixel; row-major in the block), float32 (float64
        for float64 inputs); padded keys at exactly 0.
    """
    check_block_attention(q, k, k, rel_h, rel_w, block_size)
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _block_probs(q, k, rel_h, rel_w, block_size, key_padding_mask)


def _block_probs(q, k, rel_h, rel_w, block_size: int, key_padding_mask) -> torch.Tensor:
    """Softmax of the block logits on checked arguments (autocast off), ``[N, Nh, P, P]``."""
    ct = compute_dtype(q.dtype)
    qc = q.to(ct)
    logits = torch.matmul(qc, k.to(ct).transpose(-1, -2))  # [N, Nh, P, P]
    if rel_h is not None:
        dr = q.shape[-1] // 2
        row = torch.matmul(qc[..., :dr], rel_h.to(ct).t())  # [N, Nh, P, 2b - 1]
        col = torch.matmul(qc[..., dr:], rel_w.to(ct).t())
        logits = add_block_relative_logits(logits, row, col, block_size)
    return block_softmax(logits, key_padding_mask)


def add_block_relative_logits(
    logits: torch.Tensor, row: torch.Tensor, col: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``logits[..., (a, c), (a', c')] + row[..., (a, c), a' - a + b - 1] + col[..., (a, c), c' - c + b - 1]``.

    Args:
        logits: ``[..., b*b, b*b]`` content logits of a block (query pixel, key pixel; row-major).
        row, col: ``[..., b*b, 2b - 1]`` each query's logit for every row / column offset.
    """
    bs, p = block_size, block_size * block_size
    a = torch.arange(bs, device=logits.device)
    rel = a[None, :] - a[:, None] + bs - 1  # [query line, key line] -> table row
    idx_row = rel[:, None, :].expand(bs, bs, bs).reshape(p, bs)  # query (a, c) -> key row a'
    idx_col = rel[None, :, :].expand(bs, bs, bs).reshape(p, bs)  # query (a, c) -> key column c'
    row = torch.gather(row, -1, idx_row.expand(*row.shape[:-1], bs))  # [..., P, b]
    col = torch.gather(col, -1, idx_col.expand(*col.shape[:-1], bs))
    out = logits.view(*logits.shape[:-1], bs, bs) + row[..., :, None] + col[..., None, :]
    return out.flatten(-2)


def block_softmax(logits: torch.Tensor, key_padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax over the keys of a block, padded keys (``key_padding_mask`` True) at exactly 0."""
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


def map_to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B * nby * nbx, b*b, C]``, zero-padded to multiples of ``b`` (a copy)."""
    bsz, c, h, w = x.shape
    s = block_size
    nby, nbx = -(-h // s), -(-w // s)
    x = F.pad(x, (0, nbx * s - w, 0, nby * s - h)).view(bsz, c, nby, s, nbx, s)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(bsz * nby * nbx, s * s, c)


def blocks_to_map(x: torch.Tensor, batch: int, hw: Tuple[int, int], block_size: int) -> torch.Tensor:
    """Inverse of :func:`map_to_blocks`: ``[B * nby * nbx, b*b, C]`` -> ``[B, C, H, W]`` (one copy,
    then cropped to ``H x W``)."""
    h, w = hw
    s = block_size
    nby, nbx = -(-h // s), -(-w // s)
    c = x.shape[-1]
    x = x.view(batch, nby, nbx, s, s, c).permute(0, 5, 1, 3, 2, 4).reshape(batch, c, nby * s, nbx * s)
    return x[:, :, :h, :w]


def block_padding_mask(hw: Tuple[int, int], block_size: int, device=None) -> Optional[torch.Tensor]:
    """``[nby * nbx, 1, 1, b*b]`` bool, True for block pixels outside an ``H x W`` map (None when
    ``b`` divides both sides). Repeat over the batch as ``mask.repeat(B, 1, 1, 1)``, or view the
    blocks as ``[B, nby * nbx, ...]``."""
    h, w = hw
    s = block_size
    nby, nbx = -(-h // s), -(-w // s)
    if nby * s == h and nbx * s == w:
        return None
    rows = torch.arange(nby * s, device=device).view(nby, s) >= h  # [nby, b]
    cols = torch.arange(nbx * s, device=device).view(nbx, s) >= w  # [nbx, b]
    out = rows[:, None, :, None] | cols[None, :, None, :]  # [nby, nbx, b, b]
    return out.view(nby * nbx, 1, 1, s * s)


def block_self_attention_2d(q, k, v, rel_h, rel_w, block_size: int) -> torch.Tensor:
    """Self-attention within non-overlapping ``b x b`` blocks (the SASA attention stem).

    Pixel ``(y, x)`` attends to every in-map pixel of its block ``(y // b, x // b)``, with
    relative logits ``q[:dk//2] . rel_h[y' - y + b - 1] + q[dk//2:] . rel_w[x' - x + b - 1]``.
    Blocks are aligned to the map's top-left corner; the last row/column of blocks may be cut by
    the map's border (their missing pixels are excluded from the softmax). The map-layout form of
    :func:`block_attention` (which the stem calls directly, its projections already in blocks).

    Arguments as :func:`block_attention`'s, on maps: ``q, k [B, Nh, H, W, dk]``, ``v [B, Nh, H,
    W, dv]`` -> ``[B, Nh, H, W, dv]``.
    """
    check_block_map(q, k, v, rel_h, rel_w, block_size)
    bsz, nh, h, w, _ = q.shape

    def to_blocks(t):  # [B, Nh, H, W, d] -> [B * nblk, Nh, b*b, d]
        d = t.shape[-1]
        x = map_to_blocks(t.permute(0, 1, 4, 2, 3).reshape(bsz, nh * d, h, w), block_size)
        return x.view(x.shape[0], x.shape[1], nh, d).transpose(1, 2)

    mask = block_padding_mask((h, w), block_size, q.device)
    if mask is not None:
        mask = mask.repeat(bsz, 1, 1, 1)
    out = block_attention_unchecked(to_blocks(q), to_blocks(k), to_blocks(v), rel_h, rel_w, block_size, mask)
    nblk, dv = out.shape[0], out.shape[-1]
    out = blocks_to_map(out.transpose(1, 2).reshape(nblk, block_size ** 2, nh * dv), bsz, (h, w), block_size)
    return out.reshape(bsz, nh, dv, h, w).permute(0, 1, 3, 4, 2)
