"""Local (windowed) 2D self-attention with relative positions: the layer of SASA.

Paper: Ramachandran, Parmar, Vaswani, Bello, Levskaya, Shlens, "Stand-Alone Self-Attention in
Vision Models", NeurIPS 2019, Section 2.2, Equation 3. For an odd spatial extent
``k = 2r + 1`` the output of one head at pixel ``(y, x)`` of an ``[H, W]`` map is::

    out[y, x] = sum_{(y', x') in N(y, x)} softmax( q[y, x] . k[y', x']
                                                 + q[y, x, :dk//2] . rel_h[y' - y + r]
                                                 + q[y, x, dk//2:] . rel_w[x' - x + r] ) v[y', x']

    N(y, x) = {(y', x') inside the map : |y' - y| <= r, |x' - x| <= r}

Windows are centred on the pixel; neighbours outside the map are *excluded* from the softmax
(not zero-padded keys), so any ``H, W`` works, including maps smaller than the window. The row
and column offsets get embeddings of ``dk//2`` and ``dk - dk//2`` channels, dotted with the
matching halves of the query (the paper's concatenated ``r_{a-i, b-j}``). No scaling happens
here: the caller scales ``q``.

Two exact routes compute it (``impl``):

* ``"neighborhood"`` (the default on CPU): the ``k^2`` window offsets one at a time, as shifted
  views of the zero-padded key/value maps (no copy). Per offset, one pass over ``q`` gives that
  offset's logit for every pixel; row/column logits are ``k`` dot products per pixel, broadcast;
  out-of-map neighbours get ``-inf``; the softmax runs over the ``k^2`` offsets; the output is
  accumulated over the offsets in place. A custom autograd function writes the backward out the
  same way, so the only stored intermediate is the attention matrix itself, ``[N, k^2, H, W]``
  (what any exact backward needs, 49 floats per pixel and head for ``k = 7``); keys and values are
  never copied ``k^2`` times. Logits and softmax are float32 (float64 for float64 inputs).
  Work equals the papers' count (``2 k^2 dk`` per pixel and head) with no halo overhead, in
  memory-bound elementwise kernels: on CPU it is 1.3-1.8x faster than the blocked route at the
  res3-res5 sizes of a 640 image, with half its memory (BENCHMARKS.md).
* ``"fused"`` / ``"materialized"``: blocked attention with halos, as in the paper's TPU
  implementation and timm's ``HaloAttn``, but exact at the borders and for any size. ``"fused"``
  is the default on CUDA, where one fused kernel per layer should beat ``2 k^2`` elementwise
  launches (not yet measured on a GPU: ``tools/benchmark_layers.py --device cuda``):

  1. pad the map to multiples of a block ``bh x bw`` (``min(block_size, H or W)``); queries are
     the ``bh * bw`` pixels of a block; keys/values the ``(bh + 2r) x (bw + 2r)`` window around it
     (a "halo" unfold: ``(b + 2r)^2 / b^2`` copies of ``k`` and ``v``, never ``k^2``);
  2. everything positional is a *query-side table* over the window's rows (and one over its
     columns): ``T_row[i, u] = q_i[:dk//2] . rel_h[u - row(i)]`` when key row ``u`` is within
     ``r`` of the query's row *and* inside the map, ``MASK_VALUE`` otherwise (same for columns);
     the logit of key ``(u, u')`` is ``q.k + T_row[i, u] + T_col[i, u']``;
  3. :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables` adds the tables
     inside a fused SDPA kernel (``"fused"``) or an explicit float32 softmax (``"materialized"``);
  4. padded query positions are dropped.

  Every query's own position is always unmasked (padded queries too), so no softmax row is
  empty. The finite ``MASK_VALUE`` (-1e4) is exact as long as content logits stay far below 5e3
  in magnitude (they are O(1)-O(10) in trained models).

:func:`block_attention` is attention within non-overlapping ``b x b`` blocks (the SASA attention
stem, Section 3.2) on tensors already in block layout (``b^2`` keys per query: logits written out
with batched matmuls); :func:`block_self_attention_2d` is the same on ``[B, Nh, H, W, d]`` maps.
:func:`local_attention_probs_2d` returns the attention probabilities over each window (it does
store ``k^2`` values per pixel: an analysis/test helper, not a training path).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .logit_tables import MASK_VALUE, attention_with_logit_tables, is_exporting

__all__ = [
    "LOCAL_ATTENTION_IMPLS",
    "local_self_attention_2d",
    "block_attention",
    "add_block_relative_logits",
    "block_softmax",
    "map_to_blocks",
    "blocks_to_map",
    "block_padding_mask",
    "block_self_attention_2d",
    "local_attention_probs_2d",
]

# Allowed values of ``impl`` (the one definition; layers and the config import it).
LOCAL_ATTENTION_IMPLS = ("auto", "neighborhood", "fused", "materialized")


# ----------------------------------------------------------------------------- small helpers
def _check_qkv(q, k, v, rel_h, rel_w):
    if q.dim() != 5 or k.dim() != 5 or v.dim() != 5:
        raise ValueError(
            "q, k, v must be [B, Nh, H, W, d]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape; got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"v must be [B, Nh, H, W, dv] with q's first four dims {tuple(q.shape[:-1])}; "
            f"got {tuple(v.shape)}"
        )
    dk = q.shape[-1]
    if (rel_h is None) != (rel_w is None):
        raise ValueError("rel_h and rel_w must both be tensors or both be None")
    if rel_h is not None:
        if rel_h.dim() != 2 or rel_h.shape[1] != dk // 2:
            raise ValueError(f"rel_h must be [R, dk//2={dk // 2}]; got {tuple(rel_h.shape)}")
        if rel_w.dim() != 2 or rel_w.shape[1] != dk - dk // 2:
            raise ValueError(f"rel_w must be [R, dk - dk//2={dk - dk // 2}]; got {tuple(rel_w.shape)}")
        if rel_h.shape[0] != rel_w.shape[0]:
            raise ValueError(
                f"rel_h and rel_w must have the same number of rows; got {rel_h.shape[0]} and "
                f"{rel_w.shape[0]}"
            )


def _pad_map(x: torch.Tensor, hp: int, wp: int, halo: int) -> torch.Tensor:
    """``[N, H, W, d]`` -> ``[N, hp + 2 halo, wp + 2 halo, d]``, zeros around (``halo`` before)."""
    h, w = x.shape[1], x.shape[2]
    return F.pad(x, (0, 0, halo, wp - w + halo, halo, hp - h + halo))


def _query_blocks(x: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """``[N, hp, wp, d]`` -> ``[N, nby * nbx, bh * bw, d]`` (row-major pixels of each block)."""
    n, hp, wp, d = x.shape
    x = x.view(n, hp // bh, bh, wp // bw, bw, d).permute(0, 1, 3, 2, 4, 5)  # [N, nby, nbx, bh, bw, d]
    return x.reshape(n, (hp // bh) * (wp // bw), bh * bw, d)


def _halo_windows(x: torch.Tensor, bh: int, bw: int, halo: int) -> torch.Tensor:
    """``[N, hp + 2h, wp + 2h, d]`` -> ``[N, nby * nbx, (bh + 2h) * (bw + 2h), d]``.

    Windows of consecutive blocks overlap by ``2h`` rows/columns; the unfold is a view and the
    final reshape copies ``(bh + 2h)(bw + 2h) / (bh bw)`` times the map.
    """
    n, _, _, d = x.shape
    x = x.unfold(1, bh + 2 * halo, bh)  # [N, nby, Wp + 2h, d, bh + 2h]
    x = x.unfold(2, bw + 2 * halo, bw)  # [N, nby, nbx, d, bh + 2h, bw + 2h]
    nby, nbx = x.shape[1], x.shape[2]
    x = x.permute(0, 1, 2, 4, 5, 3)  # [N, nby, nbx, bh + 2h, bw + 2h, d]
    return x.reshape(n, nby * nbx, (bh + 2 * halo) * (bw + 2 * halo), d)


def _axis_validity(
    size: int, block: int, num_blocks: int, halo: int, radius: int, device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Along one axis: which window lines a query line may attend to, and their offset index.

    For block ``n``, query line ``i`` (in the block) and window line ``u`` (map line
    ``n * block - halo + u``), the relative index is ``t = u - i + radius - halo`` (the key-minus-
    query offset plus ``radius``). Returns ``valid [num_blocks, block, U]`` (``0 <= t <= 2 radius``
    and the key line inside the map, or ``u`` being the query's own line) and ``t [block, U]``.
    """
    win = block + 2 * halo
    i = torch.arange(block, device=device)[:, None]  # [block, 1]
    u = torch.arange(win, device=device)[None, :]  # [1, U]
    t = u - i + (radius - halo)  # [block, U]
    in_window = (t >= 0) & (t <= 2 * radius)  # [block, U]
    line = torch.arange(num_blocks, device=device)[:, None] * block - halo + u  # [nb, U]
    in_map = (line >= 0) & (line < size)  # [nb, U]
    own = (u == i + halo)  # [block, U]: the query's own line (also for padded queries)
    valid = (in_window[None] & in_map[:, None, :]) | own[None]  # [nb, block, U]
    return valid, t


def _axis_table(
    q_part: torch.Tensor,
    rel: Optional[torch.Tensor],
    valid: torch.Tensor,
    t: torch.Tensor,
    axis: str,
) -> torch.Tensor:
    """One query-side logit table over the window's rows (``axis="row"``) or columns.

    Args:
        q_part: ``[N, nby, nbx, bh, bw, dr]`` the query channels paired with ``rel``.
        rel: ``[R, dr]`` offset embeddings (``R = 2 radius + 1``) or None (no positional term).
        valid: ``[nb, b, U]`` from :func:`_axis_validity` (``nb, b`` = blocks/lines of ``axis``).
        t: ``[b, U]`` relative index of window line ``u`` for query line ``i``.

    Returns:
        ``[N, nby, nbx, bh, bw, U]``: ``q_part . rel[t]`` where valid, ``MASK_VALUE`` elsewhere.
    """
    if axis == "row":
        valid = valid[:, None, :, None, :]  # [nby, 1, bh, 1, U]
    else:
        valid = valid[None, :, None, :, :]  # [1, nbx, 1, bw, U]
    if rel is None:
        zero = torch.zeros((), dtype=q_part.dtype, device=q_part.device)
        table = torch.where(valid, zero, torch.full_like(zero, MASK_VALUE))
        return table.expand(*q_part.shape[:-1], valid.shape[-1])
    num_rel = rel.shape[0]
    logits = torch.matmul(q_part, rel.to(q_part.dtype).t())  # [N, nby, nbx, bh, bw, R]
    # One-hot E[i, t, u] = [t(i, u) == t] moves relative index t to window line u: an exact
    # 0/1 matmul (one nonzero per output), batched over the query line i.
    onehot = (t[:, None, :] == torch.arange(num_rel, device=t.device)[None, :, None])
    onehot = onehot.to(logits.dtype)  # [b, R, U]
    if axis == "row":
        table = torch.einsum("nyxijt,itu->nyxiju", logits, onehot)
    else:
        table = torch.einsum("nyxijt,jtu->nyxiju", logits, onehot)
    return torch.where(valid, table, torch.full_like(table[..., :1], MASK_VALUE))


def _blocked_attention(
    q, k, v, rel_h, rel_w, *, radius: int, halo: int, block_hw: Tuple[int, int], impl: str
) -> torch.Tensor:
    """Shared core: queries in ``bh x bw`` blocks, keys in the block plus ``halo``, keys further
    than ``radius`` (per axis) or outside the map masked. Shapes as in :func:`local_self_attention_2d`."""
    b, nh, h, w, dk = q.shape
    dv = v.shape[-1]
    bh, bw = block_hw
    nby, nbx = -(-h // bh), -(-w // bw)
    hp, wp = nby * bh, nbx * bw
    n = b * nh

    qb = _query_blocks(_pad_map(q.reshape(n, h, w, dk), hp, wp, 0), bh, bw)  # [N, nblk, bh*bw, dk]
    kb = _halo_windows(_pad_map(k.reshape(n, h, w, dk), hp, wp, halo), bh, bw, halo)  # [N, nblk, Lk, dk]
    vb = _halo_windows(_pad_map(v.reshape(n, h, w, dv), hp, wp, halo), bh, bw, halo)  # [N, nblk, Lk, dv]

    dev = q.device
    valid_r, t_r = _axis_validity(h, bh, nby, halo, radius, dev)  # [nby, bh, Uh], [bh, Uh]
    valid_c, t_c = _axis_validity(w, bw, nbx, halo, radius, dev)  # [nbx, bw, Uw], [bw, Uw]
    q6 = qb.view(n, nby, nbx, bh, bw, dk)
    dr = dk // 2
    row_t = _axis_table(q6[..., :dr], rel_h, valid_r, t_r, "row")  # [N, nby, nbx, bh, bw, Uh]
    col_t = _axis_table(q6[..., dr:], rel_w, valid_c, t_c, "col")  # [N, nby, nbx, bh, bw, Uw]
    uh, uw = bh + 2 * halo, bw + 2 * halo
    row_t = row_t.reshape(n, nby * nbx, bh * bw, uh)
    col_t = col_t.reshape(n, nby * nbx, bh * bw, uw)
    # Key l = u * Uw + u' of the window sits on window row u and window column u'.
    key_row = torch.arange(uh, device=dev).repeat_interleave(uw)  # [Lk]
    key_col = torch.arange(uw, device=dev).repeat(uh)  # [Lk]

    out = attention_with_logit_tables(
        qb, kb, vb, [row_t, col_t], [key_row, key_col], impl=impl
    )  # [N, nblk, bh*bw, dv]
    out = out.view(n, nby, nbx, bh, bw, dv).permute(0, 1, 3, 2, 4, 5).reshape(n, hp, wp, dv)
    return out[:, :h, :w].reshape(b, nh, h, w, dv)


def _check_kernel_size(kernel_size: int) -> int:
    if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be an odd integer >= 1; got {kernel_size!r}")
    return (kernel_size - 1) // 2


# ----------------------------------------------------------------------------- neighborhood route
def _window_mask(h: int, w: int, kernel_size: int, device, dtype) -> torch.Tensor:
    """``[k^2, H, W]``: 0 where offset ``(a, c)`` of pixel ``(y, x)`` lands inside the map, -inf
    elsewhere (offset index ``a * k + c`` is the key ``(y + a - r, x + c - r)``)."""
    r = kernel_size // 2
    off = torch.arange(kernel_size, device=device) - r
    rows = torch.arange(h, device=device)[None, :] + off[:, None]  # [k, H]
    cols = torch.arange(w, device=device)[None, :] + off[:, None]  # [k, W]
    inside = ((rows >= 0) & (rows < h))[:, None, :, None] & ((cols >= 0) & (cols < w))[None, :, None, :]
    mask = torch.zeros(inside.shape, device=device, dtype=dtype)
    return mask.masked_fill_(~inside, float("-inf")).view(kernel_size * kernel_size, h, w)


def _window_offsets(kernel_size: int, h: int, w: int):
    """``(o, rows, cols)`` per window offset: the slices of a map padded by ``r`` on every side
    that hold the key of offset ``o`` for each pixel."""
    for a in range(kernel_size):
        for c in range(kernel_size):
            yield a * kernel_size + c, slice(a, a + h), slice(c, c + w)


class _NeighborhoodAttention(torch.autograd.Function):
    """Eq. 3 on channels-first maps, offset by offset (see the module docstring).

    ``q, k [N, dk, H, W]``, ``v [N, dv, H, W]``, ``rel_h [k, dk//2]``, ``rel_w [k, dk - dk//2]``
    (or both None) -> ``[N, dv, H, W]``. Inputs of any float dtype; arithmetic in ``ct`` (float32,
    or float64 for float64 inputs) with autocast off, output in ``v``'s dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, kernel_size):
        dtypes = (q.dtype, k.dtype, v.dtype, None if rel_h is None else rel_h.dtype)
        ct = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(device_type=q.device.type, enabled=False):
            n, dk, h, w = q.shape
            r = kernel_size // 2
            q = q.to(ct)
            kp = F.pad(k.to(ct), (r, r, r, r))  # [N, dk, H + 2r, W + 2r]
            vp = F.pad(v.to(ct), (r, r, r, r))  # [N, dv, H + 2r, W + 2r]
            logits = torch.empty(n, kernel_size * kernel_size, h, w, dtype=ct, device=q.device)
            for o, ys, xs in _window_offsets(kernel_size, h, w):
                torch.sum(q * kp[:, :, ys, xs], dim=1, out=logits[:, o])
            if rel_h is not None:
                dr = dk // 2
                rel_h, rel_w = rel_h.to(ct), rel_w.to(ct)
                row = torch.einsum("ndhw,ad->nahw", q[:, :dr], rel_h)  # [N, k, H, W]
                col = torch.einsum("ndhw,cd->nchw", q[:, dr:], rel_w)  # [N, k, H, W]
                grid = logits.view(n, kernel_size, kernel_size, h, w)
                grid += row[:, :, None]
                grid += col[:, None, :]
            logits += _window_mask(h, w, kernel_size, q.device, ct)
            probs = torch.softmax(logits, dim=1)  # [N, k^2, H, W]; the centre is always in-map
            del logits
            out = torch.zeros(n, vp.shape[1], h, w, dtype=ct, device=q.device)
            for o, ys, xs in _window_offsets(kernel_size, h, w):
                out.addcmul_(probs[:, o:o + 1], vp[:, :, ys, xs])
        ctx.save_for_backward(q, kp, vp, probs, rel_h, rel_w)
        ctx.kernel_size = kernel_size
        ctx.dtypes = dtypes
        return out.to(dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        q, kp, vp, probs, rel_h, rel_w = ctx.saved_tensors
        ks = ctx.kernel_size
        r = ks // 2
        n, dk, h, w = q.shape
        inner = (slice(None), slice(None), slice(r, r + h), slice(r, r + w))
        need_q, need_k, need_v, need_rh, need_rw, _ = ctx.needs_input_grad
        gq = gk = gv = grh = grw = None
        with torch.autocast(device_type=q.device.type, enabled=False):
            g = grad_out.to(q.dtype)
            gprobs = torch.empty_like(probs)
            gvp = torch.zeros_like(vp) if need_v else None
            for o, ys, xs in _window_offsets(ks, h, w):
                torch.sum(g * vp[:, :, ys, xs], dim=1, out=gprobs[:, o])
                if need_v:
                    gvp[:, :, ys, xs].addcmul_(probs[:, o:o + 1], g)
            # softmax backward: dL/dlogit = p * (dL/dp - sum_o p dL/dp); masked entries have p = 0.
            glogits = probs * (gprobs - (probs * gprobs).sum(1, keepdim=True))
            del gprobs
            gq = torch.zeros_like(q) if need_q else None
            gkp = torch.zeros_like(kp) if need_k else None
            if need_q or need_k:
                for o, ys, xs in _window_offsets(ks, h, w):
                    if need_q:
                        gq.addcmul_(glogits[:, o:o + 1], kp[:, :, ys, xs])
                    if need_k:
                        gkp[:, :, ys, xs].addcmul_(glogits[:, o:o + 1], q)
            if need_k:
                gk = gkp[inner].to(ctx.dtypes[1])
            if rel_h is not None:
                dr = dk // 2
                grid = glogits.view(n, ks, ks, h, w)
                grow, gcol = grid.sum(2), grid.sum(1)  # [N, k, H, W] each
                if need_q:
                    gq[:, :dr] += torch.einsum("nahw,ad->ndhw", grow, rel_h)
                    gq[:, dr:] += torch.einsum("nchw,cd->ndhw", gcol, rel_w)
                if need_rh:
                    grh = torch.einsum("nahw,ndhw->ad", grow, q[:, :dr]).to(ctx.dtypes[3])
                if need_rw:
                    grw = torch.einsum("nchw,ndhw->cd", gcol, q[:, dr:]).to(ctx.dtypes[3])
            if need_q:
                gq = gq.to(ctx.dtypes[0])
            if need_v:
                gv = gvp[inner].to(ctx.dtypes[2])
        return gq, gk, gv, grh, grw, None


def _neighborhood_attention(q, k, v, rel_h, rel_w, kernel_size):
    """``[B, Nh, H, W, d]`` in and out; free views when the inputs come from 1x1 convolutions
    (``split_heads``): the heads' channels-first layout is what the kernel works in."""
    b, nh, h, w, dk = q.shape
    dv = v.shape[-1]

    def channels_first(t):
        return t.permute(0, 1, 4, 2, 3).reshape(b * nh, t.shape[-1], h, w)

    out = _NeighborhoodAttention.apply(
        channels_first(q), channels_first(k), channels_first(v), rel_h, rel_w, kernel_size
    )  # [B * Nh, dv, H, W]
    return out.view(b, nh, dv, h, w).permute(0, 1, 3, 4, 2)


# ----------------------------------------------------------------------------- block layout
def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    block_size: int,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
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
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")
    bs, p = block_size, block_size * block_size
    if q.dim() != 4 or q.shape[-2] != p or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"q, k must be [N, Nh, {p}, dk] and v [N, Nh, {p}, dv] for block_size={bs}; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    dk = q.shape[-1]
    if rel_h is not None and (rel_h.shape != (2 * bs - 1, dk // 2) or rel_w is None
                              or rel_w.shape != (2 * bs - 1, dk - dk // 2)):
        raise ValueError(
            f"rel_h/rel_w must be [{2 * bs - 1}, {dk // 2}] and [{2 * bs - 1}, {dk - dk // 2}]; got "
            f"{tuple(rel_h.shape)} and {None if rel_w is None else tuple(rel_w.shape)}"
        )
    ct = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qc = q.to(ct)
        logits = torch.matmul(qc, k.to(ct).transpose(-1, -2))  # [N, Nh, P, P]
        if rel_h is not None:
            dr = dk // 2
            row = torch.matmul(qc[..., :dr], rel_h.to(ct).t())  # [N, Nh, P, 2b - 1]
            col = torch.matmul(qc[..., dr:], rel_w.to(ct).t())
            logits = add_block_relative_logits(logits, row, col, bs)
        probs = block_softmax(logits, key_padding_mask)
        out = torch.matmul(probs, v.to(ct))
    return out.to(v.dtype)


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


# ----------------------------------------------------------------------------- public functions
def local_self_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    kernel_size: int,
    *,
    block_size: int = 8,
    impl: str = "auto",
) -> torch.Tensor:
    """SASA local self-attention over centred ``k x k`` windows clipped to the map (Eq. 3).

    Args:
        q: ``[B, Nh, H, W, dk]`` queries (already scaled).
        k: ``[B, Nh, H, W, dk]`` keys.
        v: ``[B, Nh, H, W, dv]`` values.
        rel_h: ``[kernel_size, dk//2]`` embeddings of the row offset ``y' - y`` (index
            ``y' - y + r``), or None together with ``rel_w`` (no positional term).
        rel_w: ``[kernel_size, dk - dk//2]`` embeddings of the column offset ``x' - x``.
        kernel_size: odd spatial extent ``k = 2r + 1``.
        block_size: query tile side ``b`` of the blocked routes (capped at ``H`` / ``W``); any
            value gives the same result, it trades the ``((b + 2r) / b)^2`` halo copies against
            the ``(b + 2r)^2`` keys every query of a tile scores.
        impl: ``"neighborhood"`` (offset by offset, float32 softmax), ``"fused"`` (blocked, SDPA)
            or ``"materialized"`` (blocked, explicit float32 softmax); ``"auto"`` picks
            ``"fused"`` on CUDA and ``"neighborhood"`` elsewhere (see the module docstring).

    Returns:
        ``[B, Nh, H, W, dv]``.
    """
    r = _check_kernel_size(kernel_size)
    _check_qkv(q, k, v, rel_h, rel_w)
    if rel_h is not None and rel_h.shape[0] != kernel_size:
        raise ValueError(
            f"rel_h/rel_w must have kernel_size={kernel_size} rows; got {rel_h.shape[0]}"
        )
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")
    if impl not in LOCAL_ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {LOCAL_ATTENTION_IMPLS}; got {impl!r}")
    if impl == "auto":
        if is_exporting():  # plain tensor ops only (no autograd.Function, no SDPA)
            impl = "materialized"
        else:
            impl = "fused" if q.device.type == "cuda" else "neighborhood"
    if impl == "neighborhood":
        return _neighborhood_attention(q, k, v, rel_h, rel_w, kernel_size)
    h, w = q.shape[2], q.shape[3]
    block_hw = (min(block_size, h), min(block_size, w))
    return _blocked_attention(q, k, v, rel_h, rel_w, radius=r, halo=r, block_hw=block_hw, impl=impl)


def block_self_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    block_size: int,
) -> torch.Tensor:
    """Self-attention within non-overlapping ``b x b`` blocks (the SASA attention stem).

    Pixel ``(y, x)`` attends to every in-map pixel of its block ``(y // b, x // b)``, with
    relative logits ``q[:dk//2] . rel_h[y' - y + b - 1] + q[dk//2:] . rel_w[x' - x + b - 1]``.
    Blocks are aligned to the map's top-left corner; the last row/column of blocks may be cut by
    the map's border (their missing pixels are excluded from the softmax). The map-layout form of
    :func:`block_attention` (which the stem calls directly, its projections already in blocks).

    Args:
        q, k: ``[B, Nh, H, W, dk]``; v: ``[B, Nh, H, W, dv]``.
        rel_h: ``[2b - 1, dk//2]`` or None (with ``rel_w``); rel_w: ``[2b - 1, dk - dk//2]``.
        block_size: ``b >= 1``.

    Returns:
        ``[B, Nh, H, W, dv]``.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")
    _check_qkv(q, k, v, rel_h, rel_w)
    if rel_h is not None and rel_h.shape[0] != 2 * block_size - 1:
        raise ValueError(
            f"rel_h/rel_w must have 2 * block_size - 1 = {2 * block_size - 1} rows; got {rel_h.shape[0]}"
        )
    bsz, nh, h, w, _ = q.shape

    def to_blocks(t):  # [B, Nh, H, W, d] -> [B * nblk, Nh, b*b, d]
        d = t.shape[-1]
        x = map_to_blocks(t.permute(0, 1, 4, 2, 3).reshape(bsz, nh * d, h, w), block_size)
        return x.view(x.shape[0], x.shape[1], nh, d).transpose(1, 2)

    mask = block_padding_mask((h, w), block_size, q.device)
    if mask is not None:
        mask = mask.repeat(bsz, 1, 1, 1)
    out = block_attention(to_blocks(q), to_blocks(k), to_blocks(v), rel_h, rel_w, block_size, mask)
    nblk, dv = out.shape[0], out.shape[-1]
    out = blocks_to_map(out.transpose(1, 2).reshape(nblk, block_size ** 2, nh * dv), bsz, (h, w), block_size)
    return out.reshape(bsz, nh, dv, h, w).permute(0, 1, 3, 4, 2)


def local_attention_probs_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    kernel_size: int,
) -> torch.Tensor:
    """Attention probabilities of :func:`local_self_attention_2d`, per window offset.

    Stores ``k^2`` probabilities per pixel (an analysis/test helper; computed in float32, or
    float64 for float64 inputs, with out-of-map neighbours at exactly 0).

    Returns:
        ``[B, Nh, H, W, k, k]``: ``p[..., y, x, a, c]`` is the weight of key ``(y + a - r, x + c - r)``.
    """
    r = _check_kernel_size(kernel_size)
    _check_qkv(q, k, k, rel_h, rel_w)
    b, nh, h, w, dk = q.shape
    ct = torch.promote_types(q.dtype, torch.float32)
    qc, kc = q.to(ct), k.to(ct)
    kp = F.pad(kc, (0, 0, r, r, r, r))  # [B, Nh, H + 2r, W + 2r, dk]
    kw = kp.unfold(2, kernel_size, 1).unfold(3, kernel_size, 1)  # [B, Nh, H, W, dk, k, k]
    logits = torch.einsum("bnyxd,bnyxdac->bnyxac", qc, kw)
    if rel_h is not None:
        dr = dk // 2
        logits = logits + torch.matmul(qc[..., :dr], rel_h.to(ct).t())[..., :, None]
        logits = logits + torch.matmul(qc[..., dr:], rel_w.to(ct).t())[..., None, :]
    off = torch.arange(kernel_size, device=q.device) - r
    rows = torch.arange(h, device=q.device)[:, None] + off[None, :]  # [H, k]
    cols = torch.arange(w, device=q.device)[:, None] + off[None, :]  # [W, k]
    in_map = ((rows >= 0) & (rows < h))[:, None, :, None] & ((cols >= 0) & (cols < w))[None, :, None, :]
    logits = logits.masked_fill(~in_map, float("-inf"))  # [.., H, W, k, k]; the centre is in-map
    probs = torch.softmax(logits.flatten(-2), dim=-1)
    return probs.view(b, nh, h, w, kernel_size, kernel_size)
