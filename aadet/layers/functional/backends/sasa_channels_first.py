"""What the two channels-first SASA routes share (``"neighborhood"`` and ``"cpp"``): the layout
they work in and the relative-position terms of their logits and gradients.

Both write Eq. 3 as an autograd function on channels-first maps ``[N, d, H, W]`` (``N = B * Nh``)
and add the positional term of the logit of window offset ``o = a * k + c`` as ``row[:, a] +
col[:, c]``, where ``row = q[:, :dk//2] . rel_h`` and ``col = q[:, dk//2:] . rel_w`` are ``k``
dot products per pixel (:func:`relative_logit_terms`). In backward, the same terms give the
relative part of ``dL/dq`` and the embeddings' gradients from ``dL/dlogits``
(:func:`relative_gradients`).
"""
from typing import Callable, Optional, Tuple

import torch

__all__ = [
    "apply_channels_first",
    "relative_gradients",
    "relative_logit_terms",
    "relative_term_gradients",
]


def apply_channels_first(fn: Callable[..., torch.Tensor], q, k, v, rel_h, rel_w, *args):
    """Run ``fn(q, k, v, rel_h, rel_w, *args)`` (channels-first: ``[N, d, H, W]`` -> ``[N, dv,
    H, W]``) on ``q, k [B, Nh, H, W, dk]``, ``v [B, Nh, H, W, dv]``; returns ``[B, Nh, H, W,
    dv]``. The channels-first views are free when the inputs come from 1x1 convolutions
    (``split_heads``)."""
    b, nh, h, w, _ = q.shape
    dv = v.shape[-1]

    def channels_first(t):
        return t.permute(0, 1, 4, 2, 3).reshape(b * nh, t.shape[-1], h, w)

    out = fn(channels_first(q), channels_first(k), channels_first(v), rel_h, rel_w, *args)
    return out.view(b, nh, dv, h, w).permute(0, 1, 3, 4, 2)


def relative_logit_terms(q: torch.Tensor, rel_h: torch.Tensor, rel_w: torch.Tensor):
    """``(row, col)``, each ``[N, k, H, W]`` and contiguous: ``row[:, a] = q[:, :dk//2] . rel_h[a]``
    and ``col[:, c] = q[:, dk//2:] . rel_w[c]`` for channels-first ``q [N, dk, H, W]`` (one
    batched matmul each, on ``q``'s channel halves as they lie: no copy of ``q``; ``torch.matmul``
    would fold a 2D x 3D product into one ``[N HW, dk/2] x [dk/2, k]`` matmul, copying ``q``
    transposed, 20x slower at 4 channels a head)."""
    n, dk, h, w = q.shape
    dr = dk // 2
    q_flat = q.reshape(n, dk, h * w)
    row = torch.bmm(rel_h.expand(n, *rel_h.shape), q_flat[:, :dr])  # [N, k, HW]
    col = torch.bmm(rel_w.expand(n, *rel_w.shape), q_flat[:, dr:])
    return row.view(n, -1, h, w), col.view(n, -1, h, w)


def relative_gradients(glogits: torch.Tensor, q, rel_h, rel_w, gq, need_rel):
    """:func:`relative_term_gradients` from the logits' gradient ``glogits [N, k^2, H, W]`` (offset
    ``a * k + c``): the terms' gradients are its sums over the window's columns and rows."""
    ks = rel_h.shape[0]
    grid = glogits.unflatten(1, (ks, ks))  # [N, k, k, H, W]
    return relative_term_gradients(grid.sum(2), grid.sum(1), q, rel_h, rel_w, gq, need_rel)


def relative_term_gradients(
    grow: torch.Tensor,
    gcol: torch.Tensor,
    q: torch.Tensor,
    rel_h: torch.Tensor,
    rel_w: torch.Tensor,
    gq: Optional[torch.Tensor],
    need_rel: Tuple[bool, bool],
):
    """The relative terms' share of the gradients, from the gradients of the terms, ``grow =
    dL/drow`` and ``gcol = dL/dcol`` ``[N, k, H, W]`` (what the C++ kernel's recompute mode
    returns), and channels-first ``q [N, dk, H, W]``: adds ``dL/dq`` in place to ``gq`` (unless
    None) and returns ``(grad rel_h, grad rel_w)`` (None where ``need_rel`` says so).

    Batched matmuls over ``N`` on the maps as they lie (``gq``, contiguous, is added to in
    place): an einsum contracting over ``N, H, W`` first copies both operands into a layout with
    ``N`` beside the pixels (9x the time at 4 channels a head, 100x100).
    """
    n, dk, h, w = q.shape
    dr, ks = dk // 2, grow.shape[1]
    g_row, g_col = grow.reshape(n, ks, h * w), gcol.reshape(n, ks, h * w)
    if gq is not None:
        gq_flat = gq.view(n, dk, h * w)
        gq_flat[:, :dr].baddbmm_(rel_h.t().expand(n, dr, ks), g_row)
        gq_flat[:, dr:].baddbmm_(rel_w.t().expand(n, dk - dr, ks), g_col)
    q_flat = q.reshape(n, dk, h * w)
    grh = torch.bmm(g_row, q_flat[:, :dr].transpose(1, 2)).sum(0) if need_rel[0] else None
    grw = torch.bmm(g_col, q_flat[:, dr:].transpose(1, 2)).sum(0) if need_rel[1] else None
    return grh, grw
