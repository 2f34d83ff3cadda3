"""AA's global relative attention as one augmented dot product through SDPA: the ``"fused"``
route of :data:`~aadet.layers.functional.logit_tables.LOGIT_TABLE_BACKENDS`, which SASA's blocked
``"fused"`` route (:mod:`.sasa_blocked`) also calls.

Computes :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables`,
``softmax(q . k + sum_g T_g[..., i, idx_g[j]]) v``, by appending the tables to ``q`` and one-hot
indicators of ``idx_g[j]`` to ``k``: then ``[q, T] . [k, onehot] = q.k + sum_g T_g[i, idx_g[j]]``
and the whole logit is one dot product, so
:func:`torch.nn.functional.scaled_dot_product_attention` runs it with a fused kernel (flash /
memory-efficient on CUDA, flash on CPU) that never stores the ``[N, Lq, Lk]`` attention matrix
(called through :func:`.sdpa.fused_sdpa`, which shapes it so that a fused kernel can).
Costs ``sum_g M_g`` extra head dims. SDPA's kernels keep logits and softmax in float32 under
autocast.
"""
import torch
import torch.nn.functional as F

from ..key_grid import grid_indicators, grid_of
from .sdpa import fused_sdpa

__all__ = ["sdpa_attention_with_logit_tables"]


def _indicators(key_index, sizes, like: torch.Tensor) -> torch.Tensor:
    """Multi-hot key-side indicators ``[Lk, sum(sizes)]`` in the dtype/device of ``like`` (a key
    grid's cached ones for AA's index, :func:`~..key_grid.grid_indicators`)."""
    grid = grid_of(key_index)
    if grid is not None and list(sizes) == [grid[0] if r == "row" else grid[1] for r in grid[2]]:
        return grid_indicators(*grid, like.dtype, like.device)
    parts = [F.one_hot(idx.to(like.device), m).to(like.dtype) for idx, m in zip(key_index, sizes)]
    return torch.cat(parts, dim=-1)


def sdpa_attention_with_logit_tables(q, k, v, tables, key_index, *, query_chunk: int = 0):
    """The augmented dot product through SDPA (``impl="fused"``), on checked arguments (shapes as
    in :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables`; ``query_chunk``
    unused: nothing is materialized)."""
    if tables:
        sizes = [t.shape[-1] for t in tables]
        ind = _indicators(key_index, sizes, k)  # [Lk, M]
        q_aug = torch.cat([q, *[t.to(q.dtype) for t in tables]], dim=-1)  # [N, Lq, d + M]
        k_aug = torch.cat([k, ind.expand(*k.shape[:-1], ind.shape[-1])], dim=-1)  # [N, Lk, d + M]
    else:  # no position term: plain attention
        q_aug, k_aug = q, k
    return fused_sdpa(q_aug, k_aug, v)  # [N, Lq, dv]: 4-D, aligned widths, chunks SDPA's kernels take
