"""SASA's spatially-aware attention stem in a C++ kernel, block by block in cache: the stem's
``"cpp"`` route (:class:`~aadet.layers.attention_stem.SpatiallyAwareAttentionStem`, ``impl="cpp"``).

Computes the stem's attention (before its norm, ReLU and pooling), ``x [B, C, H, W]`` ->
``[B, O, H, W]``, with ``csrc/stem_cpu.cpp``: the input is read and the output written in map
layout, so the block-layout copies of the PyTorch routes (``map_to_blocks``, ``blocks_to_map``)
are gone; per ``b x b`` block (clipped to the map: pixels outside it are neither queries nor
keys), the values ``W_V(l) x_l``, each head's logits, the softmax and the weighted sum are
computed in small per-thread buffers, with vector passes across the block's queries. The logits
are a bilinear form through two features of the input, ``qf = wq[h] x``, ``kf = wk[h] x``, plus
the relative terms read off the tables ``tr[h] qf[:er]`` and ``tc[h] qf[e - ec:]``; the stem
passes either its projections (``wq = W_Q d^-1/2``, ``wk = W_K``, ``tr = rel_h``, ``tc = rel_w``)
or the factorized form (``wq = I``, ``wk = W_Q^T W_K``, ``tr = rel_h W_Q[:d/2]``, ...), made by
cheap weight algebra whose autograd takes the kernel's gradients back to the parameters.

Backward recomputes each block's probabilities (a block is ``b^2`` pixels: nothing but the
inputs is saved) and returns the gradients of ``x`` and of every weight tensor given; the
weights' gradients are summed per chunk of blocks (one per thread), then over the chunks.
Arithmetic in float32 (exp: a vectorized polynomial, relative error ~1e-7) or float64 (the
exactness tests), with autocast off.

With the stem's group norm, ReLU and pooling (:func:`cpp_stem_attention_norm_relu_pool`) the
full-resolution output is never written: a group norm is, per image and channel, an affine map
whose scale has the sign of the channel's ``gamma``, so the pooled maximum of ``norm(z)`` is the
norm of each block's maximum of ``z`` (``gamma >= 0``) or minimum (``gamma < 0``) -- the pooling
window is the block -- and ReLU commutes with the maximum. The kernel keeps each block's chosen
value and pixel per channel and the per-channel moments; the norm's algebra runs, with autograd,
on the 16x smaller pooled map; backward recomputes each block's output to form its gradient.

Built on first use and cached by :mod:`.cpu_kernels` (:data:`KERNEL`), which says what happens
where it cannot be. A custom autograd Function: it does not export.
"""
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .cpu_kernels import KERNELS

__all__ = ["KERNEL", "cpp_stem_attention", "cpp_stem_attention_norm_relu_pool"]

#: The kernel (a :class:`~.cpu_kernels.CppKernel`: ``KERNEL.available()``, ``KERNEL.build_error()``).
KERNEL = KERNELS["stem"]


class _StemCpp(torch.autograd.Function):
    """``x [B, C, H, W]``, ``wq``/``wk [Nh, e, C]``, ``tr [Nh, 2b-1, er]``/``tc [Nh, 2b-1, ec]``
    (empty: no relative terms), ``wv [b*b, C, O]`` -> ``[B, O, H, W]`` (see the module
    docstring); contiguous CPU tensors of one dtype."""

    @staticmethod
    def forward(ctx, x, wq, wk, tr, tc, wv, block_size):
        ext = KERNEL.extension("cpp")
        out = ext.forward(x, wq, wk, tr, tc, wv, block_size)
        ctx.save_for_backward(x, wq, wk, tr, tc, wv)
        ctx.block_size = block_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, wq, wk, tr, tc, wv = ctx.saved_tensors
        need_x, need_wq, need_wk, need_tr, need_tc, need_wv = ctx.needs_input_grad[:6]
        ext = KERNEL.extension("cpp")
        with torch.autocast(device_type="cpu", enabled=False):
            gx, gwq, gwk, gtr, gtc, gwv = ext.backward(
                grad_out.to(x.dtype).contiguous(), x, wq, wk, tr, tc, wv, ctx.block_size,
                need_x, need_wq, need_wk, need_tr or need_tc, need_wv,
            )
        return (
            gx if need_x else None, gwq if need_wq else None, gwk if need_wk else None,
            gtr if need_tr else None, gtc if need_tc else None, gwv if need_wv else None, None,
        )


def _kernel_args(x, wq, wk, tr, tc, wv):
    """The kernels' tensor arguments, checked: CPU, both tables or neither (None -> empty),
    contiguous in ``x``'s dtype."""
    KERNEL.check_device(x)
    if (tr is None) != (tc is None):
        raise ValueError("give both relative tables tr and tc, or neither")
    if tr is None:
        tr = tc = x.new_empty(0)
    return [t.to(x.dtype).contiguous() for t in (x, wq, wk, tr, tc, wv)]


def cpp_stem_attention(x, wq, wk, tr, tc, wv, block_size: int) -> torch.Tensor:
    """The stem's block attention in the C++ kernel (``impl="cpp"``; CPU tensors).

    Args:
        x: ``[B, C, H, W]`` input, float32 or float64.
        wq, wk: ``[Nh, e, C]``: the query and key features ``wq[h] x``, ``wk[h] x`` whose dot
            product is head ``h``'s content logit.
        tr, tc: ``[Nh, 2b - 1, er]`` and ``[Nh, 2b - 1, ec]`` (``er, ec <= e``), or both None (no
            relative terms): the logit of query ``p`` and key ``l`` gains ``tr[h, a_l - a_p + b - 1]
            . qf_p[:er] + tc[h, c_l - c_p + b - 1] . qf_p[e - ec:]`` (``a``, ``c``: row and
            column in the block).
        wv: ``[b*b, C, O]``: ``wv[a b + c]`` is the transposed value matrix of block position
            ``(a, c)``; head ``h`` takes the value channels ``[h O/Nh, (h + 1) O/Nh)``.
        block_size: ``b``.

    Returns:
        ``[B, O, H, W]`` in ``x``'s dtype: every pixel's attention over the in-map pixels of its
        ``b x b`` block.
    """
    with torch.autocast(device_type="cpu", enabled=False):
        return _StemCpp.apply(*_kernel_args(x, wq, wk, tr, tc, wv), block_size)


class _StemCppPooled(torch.autograd.Function):
    """:class:`_StemCpp`'s inputs and ``flip [O]`` (bool) -> ``sel [B, O, nby, nbx]`` (each block's
    maximum of the output, its minimum where ``flip``), ``idx`` (the chosen pixels; no gradient)
    and ``mom [B, O, 2]`` (float64: each output plane's sum and sum of squares)."""

    @staticmethod
    def forward(ctx, x, wq, wk, tr, tc, wv, block_size, flip):
        sel, idx, mom = KERNEL.extension("cpp").forward_pooled(x, wq, wk, tr, tc, wv, block_size, flip)
        ctx.save_for_backward(x, wq, wk, tr, tc, wv, idx)
        ctx.block_size = block_size
        ctx.mark_non_differentiable(idx)
        return sel, idx, mom

    @staticmethod
    @once_differentiable
    def backward(ctx, gsel, _gidx, gmom):
        x, wq, wk, tr, tc, wv, idx = ctx.saved_tensors
        need = ctx.needs_input_grad[:6]
        gsel = torch.zeros_like(idx, dtype=x.dtype) if gsel is None else gsel.to(x.dtype).contiguous()
        gmom = torch.zeros(idx.shape[:2] + (2,), dtype=torch.float64) if gmom is None else gmom.contiguous()
        with torch.autocast(device_type="cpu", enabled=False):
            grads = KERNEL.extension("cpp").backward_pooled(
                gsel, idx, gmom, x, wq, wk, tr, tc, wv, ctx.block_size,
                need[0], need[1], need[2], need[3] or need[4], need[5],
            )
        return (*(gr if n else None for gr, n in zip(grads, need)), None, None)


def cpp_stem_attention_norm_relu_pool(
    x, wq, wk, tr, tc, wv, block_size: int, norm: Optional[torch.nn.GroupNorm]
) -> torch.Tensor:
    """``relu(max_pool2d(norm(z), b, b, ceil_mode=True))`` of the stem's attention ``z``
    (:func:`cpp_stem_attention` of the same arguments) without writing ``z`` (see the module
    docstring).

    Args:
        norm: a :class:`torch.nn.GroupNorm` over the ``O`` output channels (statistics over each
            group's in-map pixels; its affine parameters if any), or None (pooling and ReLU).

    Returns:
        ``[B, O, ceil(H / b), ceil(W / b)]`` in ``x``'s dtype. Where ``gamma`` is exactly 0 the
        output is ``relu(beta)`` either way, and ``gamma``'s gradient there (a tie of the pooling)
        is taken at the block's maximum.
    """
    bsz, _, h, w = x.shape
    o = wv.shape[-1]
    gamma = None if norm is None else norm.weight
    flip = torch.zeros(o, dtype=torch.bool) if gamma is None else (gamma.detach() < 0).contiguous()
    with torch.autocast(device_type="cpu", enabled=False):
        sel, _, mom = _StemCppPooled.apply(*_kernel_args(x, wq, wk, tr, tc, wv), block_size, flip)
        if norm is None:
            return torch.relu(sel)
        g = norm.num_groups
        n = (o // g) * h * w
        s1, s2 = mom.view(bsz, g, -1, 2).sum(2).unbind(-1)  # [B, G] each
        mean = s1 / n
        var = (s2 / n - mean * mean).clamp_min(0)  # E z^2 - (E z)^2 in float64: rounding can go below 0
        rstd = (var + norm.eps).rsqrt()
        scale = rstd.repeat_interleave(o // g, dim=1)  # [B, O]
        shift = -mean.repeat_interleave(o // g, dim=1) * scale
        if gamma is not None:
            scale = scale * gamma.double()
            shift = shift * gamma.double() + norm.bias.double()
        # the moments' algebra in float64, the pooled map's in x's dtype
        return torch.relu(sel * scale.to(sel.dtype)[..., None, None] + shift.to(sel.dtype)[..., None, None])
