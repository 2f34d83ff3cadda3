"""SASA local attention in a C++ kernel, one pass over the window per query row: the ``"cpp"``
route (CPU tensors, ``kernel_size`` up to :data:`MAX_KERNEL_SIZE`).

Computes :func:`~aadet.layers.functional.local_attention.local_self_attention_2d` (SASA Eq. 3,
windows clipped to the map) with the kernels of ``csrc/sasa_cpu.cpp``:

* forward: per query row, the ``k^2`` logits of every query (``q . k`` plus the row/column terms
  ``q . rel``, which are ``k`` dot products per pixel and computed here with two matmuls), the
  softmax over the in-map keys, and the weighted sum of the values, in one pass over the window;
  out-of-map keys are skipped, not scored. Saved for backward: the attention matrix ``[N, k^2,
  H, Wp]`` (as the neighborhood route saves it) and ``q, k, v`` in the kernel's padded layout
  (``Wp = W`` rounded up to a SIMD vector, plus ``k - 1``), not the projections' output;
* backward: one pass per query row for ``dL/dlogits`` and ``dL/dq``, one per key row for
  ``dL/dk`` and ``dL/dv`` (each key gathers from the ``k^2`` queries that see it, so no two
  threads write one row); the gradients of the relative embeddings are two einsums over
  ``dL/dlogits``.

``recompute=True`` (the layer's ``recompute_attention``, ``MODEL.SASA.RECOMPUTE_ATTENTION``)
keeps nothing of size ``k^2`` per pixel for backward, flash attention's trick as in HaloNet's
kernel (:mod:`.halonet_cpp`): forward saves ``q, k, v`` as given (the projections' output: no
padded copies; the passes read them through a few padded rows per thread) and one log-sum-exp
per query and head; backward visits the query rows in order, recomputes each row's logits,
``p = exp(logits - lse)`` and ``dL/dlogits = p (dL/dp - rowsum(p dL/dp))``, writes its ``dL/dq``
and the row/column sums the embeddings' gradients need, and keeps the last ``k`` rows' ``p`` and
``dL/dlogits`` for the key rows' ``dL/dk``, ``dL/dv``. It trades the ``[N, k^2, H, W]``
probabilities and logit gradients and the padded copies for a second computation of the logits
and ``dL/dp`` in backward.

Every loop runs along a row of the channels-first maps in SIMD vectors, with the window's offsets
(or a block of channels) accumulated in registers; rows run in parallel on PyTorch's intra-op
threads. Arithmetic in float32 (exp: a vectorized polynomial, relative error ~1e-7), or float64
for float64 inputs (the exactness tests), output in ``v``'s dtype, as the neighborhood route.

Built on first use and cached by :mod:`.cpu_kernels` (:data:`KERNEL`), which says what happens
where it cannot be. A custom autograd Function: it does not export.
"""
from typing import Optional

import torch

from ..precision import compute_dtype, grads_in_input_dtypes, input_dtypes
from .cpu_kernels import KERNELS
from .sasa_channels_first import (
    apply_channels_first,
    relative_gradients,
    relative_logit_terms,
    relative_term_gradients,
)

__all__ = ["MAX_KERNEL_SIZE", "KERNEL", "cpp_local_attention"]

#: The largest window side the kernel is compiled for (every odd size up to it: the dispatch
#: switch of csrc/sasa_cpu.cpp instantiates each, and checks the same bound).
MAX_KERNEL_SIZE = 15
#: The kernel (a :class:`~.cpu_kernels.CppKernel`: ``KERNEL.available()``, ``KERNEL.build_error()``).
KERNEL = KERNELS["sasa"]


def _logit_terms(q: torch.Tensor, rel_h: Optional[torch.Tensor], rel_w: Optional[torch.Tensor]):
    """The kernel's positional terms ``(row, col)`` of ``q`` (:func:`relative_logit_terms`), or two
    empty tensors without embeddings."""
    if rel_h is None:
        return q.new_empty(0), q.new_empty(0)
    return relative_logit_terms(q, rel_h, rel_w)


def _in_compute_dtype(q, k, v, rel_h, rel_w):
    """``q, k, v, rel_h, rel_w`` in the compute dtype (:mod:`..precision`)."""
    ct = compute_dtype(q.dtype)
    q, k, v = q.to(ct), k.to(ct), v.to(ct)
    if rel_h is not None:
        rel_h, rel_w = rel_h.to(ct), rel_w.to(ct)
    return q, k, v, rel_h, rel_w


class _CppLocalAttention(torch.autograd.Function):
    """Eq. 3 on channels-first maps in the C++ kernel (see the module docstring): ``q, k [N, dk,
    H, W]``, ``v [N, dv, H, W]``, ``rel_h [k, dk//2]``, ``rel_w [k, dk - dk//2]`` (or both None)
    -> ``[N, dv, H, W]``. Without ``recompute`` it keeps the attention weights for backward (and
    the padded maps the passes read), with it ``q, k, v`` and the log-sum-exp of every query,
    recomputing the weights in backward."""

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, kernel_size, recompute):
        ext = KERNEL.extension("cpp")
        ctx.dtypes = input_dtypes(q, k, v, rel_h, rel_w)
        ctx.kernel_size, ctx.recompute, ctx.width = kernel_size, recompute, q.shape[-1]
        with torch.autocast(device_type=q.device.type, enabled=False):
            q, k, v, rel_h, rel_w = _in_compute_dtype(q, k, v, rel_h, rel_w)
            if recompute:
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
                out, lse = ext.forward_lse(q, k, v, *_logit_terms(q, rel_h, rel_w), kernel_size)  # lse: [N, H, W]
                ctx.save_for_backward(q, k, v, lse, rel_h, rel_w)
            else:
                # probs and the padded maps qp, kp, vp: [N, *, H, Wp] (the kernel's padded layout);
                # only they are kept: the projections' output (q, k, v) can be freed.
                out, probs, qp, kp, vp = ext.forward(q, k, v, *_logit_terms(q, rel_h, rel_w), kernel_size)
                ctx.save_for_backward(qp, kp, vp, probs, rel_h, rel_w)
        return out.to(ctx.dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        ks, w = ctx.kernel_size, ctx.width
        need_q, need_k, need_v, need_rh, need_rw = ctx.needs_input_grad[:5]
        ext = KERNEL.extension("cpp")
        grh = grw = None
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            if ctx.recompute:
                q, k, v, lse, rel_h, rel_w = ctx.saved_tensors
                row, col = _logit_terms(q, rel_h, rel_w)
                g = grad_out.to(q.dtype)  # any strides: a broadcast gradient stays one
                gq, gk, gv, grow, gcol = ext.backward_recompute(g, q, k, v, lse, row, col, ks)
                del row, col, g
                if rel_h is not None:
                    grh, grw = relative_term_gradients(
                        grow, gcol, q, rel_h, rel_w, gq if need_q else None, (need_rh, need_rw)
                    )
            else:
                qp, kp, vp, probs, rel_h, rel_w = ctx.saved_tensors
                q = qp[..., ks // 2:ks // 2 + w]  # [N, dk, H, W] (a view)
                gp = ext.pad(grad_out.to(q.dtype), ks)
                # glogits padded like probs; gk, gv empty unless asked for
                gq, glogits, gk, gv = ext.backward(gp, qp, kp, vp, probs, w, ks, need_k or need_v)
                if rel_h is not None:
                    grh, grw = relative_gradients(
                        glogits[..., ks // 2:ks // 2 + w], q, rel_h, rel_w, gq if need_q else None,
                        (need_rh, need_rw),
                    )
        return (*grads_in_input_dtypes(ctx, gq, gk, gv, grh, grw), None, None)


def cpp_local_attention(q, k, v, rel_h, rel_w, kernel_size, *, recompute: bool = False) -> torch.Tensor:
    """SASA local attention in the C++ kernel (``impl="cpp"``; CPU tensors), a route of
    :data:`~aadet.layers.functional.local_attention.LOCAL_ATTENTION_BACKENDS`; ``recompute``:
    recompute the attention weights in backward instead of keeping them (module docstring)."""
    KERNEL.check_device(q)
    if kernel_size > MAX_KERNEL_SIZE:
        raise ValueError(
            f"impl='cpp' takes kernel_size up to {MAX_KERNEL_SIZE}; got {kernel_size} "
            "(use impl='neighborhood' or 'auto')"
        )
    return apply_channels_first(_CppLocalAttention.apply, q, k, v, rel_h, rel_w, kernel_size, recompute)
