"""SASA local attention offset by offset: the ``"neighborhood"`` route (pure PyTorch).

Computes :func:`~aadet.layers.functional.local_attention.local_self_attention_2d` (SASA Eq. 3,
windows clipped to the map) with the ``k^2`` window offsets one at a time, as shifted views of
the zero-padded key/value maps (no copy). Per offset, one pass over ``q`` gives that offset's
logit for every pixel; row/column logits are ``k`` dot products per pixel, broadcast;
out-of-map neighbours get ``-inf``; the softmax runs over the ``k^2`` offsets; the output is
accumulated over the offsets in place.

A custom autograd function writes the backward out the same way, so the only stored
intermediate is the attention matrix itself, ``[N, k^2, H, W]`` (what any exact backward needs,
49 floats per pixel and head for ``k = 7``); keys and values are never copied ``k^2`` times.
Logits and softmax are float32 (float64 for float64 inputs). Work equals the papers' count
(``2 k^2 dk`` per pixel and head) with no halo overhead, but in ``4 k^2`` memory-bound
elementwise passes over the maps.

The custom function (and its in-place ``out=`` kernels) does not export.
"""
import torch
import torch.nn.functional as F

from ..precision import compute_dtype, grads_in_input_dtypes, input_dtypes
from .sasa_channels_first import apply_channels_first, relative_gradients, relative_logit_terms

__all__ = ["neighborhood_local_attention"]


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
        ctx.dtypes = input_dtypes(q, k, v, rel_h, rel_w)
        ct = compute_dtype(q.dtype)
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
                rel_h, rel_w = rel_h.to(ct), rel_w.to(ct)
                row, col = relative_logit_terms(q, rel_h, rel_w)  # [N, k, H, W] each
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
        return out.to(ctx.dtypes[2])

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
            if rel_h is not None:
                grh, grw = relative_gradients(
                    glogits, q, rel_h, rel_w, gq if need_q else None, (need_rh, need_rw)
                )
            gk = gkp[inner] if need_k else None
            gv = gvp[inner] if need_v else None
        return (*grads_in_input_dtypes(ctx, gq, gk, gv, grh, grw), None)


def neighborhood_local_attention(q, k, v, rel_h, rel_w, kernel_size) -> torch.Tensor:
    """SASA local attention offset by offset (``impl="neighborhood"``), a route of
    :data:`~aadet.layers.functional.local_attention.LOCAL_ATTENTION_BACKENDS`."""
    return apply_channels_first(_NeighborhoodAttention.apply, q, k, v, rel_h, rel_w, kernel_size)
