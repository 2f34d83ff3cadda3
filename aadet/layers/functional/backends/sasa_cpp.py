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

The kernel is compiled on first use and cached (:mod:`.cpu_kernels`; ``make setup`` builds it
once). Where it cannot be built (no compiler, ``AADET_CPP_KERNELS=0``), :func:`available` is
False and ``impl="cpp"`` raises with the build error. A custom autograd Function: it does not
export.
"""
from typing import Optional

import torch

from .cpu_kernels import KERNELS
from .sasa_channels_first import (
    apply_channels_first,
    relative_gradients,
    relative_logit_terms,
    relative_term_gradients,
)

__all__ = ["MAX_KERNEL_SIZE", "KERNEL", "available", "build", "build_error", "cpp_local_attention"]

#: The largest window side the kernel is compiled for (every odd size up to it: the dispatch
#: switch of csrc/sasa_cpu.cpp instantiates each, and checks the same bound).
MAX_KERNEL_SIZE = 15
#: The kernel (built on first use: :mod:`.cpu_kernels`).
KERNEL = KERNELS["sasa"]


def build(verbose: bool = False):
    """Compile (or load the cached build of) the kernel; None where it cannot be built."""
    return KERNEL.build(verbose)


def available() -> bool:
    """True if the kernel is built or builds now (the first call may compile it, ~1 minute)."""
    return KERNEL.available()


def build_error() -> Optional[str]:
    """Why the kernel is unavailable (None if it is available or was not tried)."""
    return KERNEL.build_error()


def _extension():
    return KERNEL.extension("cpp")


class _CppLocalAttention(torch.autograd.Function):
    """Eq. 3 on channels-first maps in the C++ kernel (see the module docstring).

    ``q, k [N, dk, H, W]``, ``v [N, dv, H, W]``, ``rel_h [k, dk//2]``, ``rel_w [k, dk - dk//2]``
    (or both None) -> ``[N, dv, H, W]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, kernel_size):
        ext = _extension()
        dtypes = (q.dtype, k.dtype, v.dtype, None if rel_h is None else rel_h.dtype)
        ct = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(device_type=q.device.type, enabled=False):
            q, k, v = q.to(ct), k.to(ct), v.to(ct)
            if rel_h is not None:
                rel_h, rel_w = rel_h.to(ct), rel_w.to(ct)
                row, col = relative_logit_terms(q, rel_h, rel_w)  # [N, k, H, W] each
            else:
                row = col = q.new_empty(0)
            # probs and the padded maps qp, kp, vp: [N, *, H, Wp] (the kernel's padded layout)
            out, probs, qp, kp, vp = ext.forward(q, k, v, row, col, kernel_size)
        # Only the padded copies are kept: the projections' output (q, k, v) can be freed.
        ctx.save_for_backward(qp, kp, vp, probs, rel_h, rel_w)
        ctx.kernel_size = kernel_size
        ctx.shape = q.shape
        ctx.dtypes = dtypes
        return out.to(dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        qp, kp, vp, probs, rel_h, rel_w = ctx.saved_tensors
        ks = ctx.kernel_size
        ext = _extension()
        w = ctx.shape[-1]
        q = qp[..., ks // 2:ks // 2 + w]  # [N, dk, H, W] (a view)
        need_q, need_k, need_v, need_rh, need_rw, _ = ctx.needs_input_grad
        gk = gv = grh = grw = None
        with torch.autocast(device_type=q.device.type, enabled=False):
            gp = ext.pad(grad_out.to(q.dtype), ks)
            gq, glogits = ext.backward_q(gp, kp, vp, probs, w, ks)  # glogits padded like probs
            if rel_h is not None:
                grh, grw = relative_gradients(
                    glogits[..., ks // 2:ks // 2 + w], q, rel_h, rel_w, gq if need_q else None,
                    (need_rh, need_rw),
                )
                grh, grw = (None if t is None else t.to(ctx.dtypes[3]) for t in (grh, grw))
            if need_k or need_v:
                gk, gv = ext.backward_kv(gp, qp, probs, glogits, w, ks)
                gk = gk.to(ctx.dtypes[1]) if need_k else None
                gv = gv.to(ctx.dtypes[2]) if need_v else None
        gq = gq.to(ctx.dtypes[0]) if need_q else None
        return gq, gk, gv, grh, grw, None


class _CppLocalAttentionRecompute(torch.autograd.Function):
    """:class:`_CppLocalAttention` that saves ``q, k, v`` and the log-sum-exp of every query, not
    the probabilities, and recomputes them in backward (``recompute=True``; see the module
    docstring). Same arguments and result."""

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, kernel_size):
        ext = _extension()
        dtypes = (q.dtype, k.dtype, v.dtype, None if rel_h is None else rel_h.dtype)
        ct = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(device_type=q.device.type, enabled=False):
            q, k, v = (t.to(ct).contiguous() for t in (q, k, v))
            if rel_h is not None:
                rel_h, rel_w = rel_h.to(ct), rel_w.to(ct)
                row, col = relative_logit_terms(q, rel_h, rel_w)  # [N, k, H, W] each
            else:
                row = col = q.new_empty(0)
            out, lse = ext.forward_lse(q, k, v, row, col, kernel_size)  # lse: [N, H, W]
        ctx.save_for_backward(q, k, v, lse, rel_h, rel_w)
        ctx.kernel_size = kernel_size
        ctx.dtypes = dtypes
        return out.to(dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lse, rel_h, rel_w = ctx.saved_tensors
        need_q, need_k, need_v, need_rh, need_rw, _ = ctx.needs_input_grad
        ext = _extension()
        grh = grw = None
        with torch.autocast(device_type=q.device.type, enabled=False):
            if rel_h is not None:
                row, col = relative_logit_terms(q, rel_h, rel_w)
            else:
                row = col = q.new_empty(0)
            g = grad_out.to(q.dtype)  # any strides: a broadcast gradient stays one
            gq, gk, gv, grow, gcol = ext.backward_recompute(g, q, k, v, lse, row, col, ctx.kernel_size)
            del row, col, g
            if rel_h is not None:
                grh, grw = relative_term_gradients(
                    grow, gcol, q, rel_h, rel_w, gq if need_q else None, (need_rh, need_rw)
                )
                grh, grw = (None if t is None else t.to(ctx.dtypes[3]) for t in (grh, grw))
        gq = gq.to(ctx.dtypes[0]) if need_q else None
        gk = gk.to(ctx.dtypes[1]) if need_k else None
        gv = gv.to(ctx.dtypes[2]) if need_v else None
        return gq, gk, gv, grh, grw, None


def cpp_local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    kernel_size: int,
    *,
    recompute: bool = False,
) -> torch.Tensor:
    """SASA local attention in the C++ kernel (``impl="cpp"``; CPU tensors) on checked arguments,
    shaped as for :func:`~.sasa_channels_first.apply_channels_first`; ``recompute``: recompute
    the attention weights in backward instead of keeping them (module docstring)."""
    if q.device.type != "cpu":
        raise ValueError(f"impl='cpp' runs on CPU tensors; got {q.device.type} (use impl='auto')")
    if kernel_size > MAX_KERNEL_SIZE:
        raise ValueError(
            f"impl='cpp' takes kernel_size up to {MAX_KERNEL_SIZE}; got {kernel_size} "
            "(use impl='neighborhood' or 'auto')"
        )
    fn = _CppLocalAttentionRecompute.apply if recompute else _CppLocalAttention.apply
    return apply_channels_first(fn, q, k, v, rel_h, rel_w, kernel_size)
