"""HaloNet attention in a C++ kernel, block by block in cache: the ``"cpp"`` route (CPU tensors).

Computes :func:`~aadet.layers.functional.halo_attention.halo_attention_2d` with
``csrc/halonet_cpu.cpp``: per block, the queries, the keys and values of its window (clipped to the
map: keys outside it are never scored) are copied into a small buffer, and the logits ``K Q^T``
plus the position terms, the softmax and ``P V`` are computed there with BLAS gemm's and
vectorized passes across the block's queries, so the ``(b + 2h)^2`` logits of a query never reach
memory. Backward recomputes them from the saved log-sum-exp (flash attention's trick), so what is
kept for backward is ``q, k, v`` (the channels-first maps the layer's projections give, read in
place: no copy), the output and one log-sum-exp per query -- not the ``[Pq, L]`` probabilities the
PyTorch routes store.

The position terms are computed in the kernel too, per block from the queries in its buffer: the
tables ``rel_h q[:d//2]^T`` and ``rel_w q[d//2:]^T`` of every offset (``2(b + h) - 1`` each), of
which each key takes its row's and its column's entry; backward returns the embeddings' gradients
and adds the position terms' share to ``q``'s. Arithmetic in float32 (exp: a vectorized
polynomial, relative error ~1e-7) with autocast off, or float64 for float64 inputs (the exactness
tests); output in ``v``'s dtype.

Built on first use and cached by :mod:`.cpu_kernels` (:data:`KERNEL`), which says what happens
where it cannot be. A custom autograd Function: it does not export.
"""
import torch

from ..precision import compute_dtype, grads_in_input_dtypes, input_dtypes
from .cpu_kernels import KERNELS

__all__ = ["KERNEL", "cpp_halo_attention"]

#: The kernel (a :class:`~.cpu_kernels.CppKernel`: ``KERNEL.available()``, ``KERNEL.build_error()``).
KERNEL = KERNELS["halonet"]


class _HaloCpp(torch.autograd.Function):
    """Channels-first: ``q [N, d, Ho, Wo]``, ``k [N, d, H, W]``, ``v [N, dv, H, W]``,
    ``rel_h``/``rel_w`` or None -> ``[N, dv, Ho, Wo]`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, block_size, halo_size, query_stride):
        ext = KERNEL.extension("cpp")
        ctx.dtypes = input_dtypes(q, k, v, rel_h, rel_w)
        ct = compute_dtype(q.dtype)
        with torch.autocast(device_type="cpu", enabled=False):
            q, k, v = (t.to(ct).contiguous() for t in (q, k, v))
            if rel_h is None:
                rel_h = rel_w = q.new_empty(0)
            else:
                rel_h, rel_w = rel_h.to(ct).contiguous(), rel_w.to(ct).contiguous()
            out, lse = ext.forward(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride)
        ctx.save_for_backward(q, k, v, out, lse, rel_h, rel_w)
        ctx.geometry = (block_size, halo_size, query_stride)
        return out.to(ctx.dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, rel_h, rel_w = ctx.saved_tensors
        need_q, need_k, need_v, need_rh, need_rw = ctx.needs_input_grad[:5]
        ext = KERNEL.extension("cpp")
        with torch.autocast(device_type="cpu", enabled=False):
            go = grad_out.to(out.dtype).contiguous()
            grads = ext.backward(
                go, q, k, v, out, lse, rel_h, rel_w, *ctx.geometry, need_q, need_k, need_v,
                need_rh or need_rw,
            )
        return (*grads_in_input_dtypes(ctx, *grads), None, None, None)


def cpp_halo_attention(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride):
    """HaloNet attention in the C++ kernel (``impl="cpp"``; CPU tensors), a route of
    :data:`~aadet.layers.functional.halo_attention.HALO_ATTENTION_BACKENDS`."""
    KERNEL.check_device(q)
    b, nh, ho, wo, _ = q.shape
    dv = v.shape[-1]

    def channels_first(t):  # [B, Nh, H, W, c] -> [B Nh, c, H, W]: a view for the layer's maps
        return t.permute(0, 1, 4, 2, 3).reshape(b * nh, t.shape[-1], t.shape[2], t.shape[3])

    out = _HaloCpp.apply(
        channels_first(q), channels_first(k), channels_first(v), rel_h, rel_w,
        block_size, halo_size, query_stride,
    )
    return out.view(b, nh, dv, ho, wo).permute(0, 1, 3, 4, 2)
