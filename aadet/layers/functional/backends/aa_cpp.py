"""AA's global relative attention in a C++ kernel, the row/column tables added inside the
softmax: the ``"cpp"`` route of :data:`~aadet.layers.functional.logit_tables.LOGIT_TABLE_BACKENDS`
(CPU tensors).

Computes :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables` in its 2D case
(AA, Bello et al., ICCV 2019, Sec. 3.2)::

    logits[n, i, j] = q[n, i] . k[n, j] + T_row[n, i, j // W] + T_col[n, i, j % W]

with the kernel of ``csrc/aa_cpu.cpp``. The SDPA route (``"fused"``) folds the tables into the dot
product by widening every head from ``dk`` to ``dk + H + W`` dims (and pads ``v`` to that width);
at 40x40 a head of 6 channels then does 86-channel dot products. This kernel keeps the head ``dk``
wide and adds the row term (one scalar per key row) and the column term (one vector per block of
key columns) to the logits as it computes them:

* forward: four queries at a time, their logits over every key in a per-thread buffer (``HW``
  values each), an exact two-pass softmax, the weighted sum of the values; saved for backward:
  the output, one log-sum-exp per query and, where they fit
  (:data:`KEEP_PROBABILITIES_MAX_BYTES`) and a backward follows, the probabilities;
* backward: the kept probabilities, or else recomputed from the log-sum-exp (flash-attention
  style, nothing of size ``HW x HW`` stored), then
  ``dL/dq`` (content term), ``dL/dk``, ``dL/dv`` and the tables' gradients (the row and column sums
  of ``dL/dlogits``) in the same pass. The tables' gradients reach ``q`` and the relative
  embeddings through autograd of
  :func:`~aadet.layers.functional.relative_attention.relative_logit_tables_2d`.

Arithmetic in float32 (exp: the vectorized polynomial of ``csrc/cpu_simd.h``, relative error
~1e-7), or float64 for float64 inputs (the exactness tests); half-precision inputs (autocast) are
computed in float32 and the output is returned in ``v``'s dtype.

Built on first use and cached by :mod:`.cpu_kernels` (:data:`KERNEL`), which says what happens
where it cannot be. A custom autograd Function: it does not export.
"""
import torch

from ..checks import check_row_col_tables
from ..key_grid import row_col_tables_from_index
from ..precision import compute_dtype, input_dtypes
from .cpu_kernels import KERNELS

__all__ = ["KERNEL", "cpp_attention_with_logit_tables", "cpp_attention_with_row_col_tables"]

#: The kernel (a :class:`~.cpu_kernels.CppKernel`: ``KERNEL.available()``, ``KERNEL.build_error()``).
KERNEL = KERNELS["aa"]


def _transposed_keys(t: torch.Tensor, h: int, w: int, wq: int, dtype: torch.dtype) -> torch.Tensor:
    """``[*, L, d]`` (any strides) -> ``[N, d, H, Wq]`` in ``dtype`` (keys along rows, zero columns
    beyond W), contiguous: one copy. An AA layer's keys and values are ``[B, Nh, d, H, W]`` slices
    of its projection's channels seen as ``[B, Nh, L, d]``, so this reads them in their own order."""
    *batch, _, d = t.shape
    size = (*batch, d, h, wq)
    out = t.new_zeros(size, dtype=dtype) if wq > w else t.new_empty(size, dtype=dtype)
    out[..., :w].copy_(t.unflatten(-2, (h, w)).movedim(-1, -3))
    return out.view(-1, d, h, wq)


def _untransposed(t: torch.Tensor, w: int, shape: torch.Size) -> torch.Tensor:
    """``[N, d, H, Wq]`` -> ``shape`` ``[*, L, d]`` (the inverse of :func:`_transposed_keys`)."""
    n, d, h, _ = t.shape
    return t[..., :w].permute(0, 2, 3, 1).reshape(shape)


_EMPTY = torch.empty(0)

#: Forward keeps the attention probabilities for backward when they take at most this many bytes
#: per call (``N * L * H * Wq`` floats, held until backward), and backward reads them instead of
#: recomputing the logits and their exp; larger calls recompute (flash-attention style). Keeping
#: them makes the kernel's forward + backward faster (BENCHMARKS.md, Demo AA); 32 MiB keeps them
#: at the demos' sizes and recomputes at COCO's 640 px. 0: always recompute.
KEEP_PROBABILITIES_MAX_BYTES = 32 * 2**20


class _CppRowColAttention(torch.autograd.Function):
    """``q, k [*, L, dk]``, ``v [*, L, dv]``, ``t_row [*, L, H]``, ``t_col [*, L, W]`` (or None),
    ``width`` W, ``backward_follows`` -> ``[*, L, dv]`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, t_row, t_col, width, backward_follows):
        ext = KERNEL.extension("cpp")
        dtypes = input_dtypes(q, k, v, t_row, t_col)
        ct = compute_dtype(q.dtype)
        *batch, length, _ = q.shape
        h, w = length // width, width
        with torch.autocast(device_type="cpu", enabled=False):
            lanes = ext.vector_lanes(torch.empty(0, dtype=ct))
            wq = -(-w // lanes) * lanes
            qc = q.to(ct).reshape(-1, length, q.shape[-1]).contiguous()
            kt = _transposed_keys(k, h, w, wq, ct)
            vt = _transposed_keys(v, h, w, wq, ct)
            tr = _EMPTY.to(ct) if t_row is None else t_row.to(ct).reshape(-1, length, h).contiguous()
            tc = _EMPTY.to(ct) if t_col is None else t_col.to(ct).reshape(-1, length, w).contiguous()
            # the probabilities kept for backward where they fit (KEEP_PROBABILITIES_MAX_BYTES)
            keep = backward_follows and qc.shape[0] * length * h * wq * ct.itemsize <= KEEP_PROBABILITIES_MAX_BYTES
            out, lse, p = ext.forward(qc, kt, vt, tr, tc, w, keep)  # out [N, dv, L]
        ctx.save_for_backward(qc, kt, vt, tr, tc, out, lse, p)
        ctx.width, ctx.dtypes, ctx.shapes = w, dtypes, (q.shape, k.shape, v.shape)
        return out.transpose(1, 2).view(*batch, length, v.shape[-1]).to(dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        qc, kt, vt, tr, tc, out, lse, p = ctx.saved_tensors
        ext = KERNEL.extension("cpp")
        w, dtypes, shapes = ctx.width, ctx.dtypes, ctx.shapes
        with torch.autocast(device_type="cpu", enabled=False):
            g = grad_out.to(qc.dtype).reshape(qc.shape[0], qc.shape[1], -1).contiguous()
            gq, gkt, gvt, gtr, gtc = ext.backward(qc, kt, vt, tr, tc, out, g, lse, p, w)
        need = ctx.needs_input_grad
        grads = [
            gq.view(shapes[0]).to(dtypes[0]) if need[0] else None,
            _untransposed(gkt, w, shapes[1]).to(dtypes[1]) if need[1] else None,
            _untransposed(gvt, w, shapes[2]).to(dtypes[2]) if need[2] else None,
            gtr.view(*shapes[0][:-1], -1).to(dtypes[3]) if need[3] and dtypes[3] is not None else None,
            gtc.view(*shapes[0][:-1], -1).to(dtypes[4]) if need[4] and dtypes[4] is not None else None,
        ]
        return (*grads, None, None)


def cpp_attention_with_row_col_tables(q, k, v, t_row, t_col, width: int) -> torch.Tensor:
    """``softmax(q . k + t_row[..., j // W] + t_col[..., j % W]) v`` in the C++ kernel (CPU
    tensors), on AA's row/column tables
    (:func:`~aadet.layers.functional.checks.check_row_col_tables`; ``q`` already scaled).
    Returns ``[*, L, dv]`` in ``v``'s dtype."""
    KERNEL.check_device(q)
    check_row_col_tables(q, k, v, t_row, t_col, width)
    backward_follows = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, t_row, t_col))
    return _CppRowColAttention.apply(q, k, v, t_row, t_col, width, backward_follows)


def cpp_attention_with_logit_tables(q, k, v, tables, key_index, *, query_chunk: int = 0) -> torch.Tensor:
    """``attention_with_logit_tables``'s signature on the C++ kernel (``impl="cpp"``; the 2D grid
    case, read by :func:`~aadet.layers.functional.key_grid.row_col_tables_from_index`;
    ``query_chunk`` unused: nothing is materialized)."""
    t_row, t_col, width = row_col_tables_from_index(tables, key_index, q.shape[-2])
    if t_row is None and t_col is None:
        width = q.shape[-2]  # no position term: all keys in one row (whole SIMD vectors)
    return cpp_attention_with_row_col_tables(q, k, v, t_row, t_col, width)
