"""AA's global relative attention through PyTorch's ``flex_attention`` (``score_mod``): the
``"flex"`` route of :data:`~aadet.layers.functional.logit_tables.LOGIT_TABLE_BACKENDS`.

``flex_attention`` lets a ``score_mod(score, b, h, q_idx, kv_idx)`` edit every logit inside its
fused kernel, so the tables of
:func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables` are added without
widening the head::

    score_mod: score + sum_g T_g[b, q_idx, key_index_g[kv_idx]]

with ``T_g`` and ``key_index_g`` captured tensors (AA's 2D case: ``[T_row, T_col]`` keyed by
``[j // W, j % W]``). Any key index layout works, so this route takes the general
``(tables, key_index)`` arguments.

Where it runs:

* **CUDA**: compiled (``torch.compile(flex_attention)``, one Triton kernel, scores in float32);
  forward and backward, gradients into the captured tables included (PyTorch accumulates them
  with atomic adds). Head dims are zero-padded to a power of two >= 16 (exact).
* **CPU: forward only.** ``flex_attention`` has no CPU backward (torch raises
  ``NotImplementedError``), so a call that needs gradients on CPU raises here, naming the way
  out, unless ``cpu_backward="materialized"`` is passed explicitly: then it runs the
  materialized route (:mod:`.aa_materialized`) instead. By default CPU runs flex's
  eager path, which stores the ``[N, Lq, Lk]`` scores (a reference, not a fast route);
  ``compiled=True`` uses Inductor's CPU kernel.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..checks import check_grid_width, check_logit_tables, check_one_dtype
from ..key_grid import grid_key_index
from .aa_materialized import materialized_attention_with_logit_tables

__all__ = [
    "FLEX_CPU_BACKWARD",
    "flex_attention_with_logit_tables",
    "flex_attention_with_row_col_tables",
]

# Allowed values of ``cpu_backward`` (the one definition).
FLEX_CPU_BACKWARD = ("error", "materialized")

_MIN_HEAD_DIM = 16
_COMPILED = None


def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention)
    return _COMPILED


def _pad_head(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    target = max(_MIN_HEAD_DIM, 1 << max(0, d - 1).bit_length())
    return x if target == d else F.pad(x, (0, target - d))


def flex_attention_with_logit_tables(
    q, k, v, tables, key_index, *, compiled: Optional[bool] = None, cpu_backward: str = "error"
) -> torch.Tensor:
    """``softmax(q . k + sum_g tables[g][..., key_index[g]]) v`` with ``flex_attention``.

    Args:
        q, k, v, tables, key_index: as for
            :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables` (checked
            here), ``q, k, v`` of one dtype; float32 tables keep the logits in float32 under half
            inputs.
        compiled: run the compiled kernel (default: on CUDA yes, on CPU no -- eager reference).
        cpu_backward: ``"error"`` (default: a CPU call that needs gradients raises) or
            ``"materialized"`` (such a call runs the materialized route instead).

    Returns:
        ``[*, Lq, dv]`` in the dtype of ``v``.
    """
    if cpu_backward not in FLEX_CPU_BACKWARD:
        raise ValueError(f"cpu_backward must be one of {FLEX_CPU_BACKWARD}; got {cpu_backward!r}")
    check_logit_tables(q, k, v, tables, key_index)
    check_one_dtype(q, k, v)
    *batch, lq, d = q.shape
    lk, dv = k.shape[-2], v.shape[-1]

    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, *tables))
    if q.device.type == "cpu" and needs_grad:
        if cpu_backward == "materialized":
            return materialized_attention_with_logit_tables(q, k, v, tables, key_index)
        raise RuntimeError(
            "the 'flex' attention route has no backward on CPU (flex_attention raises "
            "NotImplementedError); run it under torch.no_grad(), on CUDA, pass "
            "cpu_backward='materialized', or use impl='fused' / 'materialized'"
        )
    compiled = q.device.type == "cuda" if compiled is None else bool(compiled)

    n = 1
    for s in batch:
        n *= s
    # flex wants [B, Hq, L, E]: every (batch, head) pair becomes one batch entry of one head.
    q4 = q.reshape(n, 1, lq, d)
    k4 = k.reshape(n, 1, lk, d)
    v4 = v.reshape(n, 1, lk, dv)
    if compiled:  # zero head dims are exact: they add 0 to q.k and give 0 outputs
        q4, k4, v4 = _pad_head(q4), _pad_head(k4), _pad_head(v4)
    tabs = [t.reshape(n, lq, t.shape[-1]) for t in tables]  # [N, Lq, M_g]
    idxs = [idx.to(q.device) for idx in key_index]  # [Lk]

    def score_mod(score, b, h, q_idx, kv_idx):
        for t, idx in zip(tabs, idxs):
            score = score + t[b, q_idx, idx[kv_idx]]
        return score

    out = _flex(compiled)(q4, k4, v4, score_mod=score_mod, scale=1.0)  # [N, 1, Lq, dv_pad]
    return out[..., :dv].reshape(*batch, lq, dv).to(v.dtype)


def flex_attention_with_row_col_tables(q, k, v, t_row, t_col, width: int, **kwargs) -> torch.Tensor:
    """AA's 2D case, ``softmax_j(q_i . k_j + T_row[i, j // W] + T_col[i, j % W]) v_j``, on AA's
    row/column tables (:func:`~aadet.layers.functional.checks.check_row_col_tables`); ``kwargs``
    go to :func:`flex_attention_with_logit_tables`.
    """
    length = q.shape[-2]
    check_grid_width(width, length)
    rows, cols = grid_key_index(length // width, width, q.device)
    tables, key_index = [], []
    if t_row is not None:
        tables.append(t_row)
        key_index.append(rows)
    if t_col is not None:
        tables.append(t_col)
        key_index.append(cols)
    return flex_attention_with_logit_tables(q, k, v, tables, key_index, **kwargs)
