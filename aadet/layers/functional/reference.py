"""Brute-force references: the papers' formulas written out, slow and float64-friendly.

Every implementation in this package is tested against these (``tests/layers/test_*attention*.py``),
and ``dev/benchmark_layers.py`` times the straightforward ones against ours. Nothing here is
used by the layers.

* AA (global relative attention, Bello et al. 2019, Sec. 3.2):
  :func:`relative_logits_2d_reference` / :func:`relative_self_attention_2d_reference`, one query
  pixel and one key pixel at a time; :func:`paper_relative_self_attention_2d`, a line-by-line
  PyTorch port of the paper's TensorFlow (Appendix A.3, Figures 7-8: ``rel_to_abs``,
  ``relative_logits_1d`` tiled to the full ``[B, Nh, HW, HW]`` logits).
* SASA local attention (Ramachandran et al. 2019, Eq. 3):
  :func:`local_self_attention_2d_reference`, pixel by pixel over the in-map part of each
  window; :func:`local_self_attention_2d_unfold`, the same with ``F.unfold`` (every pixel's
  ``k x k`` keys and values copied, ``k^2`` times the map).
* SASA stem (Sec. 3.2): :func:`block_self_attention_2d_reference`, pixel by pixel within
  non-overlapping ``b x b`` blocks.
* HaloNet blocked local attention (Vaswani et al. 2021, Sec. 2.2, Figure 1):
  :func:`halo_attention_2d_reference`, pixel by pixel over the in-map part of each block's
  haloed window, strided queries (attention downsampling) included.
* CCNet criss-cross attention (Huang et al. 2019, Sec. 3.2):
  :func:`criss_cross_attention_2d_reference`, pixel by pixel over the pixel's column and row,
  the pixel itself once.

The pixel-loop references compute in float64 and return float64 (gradients flow through them);
the vectorized ones compute in their inputs' dtype. Shapes and offset conventions are those of
the functions they check (``q`` already scaled, ``[B, Nh, H, W, d]`` maps).
"""
import itertools

import torch
import torch.nn.functional as F

__all__ = [
    "block_self_attention_2d_reference",
    "criss_cross_attention_2d_reference",
    "halo_attention_2d_reference",
    "local_self_attention_2d_reference",
    "local_self_attention_2d_unfold",
    "paper_rel_to_abs",
    "paper_relative_logits",
    "paper_relative_logits_1d",
    "paper_relative_self_attention_2d",
    "relative_logits_2d_reference",
    "relative_self_attention_2d_reference",
]

D = torch.float64


# ----------------------------------------------------------------------------- AA
def relative_logits_2d_reference(q, k, rel_h, rel_w):
    """``[B, Nh, H, W, H, W]`` float64 logits, one query pixel and one key pixel at a time:
    ``q.k + q.rel_h[y'-y+H-1] + q.rel_w[x'-x+W-1]`` (either embedding may be None)."""
    q, k = q.double(), k.double()
    b, nh, h, w, _ = q.shape
    out = torch.zeros(b, nh, h, w, h, w, dtype=torch.float64)
    for y in range(h):
        for x in range(w):
            for yy in range(h):
                for xx in range(w):
                    logit = (q[:, :, y, x] * k[:, :, yy, xx]).sum(-1)
                    if rel_h is not None:
                        logit = logit + (q[:, :, y, x] * rel_h.double()[yy - y + h - 1]).sum(-1)
                    if rel_w is not None:
                        logit = logit + (q[:, :, y, x] * rel_w.double()[xx - x + w - 1]).sum(-1)
                    out[:, :, y, x, yy, xx] = logit
    return out


def relative_self_attention_2d_reference(q, k, v, rel_h, rel_w, queries=None):
    """AA's global attention in float64 from :func:`relative_logits_2d_reference`:
    ``[B, Nh, H, W, dv]``; with ``queries`` (``(y, x)`` pixels) only those, ``[B, Nh, n, dv]``,
    each from its own logits against every key (:func:`_relative_query_reference`: maps too
    large for every pair)."""
    if queries is not None:
        return torch.stack([_relative_query_reference(q, k, v, rel_h, rel_w, y, x) for y, x in queries], dim=2)
    b, nh, h, w, _ = q.shape
    logits = relative_logits_2d_reference(q, k, rel_h, rel_w).reshape(b, nh, h, w, h * w)
    weights = torch.softmax(logits, dim=-1)
    return torch.einsum("bnyxj,bnjd->bnyxd", weights, v.double().reshape(b, nh, h * w, -1))

def _relative_query_reference(q, k, v, rel_h, rel_w, y, x):
    """``[B, Nh, dv]``: query ``(y, x)`` against every key ``(y', x')``: ``q.k + q.rel_h[y'-y+H-1]
    + q.rel_w[x'-x+W-1]``, softmax over the keys, values summed (float64)."""
    b, nh, h, w, _ = q.shape
    qi = q[:, :, y, x].double()  # [B, Nh, d]
    logits = torch.einsum("bnd,bnhwd->bnhw", qi, k.double())
    if rel_h is not None:
        logits = logits + (qi @ rel_h.double()[h - 1 - y: 2 * h - 1 - y].T)[:, :, :, None]  # rows y' = 0..H-1
    if rel_w is not None:
        logits = logits + (qi @ rel_w.double()[w - 1 - x: 2 * w - 1 - x].T)[:, :, None, :]
    p = torch.softmax(logits.reshape(b, nh, h * w), dim=-1)
    return torch.einsum("bnj,bnjd->bnd", p, v.double().reshape(b, nh, h * w, -1))


def paper_rel_to_abs(x):
    """Port of the paper's ``rel_to_abs`` (``tf.concat`` -> ``torch.cat``, same reshapes)."""
    B, Nh, L, _ = x.shape
    col_pad = torch.zeros((B, Nh, L, 1), dtype=x.dtype, device=x.device)
    x = torch.cat([x, col_pad], dim=3)
    flat_x = torch.reshape(x, [B, Nh, L * 2 * L])
    flat_pad = torch.zeros((B, Nh, L - 1), dtype=x.dtype, device=x.device)
    flat_x_padded = torch.cat([flat_x, flat_pad], dim=2)
    final_x = torch.reshape(flat_x_padded, [B, Nh, L + 1, 2 * L - 1])
    final_x = final_x[:, :, :L, L - 1:]
    return final_x


def paper_relative_logits_1d(q, rel_k, H, W, Nh, transpose_mask):
    """Port of the paper's ``relative_logits_1d`` (``tf.tile`` -> ``repeat``)."""
    rel_logits = torch.einsum("bhxyd,md->bhxym", q, rel_k)
    rel_logits = torch.reshape(rel_logits, [-1, Nh * H, W, 2 * W - 1])
    rel_logits = paper_rel_to_abs(rel_logits)
    rel_logits = torch.reshape(rel_logits, [-1, Nh, H, W, W])
    rel_logits = torch.unsqueeze(rel_logits, dim=3)
    rel_logits = rel_logits.repeat(1, 1, 1, H, 1, 1)
    rel_logits = rel_logits.permute(*transpose_mask)
    rel_logits = torch.reshape(rel_logits, [-1, Nh, H * W, H * W])
    return rel_logits


def paper_relative_logits(q, rel_embeddings_h, rel_embeddings_w):
    """Port of the paper's ``relative_logits`` with the embeddings passed in.

    Offset convention: the TF tables are indexed ``m = (key - query) + L - 1`` (``rel_to_abs``
    maps column ``j`` of query row ``i`` to ``m = j - i + L - 1``; the caption's
    ``r_{l-i}``), i.e. the same rows as our ``rel_h``/``rel_w``, so they are passed unchanged.
    """
    _, Nh, H, W, _ = q.shape
    rel_logits_w = paper_relative_logits_1d(q, rel_embeddings_w, H, W, Nh, [0, 1, 2, 4, 3, 5])
    rel_logits_h = paper_relative_logits_1d(
        q.permute(0, 1, 3, 2, 4), rel_embeddings_h, W, H, Nh, [0, 1, 4, 2, 5, 3]
    )
    return rel_logits_h, rel_logits_w


def paper_relative_self_attention_2d(q, k, v, rel_h, rel_w):
    """The attention part of the paper's ``self_attention_2d`` (q already scaled): full
    ``[B, Nh, HW, HW]`` logits plus the tiled relative logits, softmax, weighted sum, all stored
    for backward. ``rel_h``, ``rel_w`` both tensors or both None (no position term)."""
    B, Nh, H, W, dkh = q.shape
    flat = lambda x, d: torch.reshape(x, [-1, Nh, H * W, d])  # noqa: E731
    logits = torch.matmul(flat(q, dkh), flat(k, dkh).transpose(-1, -2))
    if rel_h is not None:
        rel_logits_h, rel_logits_w = paper_relative_logits(q, rel_h, rel_w)
        logits = logits + rel_logits_h + rel_logits_w
    weights = torch.softmax(logits, dim=-1)
    attn_out = torch.matmul(weights, flat(v, v.shape[-1]))
    return torch.reshape(attn_out, [-1, Nh, H, W, v.shape[-1]])


# ----------------------------------------------------------------------------- SASA
def local_self_attention_2d_reference(q, k, v, rel_h, rel_w, kernel_size, queries=None):
    """Eq. 3 pixel by pixel in float64: softmax over the in-map part of the centred window;
    ``[B, Nh, H, W, dv]``, or with ``queries`` (``(y, x)`` pixels) only those, ``[B, Nh, n, dv]``."""
    b, nh, h, w, dk = q.shape
    r = kernel_size // 2
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(b, nh, h, w, v.shape[-1], dtype=D)
    for bi, n, y, x in _pixels(b, nh, h, w, queries):
        logits, values = [], []
        for yy in range(max(0, y - r), min(h, y + r + 1)):
            for xx in range(max(0, x - r), min(w, x + r + 1)):
                logit = q[bi, n, y, x] @ k[bi, n, yy, xx]
                if rel_h is not None:
                    logit = logit + q[bi, n, y, x, : dk // 2] @ rel_h[yy - y + r].double()
                    logit = logit + q[bi, n, y, x, dk // 2:] @ rel_w[xx - x + r].double()
                logits.append(logit)
                values.append(v[bi, n, yy, xx])
        p = torch.softmax(torch.stack(logits), 0)
        out[bi, n, y, x] = (p[:, None] * torch.stack(values)).sum(0)
    return _at(out, queries)


def _pixels(b, nh, h, w, queries):
    """Every ``(image, head, y, x)`` of a map, or those of the pixels ``queries``."""
    pixels = itertools.product(range(h), range(w)) if queries is None else queries
    return ((bi, n, y, x) for y, x in pixels for bi in range(b) for n in range(nh))


def _at(out, queries):
    """``out [B, Nh, H, W, dv]``, or its pixels ``queries`` as ``[B, Nh, n, dv]``."""
    return out if queries is None else torch.stack([out[:, :, y, x] for y, x in queries], dim=2)


def local_self_attention_2d_unfold(q, k, v, rel_h, rel_w, kernel_size):
    """Eq. 3 with ``F.unfold``: the ``k x k`` keys and values of every pixel copied
    (``[B, Nh, d, k^2, HW]``), out-of-map neighbours masked out of the softmax. Vectorized (the
    benchmark's straightforward implementation); ``[B, Nh, H, W, dv]`` in ``q``'s dtype."""
    b, nh, h, w, dk = q.shape
    ks, r, n = kernel_size, kernel_size // 2, h * w

    def windows(t):  # [B, Nh, H, W, c] -> [B, Nh, c, k^2, HW]
        c = t.shape[-1]
        x = t.permute(0, 1, 4, 2, 3).reshape(b, nh * c, h, w)
        return F.unfold(x, ks, padding=r).view(b, nh, c, ks * ks, n)

    qf = q.permute(0, 1, 4, 2, 3).reshape(b, nh, dk, n)  # [B, Nh, dk, HW]
    logits = torch.einsum("bndp,bndkp->bnkp", qf, windows(k))  # [B, Nh, k^2, HW]
    if rel_h is not None:
        dr = dk // 2
        rh = torch.einsum("bndp,ad->bnap", qf[:, :, :dr], rel_h)  # [B, Nh, k, HW] row offsets
        rw = torch.einsum("bndp,cd->bncp", qf[:, :, dr:], rel_w)  # [B, Nh, k, HW] col offsets
        logits = logits + (rh[:, :, :, None] + rw[:, :, None, :]).reshape(b, nh, ks * ks, n)
    inside = F.unfold(torch.ones(1, 1, h, w, dtype=q.dtype, device=q.device), ks, padding=r) > 0
    logits = logits.masked_fill(~inside[:, None], float("-inf"))  # inside: [1, k^2, HW]
    weights = torch.softmax(logits, dim=2)
    out = torch.einsum("bnkp,bndkp->bndp", weights, windows(v))  # [B, Nh, dv, HW]
    return out.reshape(b, nh, -1, h, w).permute(0, 1, 3, 4, 2)


# ----------------------------------------------------------------------------- SASA stem
def block_self_attention_2d_reference(q, k, v, rel_h, rel_w, block_size):
    """Every pixel attends to the in-map pixels of its own ``b x b`` block (float64, pixel loop),
    relative logits ``q[:dk//2] . rel_h[y'-y+b-1] + q[dk//2:] . rel_w[x'-x+b-1]``."""
    b = block_size
    bsz, nh, h, w, dk = q.shape
    out = torch.zeros(bsz, nh, h, w, v.shape[-1], dtype=D)
    for bi, n, y, x in itertools.product(range(bsz), range(nh), range(h), range(w)):
        y0, x0 = y // b * b, x // b * b
        logits, values = [], []
        for yy in range(y0, min(h, y0 + b)):
            for xx in range(x0, min(w, x0 + b)):
                logit = q[bi, n, y, x].double() @ k[bi, n, yy, xx].double()
                if rel_h is not None:
                    logit = logit + q[bi, n, y, x, : dk // 2].double() @ rel_h[yy - y + b - 1].double()
                    logit = logit + q[bi, n, y, x, dk // 2:].double() @ rel_w[xx - x + b - 1].double()
                logits.append(logit)
                values.append(v[bi, n, yy, xx].double())
        p = torch.softmax(torch.stack(logits), 0)
        out[bi, n, y, x] = (p[:, None] * torch.stack(values)).sum(0)
    return out


# ----------------------------------------------------------------------------- HaloNet
def halo_attention_2d_reference(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride=1, queries=None):
    """HaloNet's blocked local attention pixel by pixel in float64 (with ``queries``, ``(y', x')``
    pixels of the output grid, only those: ``[B, Nh, n, dv]``).

    The query at ``(y', x')`` of the ``[ceil(H/s), ceil(W/s)]`` output grid (``s = query_stride``)
    sits at input pixel ``(y, x) = (s y', s x')``; it attends to the in-map keys ``(a, c)`` of its
    block's window, rows ``[y // b * b - h, y // b * b + b + h)`` and columns likewise, with
    ``logit = q . k + q[:d//2] . rel_h[a - y + b + h - 1] + q[d//2:] . rel_w[c - x + b + h - 1]``
    (``b = block_size``, ``h = halo_size``; ``rel_h``/``rel_w`` both None: content only).
    """
    bs, hs, s = block_size, halo_size, query_stride
    bsz, nh, ho, wo, d = q.shape
    h, w = k.shape[2], k.shape[3]
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(bsz, nh, ho, wo, v.shape[-1], dtype=D)
    for bi, n, yo, xo in _pixels(bsz, nh, ho, wo, queries):
        y, x = s * yo, s * xo
        y0, x0 = y // bs * bs, x // bs * bs
        qi = q[bi, n, yo, xo]
        logits, values = [], []
        for a in range(max(0, y0 - hs), min(h, y0 + bs + hs)):
            for c in range(max(0, x0 - hs), min(w, x0 + bs + hs)):
                logit = qi @ k[bi, n, a, c]
                if rel_h is not None:
                    logit = logit + qi[: d // 2] @ rel_h[a - y + bs + hs - 1].double()
                    logit = logit + qi[d // 2:] @ rel_w[c - x + bs + hs - 1].double()
                logits.append(logit)
                values.append(v[bi, n, a, c])
        p = torch.softmax(torch.stack(logits), 0)
        out[bi, n, yo, xo] = (p[:, None] * torch.stack(values)).sum(0)
    return _at(out, queries)


# ----------------------------------------------------------------------------- CCNet
def criss_cross_attention_2d_reference(q, k, v, queries=None):
    """CCNet's criss-cross attention pixel by pixel in float64: query ``(y, x)`` over the keys of
    its column ``(a, x)``, every ``a``, and of its row ``(y, c)``, every ``c != x`` (``H + W - 1``
    keys, itself once); ``[B, Nh, H, W, dv]``, or with ``queries`` (``(y, x)`` pixels) only
    those, ``[B, Nh, n, dv]``."""
    b, nh, h, w, _ = q.shape
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(b, nh, h, w, v.shape[-1], dtype=D)
    for bi, n, y, x in _pixels(b, nh, h, w, queries):
        keys = [(a, x) for a in range(h)] + [(y, c) for c in range(w) if c != x]
        logits = torch.stack([q[bi, n, y, x] @ k[bi, n, a, c] for a, c in keys])
        p = torch.softmax(logits, 0)
        out[bi, n, y, x] = (p[:, None] * torch.stack([v[bi, n, a, c] for a, c in keys])).sum(0)
    return _at(out, queries)
