"""SASA local self-attention (Eq. 3) as fused Triton kernels: forward and backward, exact.

Paper: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019, Eq. 3.
Same semantics as :func:`~aadet.layers.functional.local_attention.local_self_attention_2d`: for
an odd ``k = 2r + 1``, query pixel ``(y, x)`` of head ``n`` attends to the keys
``(y + a - r, x + c - r)``, ``a, c in [0, k)``, that lie inside the ``H x W`` map (out-of-map keys
are excluded from the softmax, so any ``H, W >= 1`` works, maps smaller than the window too), with
logits::

    s[y, x, a, c] = q[y, x] . k[y + a - r, x + c - r]
                  + q[y, x, :dk//2] . rel_h[a] + q[y, x, dk//2:] . rel_w[c]
                  = q[y, x] . (k[y + a - r, x + c - r] + cat(rel_h[a], rel_w[c]))

``q`` is already scaled. No public kernel has the per-query relative term ``q . r`` (NATTEN has
none); here it is one extra vector per window offset, added to the key before the dot product.

Contract of :func:`launch_triton_local_attention` (``impl="triton"`` of
:func:`~aadet.layers.functional.local_attention.local_self_attention_2d`, which checks the
arguments first; :func:`triton_local_attention` is the same with those checks, to call directly):
``q, k [B, Nh, H, W, dk]``, ``v [B, Nh, H, W, dv]`` (any strides, each float16,
bfloat16 or float32, not necessarily the same), ``rel_h [k, dk//2]`` and ``rel_w [k, dk - dk//2]``
or both None, odd ``kernel_size``; returns ``[B, Nh, H, W, dv]`` in ``v``'s dtype, differentiable
in all five tensors (gradients in each input's dtype). All arithmetic is float32. Tensors must be
on CUDA, or the process must run Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported, flag :data:`TRITON_INTERPRETED`: exact and slow, for tests on CPU); anything else
raises a ValueError saying what is needed. float64 is rejected (the kernels compute in float32:
use the ``"neighborhood"`` route). The module imports without Triton (:data:`TRITON_AVAILABLE`).

Algorithm (one program = ``BLOCK_P`` consecutive pixels of the flattened ``[B * Nh, H, W]``
maps, so a block may span two heads and small maps waste no tail; each pixel's channels are a
vector padded to a power of two with masks; the ``k^2`` window offsets are a loop; any strides,
each pixel row found from its own image/head/row/column):

* forward: per offset, gather the key row of every query of the block (masked where out of map),
  add the offset's relative vector, dot with ``q``; an online softmax (running max ``m``, sum
  ``l``, float32 accumulator rescaled per offset) over the ``k^2`` offsets. Stores ``out`` and
  ``lse = m + log l`` per query.
* backward, pass 1 (query-centric): ``delta = sum(dout * out)`` per query; per offset recompute
  ``p = exp(s - lse)``, ``dp = dout . v_key``, ``ds = p (dp - delta)``; ``dq += ds (k_key + rel)``.
  The relative gradients are head-independent sums over all queries of ``ds * q`` per offset:
  each program reduces over its pixels and atomically adds ``k + k^2`` vectors into float32
  ``[k, dk//2]`` / ``[k, dk - dk//2]`` buffers.
* backward, pass 2 (key-centric, no atomics): a key ``(y', x')`` is seen at offset ``(a, c)``
  by the query ``(y' - a + r, x' - c + r)`` (its mirrored window); recompute that query's ``p``
  and ``ds`` from its ``q``, ``lse``, ``delta``, ``dout``; ``dv += p dout``, ``dk += ds q``.
  Skipped when neither ``k`` nor ``v`` needs a gradient.

Memory: saved for backward are the inputs (``q, k, v, rel_h, rel_w``, not copied), ``out``
in float32 (``[B, Nh, H, W, dv]``; the returned tensor is its cast to ``v``'s dtype: for half
inputs 2 extra bytes per channel buy gradients at float32 accuracy, as ``delta = dout . out``
cancels against ``dout . v`` in peaked windows) and ``lse`` (``[B, Nh, H, W]`` float32: 4 bytes
per pixel and head). No ``[N, k^2, H, W]`` attention matrix (the neighborhood route stores
``k^2`` floats per pixel and head: 49 for ``k = 7``) and no unfolded key/value copies. Backward
temporaries: ``delta`` (``[B, Nh, H, W]`` float32) and the two small relative-gradient buffers;
the gradients themselves. Work per pixel and head: forward ``k^2 (dk + 2 dv)`` multiply-adds
(logit, rescale and update of the accumulator); backward ``k^2 (5 dk + 3 dv)`` (the logits are
recomputed in both passes). The kernels are gathers (``k^2`` key/value rows per query, mostly
cache hits between neighbouring queries), not matmuls. Default tiles: 4 ``[BLOCK_P, d_pad]``
elements per thread at 4 warps (ptxas for sm_90: 105-130 registers, no spills for d_pad 16-64;
8 per thread spill).
"""
from typing import Optional

import torch

from ..checks import check_local_attention
from .triton_kernels import TRITON_AVAILABLE, TRITON_DTYPES, TRITON_INTERPRETED, jit, tl, triton

__all__ = [
    "TRITON_AVAILABLE",
    "TRITON_INTERPRETED",
    "launch_triton_local_attention",
    "triton_local_attention",
]

_NUM_WARPS = 4
_ELEMENTS_PER_THREAD = 4


if TRITON_AVAILABLE:

    @jit
    def _gather(base, row, yy, xx, s_y, s_x, s_c, ch, valid, ch_mask):
        """``[BLOCK_P, D_PAD]`` float32 rows at pixels ``(yy, xx)`` of the maps starting at
        ``base + row`` (one offset per row: its image and head); 0 where ``valid`` is False or past
        the last channel."""
        ptr = base + (row + yy * s_y + xx * s_x)[:, None] + ch[None, :] * s_c
        return tl.load(ptr, mask=valid[:, None] & ch_mask[None, :], other=0.0).to(tl.float32)

    @jit
    def _rel_vector(RH, RW, a, c, ch, DK, DH):
        """``cat(rel_h[a], rel_w[c])`` as one ``[DK_PAD]`` float32 vector: the relative logit of
        window offset ``(a, c)`` is ``q . _rel_vector`` (rel_h pairs with q's first ``DH``
        channels, rel_w with the rest)."""
        rh = tl.load(RH + a * DH + ch, mask=ch < DH, other=0.0).to(tl.float32)
        rw = tl.load(RW + c * (DK - DH) + (ch - DH), mask=(ch >= DH) & (ch < DK), other=0.0)
        return rh + rw.to(tl.float32)

    @jit
    def _layout(NUM_PIX, NH, H, W, DK, DV, BLOCK_P: tl.constexpr, DK_PAD: tl.constexpr,
                DV_PAD: tl.constexpr):
        """What a program works on, the same in the three kernels: its ``[BLOCK_P]`` pixels of the
        flattened ``[B * Nh, H, W]`` maps (a block may span two heads) -- flat index ``p``, its
        mask ``p < NUM_PIX``, map ``n``, row ``y``, column ``x``, image ``bi``, head ``hi`` -- and
        the channels of ``q, k`` (``ck`` and its mask ``ck < DK``) and of ``v`` (``cv``, ``cv < DV``),
        padded to powers of two."""
        hw = H * W
        p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = p // hw
        pix = (p - n * hw).to(tl.int32)
        bi = n // NH
        ck = tl.arange(0, DK_PAD)
        cv = tl.arange(0, DV_PAD)
        return p, p < NUM_PIX, n, pix // W, pix % W, bi, n - bi * NH, ck, ck < DK, cv, cv < DV

    @jit
    def _window_key(K, k_row, sk2, sk3, sk4, RH, RW, y, x, a, c, R, H, W, pmask, ck, ckm, DK, DH,
                    HAS_REL: tl.constexpr):
        """Window offset ``(a, c)`` of the queries ``(y, x)``: the key pixel ``(yy, xx) = (y + a - R,
        x + c - R)``, whether it is a key (``valid``: in the map, for a query in range) and its row
        plus the offset's relative vector (``kk``: its dot product with ``q`` is the whole logit)."""
        yy = y + (a - R)
        xx = x + (c - R)
        valid = pmask & (yy >= 0) & (yy < H) & (xx >= 0) & (xx < W)
        kk = _gather(K, k_row, yy, xx, sk2, sk3, sk4, ck, valid, ckm)
        if HAS_REL:
            kk = kk + _rel_vector(RH, RW, a, c, ck, DK, DH)[None, :]
        return yy, xx, valid, kk

    @jit
    def _fwd_kernel(
        Q, K, V, RH, RW, O, LSE,
        sq0, sq1, sq2, sq3, sq4,
        sk0, sk1, sk2, sk3, sk4,
        sv0, sv1, sv2, sv3, sv4,
        NUM_PIX, NH, H, W, DK, DV, DH,
        KS, HAS_REL: tl.constexpr,
        BLOCK_P: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    ):
        R = KS // 2
        p, pmask, n, y, x, bi, hi, ck, ckm, cv, cvm = _layout(
            NUM_PIX, NH, H, W, DK, DV, BLOCK_P, DK_PAD, DV_PAD)
        k_row = bi * sk0 + hi * sk1
        v_row = bi * sv0 + hi * sv1
        q = _gather(Q, bi * sq0 + hi * sq1, y, x, sq2, sq3, sq4, ck, pmask, ckm)  # [BLOCK_P, DK_PAD]
        m = tl.full([BLOCK_P], float("-inf"), tl.float32)  # running max of the logits
        l = tl.full([BLOCK_P], 0.0, tl.float32)  # running sum of exp(logit - m)
        acc = tl.full([BLOCK_P, DV_PAD], 0.0, tl.float32)
        for a in range(KS):
            for c in range(KS):
                yy, xx, valid, kk = _window_key(
                    K, k_row, sk2, sk3, sk4, RH, RW, y, x, a, c, R, H, W, pmask, ck, ckm, DK, DH, HAS_REL)
                s = tl.where(valid, tl.sum(q * kk, 1), float("-inf"))
                m_new = tl.maximum(m, s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no in-map key seen yet
                alpha = tl.exp(m - m_safe)
                pr = tl.exp(s - m_safe)
                vv = _gather(V, v_row, yy, xx, sv2, sv3, sv4, cv, valid, cvm)
                l = l * alpha + pr
                acc = acc * alpha[:, None] + pr[:, None] * vv
                m = m_new
        l_safe = tl.where(l > 0.0, l, 1.0)  # only pixels past the map's end (p >= H W) have l = 0
        out = acc / l_safe[:, None]
        tl.store(O + p[:, None] * DV + cv[None, :], out.to(O.dtype.element_ty),
                 mask=pmask[:, None] & cvm[None, :])
        tl.store(LSE + p, m + tl.log(l_safe), mask=pmask)

    @jit
    def _bwd_query_kernel(
        Q, K, V, RH, RW, O, DO, LSE, DELTA, DQ, DRH, DRW,
        sq0, sq1, sq2, sq3, sq4,
        sk0, sk1, sk2, sk3, sk4,
        sv0, sv1, sv2, sv3, sv4,
        sd0, sd1, sd2, sd3, sd4,
        NUM_PIX, NH, H, W, DK, DV, DH,
        KS, HAS_REL: tl.constexpr, NEED_DQ: tl.constexpr, NEED_DREL: tl.constexpr,
        BLOCK_P: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    ):
        R = KS // 2
        p, pmask, n, y, x, bi, hi, ck, ckm, cv, cvm = _layout(
            NUM_PIX, NH, H, W, DK, DV, BLOCK_P, DK_PAD, DV_PAD)
        k_row = bi * sk0 + hi * sk1
        v_row = bi * sv0 + hi * sv1
        q = _gather(Q, bi * sq0 + hi * sq1, y, x, sq2, sq3, sq4, ck, pmask, ckm)
        do = _gather(DO, bi * sd0 + hi * sd1, y, x, sd2, sd3, sd4, cv, pmask, cvm)
        o = _gather(O, n * (H * W) * DV, y, x, W * DV, DV, 1, cv, pmask, cvm)
        lse = tl.load(LSE + p, mask=pmask, other=0.0)
        delta = tl.sum(do * o, 1)  # sum over the window of p * dp, written for pass 2
        tl.store(DELTA + p, delta, mask=pmask)
        dq = tl.full([BLOCK_P, DK_PAD], 0.0, tl.float32)
        for a in range(KS):
            g_row = tl.full([DK_PAD], 0.0, tl.float32)
            for c in range(KS):
                yy, xx, valid, kk = _window_key(
                    K, k_row, sk2, sk3, sk4, RH, RW, y, x, a, c, R, H, W, pmask, ck, ckm, DK, DH, HAS_REL)
                pr = tl.where(valid, tl.exp(tl.sum(q * kk, 1) - lse), 0.0)
                vv = _gather(V, v_row, yy, xx, sv2, sv3, sv4, cv, valid, cvm)
                ds = pr * (tl.sum(do * vv, 1) - delta)  # d loss / d logit
                if NEED_DQ:
                    dq += ds[:, None] * kk
                if NEED_DREL:
                    g = tl.sum(ds[:, None] * q, 0)  # [DK_PAD]: d loss / d cat(rel_h[a], rel_w[c])
                    g_row += g
                    tl.atomic_add(DRW + c * (DK - DH) + (ck - DH), g, mask=(ck >= DH) & ckm)
            if NEED_DREL:
                tl.atomic_add(DRH + a * DH + ck, g_row, mask=ck < DH)
        if NEED_DQ:
            tl.store(DQ + p[:, None] * DK + ck[None, :], dq.to(DQ.dtype.element_ty),
                     mask=pmask[:, None] & ckm[None, :])

    @jit
    def _bwd_key_kernel(
        Q, K, V, RH, RW, DO, LSE, DELTA, DK_OUT, DV_OUT,
        sq0, sq1, sq2, sq3, sq4,
        sk0, sk1, sk2, sk3, sk4,
        sv0, sv1, sv2, sv3, sv4,
        sd0, sd1, sd2, sd3, sd4,
        NUM_PIX, NH, H, W, DK, DV, DH,
        KS, HAS_REL: tl.constexpr, NEED_DK: tl.constexpr, NEED_DV: tl.constexpr,
        BLOCK_P: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    ):
        R = KS // 2
        p, pmask, n, y, x, bi, hi, ck, ckm, cv, cvm = _layout(
            NUM_PIX, NH, H, W, DK, DV, BLOCK_P, DK_PAD, DV_PAD)
        q_row = bi * sq0 + hi * sq1
        do_row = bi * sd0 + hi * sd1
        k_own = _gather(K, bi * sk0 + hi * sk1, y, x, sk2, sk3, sk4, ck, pmask, ckm)
        v_own = _gather(V, bi * sv0 + hi * sv1, y, x, sv2, sv3, sv4, cv, pmask, cvm)
        dk = tl.full([BLOCK_P, DK_PAD], 0.0, tl.float32)
        dv = tl.full([BLOCK_P, DV_PAD], 0.0, tl.float32)
        for a in range(KS):
            yq = y - (a - R)  # the query that sees this key at window row a
            row_ok = pmask & (yq >= 0) & (yq < H)
            for c in range(KS):
                xq = x - (c - R)
                valid = row_ok & (xq >= 0) & (xq < W)
                kk = k_own
                if HAS_REL:
                    kk = k_own + _rel_vector(RH, RW, a, c, ck, DK, DH)[None, :]
                qq = _gather(Q, q_row, yq, xq, sq2, sq3, sq4, ck, valid, ckm)
                dd = _gather(DO, do_row, yq, xq, sd2, sd3, sd4, cv, valid, cvm)
                pq = p - (a - R) * W - (c - R)  # that query's flat index
                lse = tl.load(LSE + pq, mask=valid, other=0.0)
                pr = tl.where(valid, tl.exp(tl.sum(qq * kk, 1) - lse), 0.0)
                if NEED_DV:
                    dv += pr[:, None] * dd
                if NEED_DK:
                    delta = tl.load(DELTA + pq, mask=valid, other=0.0)
                    dk += (pr * (tl.sum(dd * v_own, 1) - delta))[:, None] * qq
        if NEED_DK:
            tl.store(DK_OUT + p[:, None] * DK + ck[None, :], dk.to(DK_OUT.dtype.element_ty),
                     mask=pmask[:, None] & ckm[None, :])
        if NEED_DV:
            tl.store(DV_OUT + p[:, None] * DV + cv[None, :], dv.to(DV_OUT.dtype.element_ty),
                     mask=pmask[:, None] & cvm[None, :])



def _launch_config(q, v, kernel_size, rel_h, block_pixels):
    """Grid, sizes and compile-time constants shared by the three kernels."""
    b, nh, h, w, dk = q.shape
    dv = v.shape[-1]
    num_pix = b * nh * h * w
    dk_pad = triton.next_power_of_2(max(dk, 1))
    dv_pad = triton.next_power_of_2(max(dv, 1))
    if block_pixels is None:
        if TRITON_INTERPRETED:  # programs run one after another: few large ones
            block_pixels = min(triton.next_power_of_2(num_pix), 4096)
        else:
            # ptxas (sm_90, Triton 3.8) needs ~25-30 registers per [BLOCK_P, d_pad] element a
            # thread holds: 4 per thread (~100-130 registers, no spills; 8 per thread spill).
            block_pixels = max(1, _ELEMENTS_PER_THREAD * 32 * _NUM_WARPS // max(dk_pad, dv_pad))
    grid = (triton.cdiv(num_pix, block_pixels),)
    meta = dict(KS=kernel_size, HAS_REL=rel_h is not None, BLOCK_P=block_pixels, DK_PAD=dk_pad, DV_PAD=dv_pad)
    meta["num_warps"] = _NUM_WARPS
    return grid, (num_pix, nh, h, w, dk, dv, dk // 2), meta


def _rel_pointers(q, rel_h, rel_w):
    """Contiguous ``rel_h, rel_w`` for the kernels; ``q`` stands in for absent or empty ones
    (never read: HAS_REL is False, or ``dk = 1`` leaves ``rel_h`` no channels)."""
    if rel_h is None:
        return q, q
    return (rel_h.contiguous() if rel_h.numel() else q), rel_w.contiguous()


class _TritonLocalAttention(torch.autograd.Function):
    """Eq. 3 on ``[B, Nh, H, W, d]`` maps with the Triton kernels (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, kernel_size, block_pixels):
        b, nh, h, w, _ = q.shape
        grid, dims, meta = _launch_config(q, v, kernel_size, rel_h, block_pixels)
        rh, rw = _rel_pointers(q, rel_h, rel_w)
        # float32 even for half inputs: backward's delta = dout . out must not see out's rounding
        # (with peaked softmaxes dp - delta cancels, and a bfloat16 out costs ~5% in dq, dk, drel)
        out = torch.empty(b, nh, h, w, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.empty(b, nh, h, w, dtype=torch.float32, device=q.device)
        _fwd_kernel[grid](q, k, v, rh, rw, out, lse, *q.stride(), *k.stride(), *v.stride(), *dims, **meta)
        ctx.save_for_backward(q, k, v, rel_h, rel_w, out, lse)
        ctx.kernel_size, ctx.block_pixels = kernel_size, block_pixels
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, rel_h, rel_w, out, lse = ctx.saved_tensors
        need_q, need_k, need_v, need_rh, need_rw = ctx.needs_input_grad[:5]
        grid, dims, meta = _launch_config(q, v, ctx.kernel_size, rel_h, ctx.block_pixels)
        has_rel = rel_h is not None
        rh, rw = _rel_pointers(q, rel_h, rel_w)
        need_rel = has_rel and (need_rh or need_rw)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format) if need_q else q
        drh = torch.zeros(rel_h.shape, dtype=torch.float32, device=q.device) if need_rel else q
        drw = torch.zeros(rel_w.shape, dtype=torch.float32, device=q.device) if need_rel else q
        delta = torch.empty_like(lse)
        _bwd_query_kernel[grid](q, k, v, rh, rw, out, grad_out, lse, delta, dq, drh, drw,
                    *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dims,
                    NEED_DQ=need_q, NEED_DREL=need_rel, **meta)
        dk = dv = None
        if need_k or need_v:
            dk = torch.empty_like(k, memory_format=torch.contiguous_format) if need_k else None
            dv = torch.empty_like(v, memory_format=torch.contiguous_format) if need_v else None
            _bwd_key_kernel[grid](q, k, v, rh, rw, grad_out, lse, delta,
                        dk if need_k else q, dv if need_v else q,
                        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dims,
                        NEED_DK=need_k, NEED_DV=need_v, **meta)
        grh = drh.to(rel_h.dtype) if need_rel and need_rh else None
        grw = drw.to(rel_w.dtype) if need_rel and need_rw else None
        return (dq if need_q else None), dk, dv, grh, grw, None, None


def triton_local_attention(
    q, k, v, rel_h, rel_w, kernel_size: int, *, block_pixels: Optional[int] = None
) -> torch.Tensor:
    """SASA local self-attention over centred ``k x k`` windows clipped to the map, in Triton.

    Args:
        q, k, v, rel_h, rel_w, kernel_size: as for
            :func:`~aadet.layers.functional.local_attention.local_self_attention_2d` (checked
            here); the tensors float16, bfloat16 or float32, any strides.
        block_pixels: query pixels per program (a power of two; default from the head size).
            Any value gives the same result.

    Returns:
        ``[B, Nh, H, W, dv]`` in ``v``'s dtype.
    """
    check_local_attention(q, k, v, rel_h, rel_w, kernel_size)
    return launch_triton_local_attention(q, k, v, rel_h, rel_w, kernel_size, block_pixels=block_pixels)


def launch_triton_local_attention(
    q, k, v, rel_h, rel_w, kernel_size: int, *, block_pixels: Optional[int] = None
) -> torch.Tensor:
    """:func:`triton_local_attention` on arguments checked by
    :func:`~aadet.layers.functional.checks.check_local_attention` (``impl="triton"`` of
    ``local_self_attention_2d``); checks what only the kernels need (Triton, dtypes, devices,
    ``block_pixels``)."""
    if not TRITON_AVAILABLE:
        raise ValueError("triton_local_attention needs the 'triton' package (pip install triton)")
    tensors = [t for t in (q, k, v, rel_h, rel_w) if t is not None]
    for name, t in zip(("q", "k", "v", "rel_h", "rel_w"), tensors):
        if t.dtype not in TRITON_DTYPES:
            raise ValueError(
                f"triton_local_attention supports {[str(d) for d in TRITON_DTYPES]} (float32 "
                f"math inside); got {name}.dtype={t.dtype} (use impl='neighborhood' for float64)"
            )
    if block_pixels is not None and (
        not isinstance(block_pixels, int) or block_pixels < 1 or block_pixels & (block_pixels - 1)
    ):
        raise ValueError(f"block_pixels must be a power of two >= 1; got {block_pixels!r}")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, rel_h, rel_w must be on one device; got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not TRITON_INTERPRETED:
        raise ValueError(
            f"triton_local_attention needs CUDA tensors (got {q.device.type}); on CPU, Triton's "
            "interpreter runs the kernels (exact, slow: for tests) when TRITON_INTERPRET=1 is set "
            "before the process first imports triton"
        )
    return _TritonLocalAttention.apply(q, k, v, rel_h, rel_w, kernel_size, block_pixels)
