"""AA's global relative attention as one Triton flash-attention kernel: the ``"triton"`` route of
:data:`~aadet.layers.functional.logit_tables.LOGIT_TABLE_BACKENDS`.

The logits of AA (Bello et al., ICCV 2019, Sec. 3.2) factor into a content term and two per-query
tables indexed by the key's row and column on a row-major ``H x W`` key grid::

    logits[n, i, j] = q[n, i] . k[n, j] + T_row[n, i, j // W] + T_col[n, i, j % W]

(``T_row`` / ``T_col`` from
:func:`~aadet.layers.functional.relative_attention.relative_logit_tables_2d`). The SDPA ("fused")
route adds the tables by widening every head to ``dk + H + W`` dims; this kernel adds them to the
logit tile instead, so the head stays ``dk`` wide:

* **Tiles follow image rows.** A key tile is ``ROWS`` whole image rows times ``BLOCK_W`` columns
  (``BLOCK_W`` = W rounded up to a power of two, at most ``max_block_w``; wider maps take several
  column chunks), slot ``(r, c)`` holding key ``(r0 + r) * W + c0 + c``; padded slots are masked.
  ``T_row`` / ``T_col`` are then read as ``[BLOCK_M, tile]`` tiles of the ``[L, H]`` / ``[L, W]``
  tables.
* **Forward**: online softmax in float32 (``exp2``), ``q . k`` and ``p . v`` on ``tl.dot`` with
  float32 accumulation (IEEE float32 products for float32 inputs: no TF32); saves only the output
  and the log-sum-exp per query.
* **Backward** recomputes the probabilities: one kernel per key tile for ``dk, dv`` (loops over
  queries), one per query block for ``dq`` and the table gradients (loops over keys). Because a
  key tile is whole rows, ``dT_row[i, r]`` is the sum of ``dS`` over row ``r`` of the tile and
  ``dT_col[i, :]`` a running vector sum over the tile's rows: every table gradient entry has one
  owner, so no atomics (and deterministic). The tables' gradients then flow into ``q`` and the
  relative embeddings through PyTorch autograd of ``relative_logit_tables_2d``.

:func:`triton_attention_on_key_grid` runs the same kernels for queries that are not the keys
(``Lq`` queries over an ``H x W`` key grid): HaloNet's route (:mod:`.halonet_triton`), each block's
queries over its haloed window.

In terms of :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables`: its 2D
case ``tables = [T_row, T_col]``, ``key_index = [j // W, j % W]`` is
``triton_attention_with_row_col_tables(q, k, v, T_row, T_col, W)``;
:func:`triton_attention_with_logit_tables` takes ``(tables, key_index)`` as they are and reads the
grid back (:func:`~aadet.layers.functional.key_grid.row_col_tables_from_index`; any other key
layout is refused).

No scaling happens here (``q`` arrives scaled, as everywhere in this package). Inputs: float32,
float16 or bfloat16 ``q, k, v`` (one dtype), tables in float32 (any float dtype is read as float32;
their gradients come back in their own dtype). Any ``H, W, dk, dv``: head dims are padded to powers
of two with masks.

Devices: CUDA (compiled by Triton), or CPU under Triton's interpreter (slow: for tests), as
:mod:`.triton_kernels` describes (``TRITON_INTERPRETED`` says which).
"""
import math
from typing import Tuple

import torch

from ..checks import check_one_dtype, check_row_col_tables
from ..key_grid import row_col_tables_from_index
from .triton_kernels import TRITON_AVAILABLE, TRITON_DTYPES, TRITON_INTERPRETED, jit, tl, triton

__all__ = [
    "TRITON_AVAILABLE",
    "TRITON_DTYPES",
    "TRITON_INTERPRETED",
    "triton_attention_on_key_grid",
    "triton_attention_with_logit_tables",
    "triton_attention_with_row_col_tables",
]

# Default tile sizes: queries per program, key slots per tile (target), widest column chunk.
BLOCK_M = 64
BLOCK_N = 64
MAX_BLOCK_W = 128
_MIN_DOT = 16  # tl.dot needs every tile dimension >= 16 on the GPU
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid axis (the (batch, head) pairs)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# ----------------------------------------------------------------------------- kernels
if TRITON_AVAILABLE:

    def _mm(a, b, OP_F32: tl.constexpr):
        """``a @ b`` accumulated in float32; IEEE float32 products for float32 operands (no TF32).
        ``OP_F32`` multiplies in float32 (exact for half operands): for the interpreter, whose
        ``tl.dot`` cannot take bfloat16."""
        if OP_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if a.dtype == tl.float32:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)  # half operands: tensor cores, float32 accumulation
        return c

    _mm = jit(_mm)

    def _rows(X, n, L, D, idx, offs, ok):
        """``[len(idx), D_PAD]``: rows ``idx`` of the ``[L, D]`` matrix of (batch, head) ``n``
        (columns ``offs``), 0 where not ``ok`` or past ``D``."""
        return tl.load(X + n * L * D + idx[:, None] * D + offs[None, :],
                       mask=ok[:, None] & (offs[None, :] < D), other=0.0)

    _rows = jit(_rows)

    def _store_rows(X, n, L, D, idx, offs, ok, val):
        """Writes ``val`` (in ``X``'s dtype) to the rows :func:`_rows` reads."""
        tl.store(X + n * L * D + idx[:, None] * D + offs[None, :], val.to(X.dtype.element_ty),
                 mask=ok[:, None] & (offs[None, :] < D))

    _store_rows = jit(_store_rows)

    def _logits(q, k, TR, TC, n, L, H, W, offs_m, rows, cols, qk_ok,
                HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr, OP_F32: tl.constexpr):
        """``[BM, BN]`` logits of queries ``offs_m`` against the keys of a tile (image rows
        ``rows``, columns ``cols``): ``q . k`` plus the row and column tables' entries."""
        s = _mm(q, tl.trans(k), OP_F32)
        if HAS_ROW:
            s += tl.load(TR + n * L * H + offs_m[:, None] * H + rows[None, :], mask=qk_ok, other=0.0)
        if HAS_COL:
            s += tl.load(TC + n * L * W + offs_m[:, None] * W + cols[None, :], mask=qk_ok, other=0.0)
        return s

    _logits = jit(_logits)

    def _fwd_kernel(
        Q, K, V, TR, TC, O, LSE,
        L, H, W, DK, DV,
        HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
        BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
        D_PAD: tl.constexpr, DV_PAD: tl.constexpr, OP_F32: tl.constexpr,
    ):
        """One program: BLOCK_M queries of one (batch, head) against all keys."""
        pid_m = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        m_ok = offs_m < L
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        slot = tl.arange(0, ROWS * BLOCK_W)  # [BN] key slots: (row, column) of the tile
        slot_r = slot // BLOCK_W
        slot_c = slot % BLOCK_W

        q = _rows(Q, n, L, DK, offs_m, offs_d, m_ok)  # [BM, D_PAD]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
        for c0 in range(0, W, BLOCK_W):
            cols = c0 + slot_c
            for r0 in range(0, H, ROWS):
                rows = r0 + slot_r
                kv_ok = (rows < H) & (cols < W)  # [BN]
                keys = rows * W + cols
                k = _rows(K, n, H * W, DK, keys, offs_d, kv_ok)  # [BN, D_PAD]
                qk_ok = m_ok[:, None] & kv_ok[None, :]
                s = _logits(q, k, TR, TC, n, L, H, W, offs_m, rows, cols, qk_ok, HAS_ROW, HAS_COL, OP_F32)
                s = tl.where(kv_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid key
                alpha = tl.exp2((m_i - m_new) * 1.4426950408889634)
                p = tl.exp2((s - m_new[:, None]) * 1.4426950408889634)  # [BM, BN]
                l_i = l_i * alpha + tl.sum(p, 1)
                v = _rows(V, n, H * W, DV, keys, offs_dv, kv_ok)  # [BN, DV_PAD]
                acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, OP_F32)
                m_i = m_new
        out = acc / l_i[:, None]
        _store_rows(O, n, L, DV, offs_m, offs_dv, m_ok, out)
        tl.store(LSE + n * L + offs_m, m_i + tl.log(l_i), mask=m_ok)

    def _bwd_dkdv_kernel(
        Q, K, V, TR, TC, DO, LSE, DELTA, DKEY, DVAL,
        L, H, W, DK, DV, N_ROW_BLOCKS,
        HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
        BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
        D_PAD: tl.constexpr, DV_PAD: tl.constexpr, OP_F32: tl.constexpr,
    ):
        """One program: one key tile of one (batch, head), looping over all queries."""
        tile = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        c0 = (tile // N_ROW_BLOCKS) * BLOCK_W
        r0 = (tile % N_ROW_BLOCKS) * ROWS
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        slot = tl.arange(0, ROWS * BLOCK_W)
        rows = r0 + slot // BLOCK_W
        cols = c0 + slot % BLOCK_W
        kv_ok = (rows < H) & (cols < W)
        keys = rows * W + cols
        k = _rows(K, n, H * W, DK, keys, offs_d, kv_ok)  # [BN, D_PAD]
        v = _rows(V, n, H * W, DV, keys, offs_dv, kv_ok)  # [BN, DV_PAD]
        dk = tl.zeros([ROWS * BLOCK_W, D_PAD], tl.float32)
        dv = tl.zeros([ROWS * BLOCK_W, DV_PAD], tl.float32)
        for m0 in range(0, L, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < L
            qk_ok = m_ok[:, None] & kv_ok[None, :]
            q = _rows(Q, n, L, DK, offs_m, offs_d, m_ok)  # [BM, D_PAD]
            do = _rows(DO, n, L, DV, offs_m, offs_dv, m_ok)  # [BM, DV_PAD]
            lse = tl.load(LSE + n * L + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + n * L + offs_m, mask=m_ok, other=0.0)
            s = _logits(q, k, TR, TC, n, L, H, W, offs_m, rows, cols, qk_ok, HAS_ROW, HAS_COL, OP_F32)
            p = tl.exp2((s - lse[:, None]) * 1.4426950408889634)
            p = tl.where(qk_ok, p, 0.0)  # [BM, BN] probabilities
            dv += _mm(tl.trans(p.to(do.dtype)), do, OP_F32)
            dp = _mm(do, tl.trans(v), OP_F32)  # [BM, BN]
            ds = p * (dp - delta[:, None])  # d loss / d logits
            dk += _mm(tl.trans(ds.to(q.dtype)), q, OP_F32)
        _store_rows(DKEY, n, H * W, DK, keys, offs_d, kv_ok, dk)
        _store_rows(DVAL, n, H * W, DV, keys, offs_dv, kv_ok, dv)

    def _bwd_dq_kernel(
        Q, K, V, TR, TC, DO, LSE, DELTA, DQ, DTR, DTC,
        L, H, W, DK, DV, N,
        HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
        BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
        D_PAD: tl.constexpr, DV_PAD: tl.constexpr, OP_F32: tl.constexpr,
    ):
        """One program: BLOCK_M queries of one (batch, head); dq and both table gradients.

        ``DTR`` is ``[n_column_chunks, N, L, H]``: each column chunk writes its own row sums.
        """
        pid_m = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < L
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        slot = tl.arange(0, ROWS * BLOCK_W)
        slot_r = slot // BLOCK_W
        slot_c = slot % BLOCK_W
        tile_rows = tl.arange(0, ROWS)
        tile_cols = tl.arange(0, BLOCK_W)
        q = _rows(Q, n, L, DK, offs_m, offs_d, m_ok)
        do = _rows(DO, n, L, DV, offs_m, offs_dv, m_ok)
        lse = tl.load(LSE + n * L + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(DELTA + n * L + offs_m, mask=m_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for c0 in range(0, W, BLOCK_W):
            cols = c0 + slot_c
            dt_col = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
            for r0 in range(0, H, ROWS):
                rows = r0 + slot_r
                kv_ok = (rows < H) & (cols < W)
                qk_ok = m_ok[:, None] & kv_ok[None, :]
                keys = rows * W + cols
                k = _rows(K, n, H * W, DK, keys, offs_d, kv_ok)
                v = _rows(V, n, H * W, DV, keys, offs_dv, kv_ok)
                s = _logits(q, k, TR, TC, n, L, H, W, offs_m, rows, cols, qk_ok, HAS_ROW, HAS_COL, OP_F32)
                p = tl.exp2((s - lse[:, None]) * 1.4426950408889634)
                p = tl.where(qk_ok, p, 0.0)
                dp = _mm(do, tl.trans(v), OP_F32)
                ds = p * (dp - delta[:, None])  # [BM, BN], zero on padded slots
                dq += _mm(ds.to(k.dtype), k, OP_F32)
                ds3 = tl.reshape(ds, (BLOCK_M, ROWS, BLOCK_W))  # slot = (row, column)
                if HAS_ROW:
                    r_idx = r0 + tile_rows
                    tl.store(
                        DTR + ((c0 // BLOCK_W) * N + n) * L * H
                        + offs_m[:, None] * H + r_idx[None, :],
                        tl.sum(ds3, 2),  # [BM, ROWS]: sum over the row's columns
                        mask=m_ok[:, None] & (r_idx[None, :] < H),
                    )
                if HAS_COL:
                    dt_col += tl.sum(ds3, 1)  # [BM, BLOCK_W]: sum over the tile's rows
            if HAS_COL:
                c_idx = c0 + tile_cols
                tl.store(DTC + n * L * W + offs_m[:, None] * W + c_idx[None, :], dt_col,
                         mask=m_ok[:, None] & (c_idx[None, :] < W))
        _store_rows(DQ, n, L, DK, offs_m, offs_d, m_ok, dq)

    _KERNELS = {"fwd": jit(_fwd_kernel), "dkdv": jit(_bwd_dkdv_kernel), "dq": jit(_bwd_dq_kernel)}


# ----------------------------------------------------------------------------- launch
class _Plan:
    """Tile sizes and grid for one ``[N, L = H*W]`` problem."""

    def __init__(self, n, h, w, dk, dv, block_m, block_n, max_block_w):
        for name, val in (("block_m", block_m), ("block_n", block_n), ("max_block_w", max_block_w)):
            if val < 1 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= 1; got {val}")
        if block_m < _MIN_DOT or block_n < _MIN_DOT:
            raise ValueError(f"block_m and block_n must be >= {_MIN_DOT}; got {block_m}, {block_n}")
        self.n, self.h, self.w, self.dk, self.dv = n, h, w, dk, dv
        self.block_m = block_m
        self.block_w = min(_pow2(w), max_block_w)
        self.rows = max(1, block_n // self.block_w, -(-_MIN_DOT // self.block_w))
        self.n_row_blocks = -(-h // self.rows)
        self.n_col_chunks = -(-w // self.block_w)
        self.d_pad = max(_MIN_DOT, _pow2(dk))
        self.dv_pad = max(_MIN_DOT, _pow2(dv))

    def meta(self, has_row, has_col, dtype):
        return dict(
            HAS_ROW=has_row, HAS_COL=has_col, BLOCK_M=self.block_m, ROWS=self.rows,
            BLOCK_W=self.block_w, D_PAD=self.d_pad, DV_PAD=self.dv_pad,
            OP_F32=TRITON_INTERPRETED and dtype == torch.bfloat16,
        )


def _check_runnable(q: torch.Tensor):
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"the 'triton' attention route takes q, k, v in {[str(t) for t in TRITON_DTYPES]}; "
            f"got {q.dtype} (float64 references: impl='materialized')"
        )
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            "the 'triton' attention route needs the triton package (pip install triton); "
            "use impl='fused' or 'materialized' instead"
        )
    if q.device.type != "cuda" and not TRITON_INTERPRETED:
        raise RuntimeError(
            f"the 'triton' attention route runs on CUDA; got tensors on {q.device}. On CPU it runs "
            "only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is first "
            "imported; slow: for tests); otherwise use impl='fused' or 'materialized'"
        )


class _RowColAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, t_row, t_col, plan):
        n, length = q.shape[0], q.shape[1]
        out = torch.empty(n, length, plan.dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(n, length, dtype=torch.float32, device=q.device)
        dummy = q.new_empty(0, dtype=torch.float32)
        _KERNELS["fwd"][(triton.cdiv(length, plan.block_m), n)](
            q, k, v, dummy if t_row is None else t_row, dummy if t_col is None else t_col,
            out, lse, length, plan.h, plan.w, plan.dk, plan.dv,
            **plan.meta(t_row is not None, t_col is not None, q.dtype),
        )
        ctx.save_for_backward(q, k, v, t_row, t_col, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, t_row, t_col, out, lse = ctx.saved_tensors
        plan = ctx.plan
        n, length = q.shape[0], q.shape[1]
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # [N, L]: rowsum(dO * O) = sum_j p dp
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dummy = q.new_empty(0, dtype=torch.float32)
        has_row, has_col = t_row is not None, t_col is not None
        tr = t_row if has_row else dummy
        tc = t_col if has_col else dummy
        dt_row = (
            torch.empty(plan.n_col_chunks, n, length, plan.h, dtype=torch.float32, device=q.device)
            if has_row else dummy
        )
        dt_col = torch.empty_like(t_col) if has_col else dummy
        meta = plan.meta(has_row, has_col, q.dtype)
        _KERNELS["dkdv"][(plan.n_row_blocks * plan.n_col_chunks, n)](
            q, k, v, tr, tc, dout, lse, delta, dk, dv,
            length, plan.h, plan.w, plan.dk, plan.dv, plan.n_row_blocks, **meta,
        )
        _KERNELS["dq"][(triton.cdiv(length, plan.block_m), n)](
            q, k, v, tr, tc, dout, lse, delta, dq, dt_row, dt_col,
            length, plan.h, plan.w, plan.dk, plan.dv, n, **meta,
        )
        if has_row:
            dt_row = dt_row[0] if plan.n_col_chunks == 1 else dt_row.sum(0)
        return dq, dk, dv, dt_row if has_row else None, dt_col if has_col else None, None


def triton_attention_with_row_col_tables(
    q, k, v, t_row, t_col, width: int, *, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
    max_block_w: int = MAX_BLOCK_W,
) -> torch.Tensor:
    """``softmax_j(q_i . k_j + T_row[i, j // W] + T_col[i, j % W]) v_j`` with one Triton kernel.

    Args:
        q, k, v, t_row, t_col, width: AA's row/column tables
            (:func:`~aadet.layers.functional.checks.check_row_col_tables`; ``q`` already
            scaled): ``q, k, v`` in one of :data:`TRITON_DTYPES`, the tables read in float32.
        block_m, block_n, max_block_w: tile sizes (powers of two): queries per program, key
            slots per tile (rounded up to whole rows), widest column chunk.

    Returns:
        ``[*, L, dv]`` in the dtype of ``v``; differentiable in q, k, v and both tables.
    """
    h, w = check_row_col_tables(q, k, v, t_row, t_col, width)
    return _launch(q, k, v, t_row, t_col, h, w, block_m, block_n, max_block_w)


def triton_attention_on_key_grid(
    q, k, v, t_row, t_col, key_hw: Tuple[int, int], *, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
    max_block_w: int = MAX_BLOCK_W,
) -> torch.Tensor:
    """The same kernel for queries that are not the keys: ``Lq`` queries over keys on a row-major
    ``H x W`` grid (``key_hw``), ``softmax_j(q_i . k_j + T_row[i, j // W] + T_col[i, j % W]) v_j``
    (HaloNet's blocks: a block's queries over its haloed window).

    Args:
        q: ``[*, Lq, dk]``; k: ``[*, H W, dk]``; v: ``[*, H W, dv]`` (one dtype of
            :data:`TRITON_DTYPES`, one device); t_row: ``[*, Lq, H]``, t_col: ``[*, Lq, W]`` or None,
            read in float32. A key left out of every query's softmax (outside a map) takes a large
            negative table entry: every tile of ``ROWS`` whole key rows needs one finite logit per
            query for the online softmax, which a finite mask keeps (its keys' weights come out
            exactly 0 once any real logit is seen).

    Returns:
        ``[*, Lq, dv]`` in ``v``'s dtype; differentiable in q, k, v and both tables.
    """
    h, w = key_hw
    *batch, length, _ = q.shape
    check_one_dtype(q, k, v)
    if k.dim() != q.dim() or tuple(k.shape[:-2]) != tuple(batch) or k.shape[-2:] != (h * w, q.shape[-1]):
        raise ValueError(f"k must have shape {[*batch, h * w, q.shape[-1]]} (keys on the {h}x{w} grid); "
                         f"got {tuple(k.shape)}")
    if v.dim() != k.dim() or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"v must have shape [*, H W, dv] with [*, H W] = {list(k.shape[:-1])}; got {tuple(v.shape)}")
    for name, t, m in (("t_row", t_row, h), ("t_col", t_col, w)):
        if t is not None and (tuple(t.shape) != (*batch, length, m) or t.device != q.device):
            raise ValueError(f"{name} must have shape {[*batch, length, m]} on {q.device}; got "
                             f"{tuple(t.shape)} on {t.device}")
    return _launch(q, k, v, t_row, t_col, h, w, block_m, block_n, max_block_w)


def _launch(q, k, v, t_row, t_col, h, w, block_m, block_n, max_block_w) -> torch.Tensor:
    """The kernels on checked arguments: ``q [*, Lq, dk]`` over keys ``[*, h w, dk]``."""
    *batch, length, dk = q.shape
    n = math.prod(batch)
    if n > _MAX_GRID_Y:
        raise ValueError(
            f"the 'triton' attention route launches one program row per (batch, head) pair, at "
            f"most {_MAX_GRID_Y}; got {n} = prod{tuple(batch)}"
        )
    plan = _Plan(n, h, w, dk, v.shape[-1], block_m, block_n, max_block_w)
    _check_runnable(q)

    def flat(t, rows, m):
        return None if t is None else t.reshape(n, rows, m).contiguous()

    def flat_table(t, m):  # tables are read in float32; autograd casts the gradient back
        return None if t is None else flat(t, length, m).float()

    out = _RowColAttention.apply(
        flat(q, length, dk), flat(k, h * w, dk), flat(v, h * w, v.shape[-1]),
        flat_table(t_row, h), flat_table(t_col, w), plan,
    )  # [N, Lq, dv]
    return out.reshape(*batch, length, v.shape[-1])


def triton_attention_with_logit_tables(q, k, v, tables, key_index, **tiles) -> torch.Tensor:
    """``attention_with_logit_tables``'s signature on the Triton kernel: the 2D grid case, read by
    :func:`~aadet.layers.functional.key_grid.row_col_tables_from_index`. ``tiles``: see
    :func:`triton_attention_with_row_col_tables`.
    """
    t_row, t_col, width = row_col_tables_from_index(tables, key_index, q.shape[-2])
    return triton_attention_with_row_col_tables(q, k, v, t_row, t_col, width, **tiles)
