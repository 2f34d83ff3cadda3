"""AA's global attention with 2D relative logits in a C++ kernel, the tables added inside the
softmax: the ``"cpp"`` logit-table route (the CPU default where the kernel builds).

Computes :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables` in its 2D case
(AA, Bello et al., ICCV 2019, Sec. 3.2)::

    logits[n, i, j] = q[n, i] . k[n, j] + T_row[n, i, j // W] + T_col[n, i, j % W]

with the kernel of ``csrc/aa_cpu.cpp``. The SDPA route (``"fused"``) folds the tables into the dot
product by widening every head from ``dk`` to ``dk + H + W`` dims (and pads ``v`` to that width);
at 40x40 a head of 6 channels then does 86-channel dot products. This kernel keeps the head ``dk``
wide and adds the row term (one scalar per key row) and the column term (one vector per block of
key columns) to the logits as it computes them:

* forward: four queries at a time, their logits over every key in a per-thread buffer (``HW``
  values each, never ``HW x HW``), an exact two-pass softmax, the weighted sum of the values;
  saved for backward: the output and one log-sum-exp per query;
* backward: the probabilities recomputed from the log-sum-exp (flash-attention style), then
  ``dL/dq`` (content term), ``dL/dk``, ``dL/dv`` and the tables' gradients (the row and column sums
  of ``dL/dlogits``) in the same pass. The tables' gradients reach ``q`` and the relative
  embeddings through autograd of
  :func:`~aadet.layers.functional.relative_attention.relative_logit_tables_2d`.

Arithmetic in float32 (exp: the vectorized polynomial of ``csrc/cpu_simd.h``, relative error
~1e-7), or float64 for float64 inputs (the exactness tests); half-precision inputs (autocast) are
computed in float32 and the output is returned in ``v``'s dtype. Built and cached as
:mod:`.cpu_kernels` describes; without it ``impl="auto"`` keeps ``"fused"`` and ``impl="cpp"``
raises with the build error. The custom function does not export: under tracing or ONNX export
``impl="auto"`` takes ``"materialized"`` (:mod:`~aadet.layers.functional.dispatch`).
"""
from typing import List, Optional

import torch
import torch.nn.functional as F

from ..checks import check_row_col_tables, row_col_tables_from_index
from .cpu_kernels import KERNELS

__all__ = ["KERNEL", "available", "cpp_attention_with_logit_tables", "cpp_attention_with_row_col_tables"]

#: The kernel (built on first use: :mod:`.cpu_kernels`).
KERNEL = KERNELS["aa"]


def available() -> bool:
    """True if the kernel is built or builds now (the first call may compile it, ~1 minute)."""
    return KERNEL.available()


def _transposed_keys(t: torch.Tensor, h: int, w: int, wq: int) -> torch.Tensor:
    """``[N, L, d]`` -> ``[N, d, H, Wq]`` (keys along rows, zero columns beyond W), contiguous."""
    n, _, d = t.shape
    return F.pad(t.reshape(n, h, w, d).permute(0, 3, 1, 2), (0, wq - w)).contiguous()


def _untransposed(t: torch.Tensor, w: int) -> torch.Tensor:
    """``[N, d, H, Wq]`` -> ``[N, L, d]`` (the inverse of :func:`_transposed_keys`)."""
    n, d, h, _ = t.shape
    return t[..., :w].permute(0, 2, 3, 1).reshape(n, h * w, d)


_EMPTY = torch.empty(0)


class _CppRowColAttention(torch.autograd.Function):
    """``q, k [N, L, dk]``, ``v [N, L, dv]``, ``t_row [N, L, H]``, ``t_col [N, L, W]`` (or None),
    ``width`` W -> ``[N, L, dv]`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, t_row, t_col, width):
        ext = KERNEL.extension("cpp")
        dtypes = (q.dtype, k.dtype, v.dtype,
                  None if t_row is None else t_row.dtype, None if t_col is None else t_col.dtype)
        ct = torch.promote_types(q.dtype, torch.float32)
        n, length, _ = q.shape
        h, w = length // width, width
        with torch.autocast(device_type="cpu", enabled=False):
            lanes = ext.vector_lanes(torch.empty(0, dtype=ct))
            wq = -(-w // lanes) * lanes
            qc = q.to(ct).contiguous()
            kt = _transposed_keys(k.to(ct), h, w, wq)
            vt = _transposed_keys(v.to(ct), h, w, wq)
            tr = _EMPTY.to(ct) if t_row is None else t_row.to(ct).contiguous()
            tc = _EMPTY.to(ct) if t_col is None else t_col.to(ct).contiguous()
            out, lse = ext.forward(qc, kt, vt, tr, tc, w)
        ctx.save_for_backward(qc, kt, vt, tr, tc, out, lse)
        ctx.width, ctx.dtypes = w, dtypes
        return out.to(dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        qc, kt, vt, tr, tc, out, lse = ctx.saved_tensors
        ext = KERNEL.extension("cpp")
        w, dtypes = ctx.width, ctx.dtypes
        with torch.autocast(device_type="cpu", enabled=False):
            g = grad_out.to(qc.dtype).contiguous()
            gq, gkt, gvt, gtr, gtc = ext.backward(qc, kt, vt, tr, tc, out, g, lse, w)
        need = ctx.needs_input_grad
        grads = [
            gq.to(dtypes[0]) if need[0] else None,
            _untransposed(gkt, w).to(dtypes[1]) if need[1] else None,
            _untransposed(gvt, w).to(dtypes[2]) if need[2] else None,
            gtr.to(dtypes[3]) if need[3] and dtypes[3] is not None else None,
            gtc.to(dtypes[4]) if need[4] and dtypes[4] is not None else None,
        ]
        return (*grads, None)


def cpp_attention_with_row_col_tables(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    t_row: Optional[torch.Tensor],
    t_col: Optional[torch.Tensor],
    width: int,
) -> torch.Tensor:
    """``softmax(q . k + t_row[..., j // W] + t_col[..., j % W]) v`` in the C++ kernel (CPU).

    Args:
        q, k: ``[*, L, dk]`` (``q`` already scaled), ``L = H * W`` keys in row-major order.
        v: ``[*, L, dv]``.
        t_row: ``[*, L, H]`` or None; t_col: ``[*, L, W]`` or None.
        width: ``W``.

    Returns:
        ``[*, L, dv]`` in ``v``'s dtype.
    """
    if q.device.type != "cpu":
        raise ValueError(f"impl='cpp' runs on CPU tensors; got {q.device.type} (use impl='auto')")
    check_row_col_tables(q, k, v, t_row, t_col, width)
    *batch, length, _ = q.shape

    def flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.reshape(-1, length, t.shape[-1])

    out = _CppRowColAttention.apply(flat(q), flat(k), flat(v), flat(t_row), flat(t_col), width)
    return out.reshape(*batch, length, v.shape[-1])


def cpp_attention_with_logit_tables(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: List[torch.Tensor],
    key_index: List[torch.Tensor],
    *,
    query_chunk: int = 0,
) -> torch.Tensor:
    """``attention_with_logit_tables``'s signature on the C++ kernel (``impl="cpp"``; the 2D grid
    case, read by :func:`~aadet.layers.functional.checks.row_col_tables_from_index`;
    ``query_chunk`` unused: nothing is materialized)."""
    t_row, t_col, width = row_col_tables_from_index(tables, key_index, q.shape[-2])
    if t_row is None and t_col is None:
        width = q.shape[-2]  # no position term: all keys in one row (whole SIMD vectors)
    return cpp_attention_with_row_col_tables(q, k, v, t_row, t_col, width)
