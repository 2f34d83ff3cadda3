"""The one call into :func:`torch.nn.functional.scaled_dot_product_attention` of the fused routes
(AA's and SASA's :mod:`.aa_sdpa`, HaloNet's :mod:`.halonet_sdpa`), shaped so that SDPA's fused
kernels can take it and their known limits are never reached:

* **4-D.** SDPA's fused kernels (flash, memory-efficient, cuDNN; on CPU its flash kernel) take only
  ``[batch, heads, L, E]`` inputs; given 3-D ones, SDPA silently falls back to its math kernel,
  which stores the whole ``[N, Lq, Lk]`` attention matrix for backward.
* **Widths a multiple of 8, v as wide as q.** The flash kernels need equal head widths for q, k and
  v, multiples of 8 (else another kernel runs, silently); q and k are zero-padded to the next
  multiple of 8 and v to the same width (zero columns add nothing to ``q . k``, and the padded
  output columns are dropped).
* **Batch and head extents at most** :data:`MAX_GRID_EXTENT`. The CUDA kernels launch a grid whose
  batch and head dimensions may not exceed 65,535 (CUDA's limit on a grid's y and z extents;
  PyTorch issues 142228 and 177985): the rows of ``N`` go in chunks of at most that many, each
  chunk one call, the outputs concatenated.

The scale is 1 (the routes' q comes scaled, and AA's tables are appended to it unscaled).
"""
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["MAX_GRID_EXTENT", "WIDTH_MULTIPLE", "fused_sdpa"]

#: The largest batch or head extent one SDPA call gets (CUDA's grid y/z limit).
MAX_GRID_EXTENT = 65535
#: Head widths are padded to a multiple of this (the flash kernels' alignment).
WIDTH_MULTIPLE = 8


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
               *, max_extent: int = MAX_GRID_EXTENT) -> torch.Tensor:
    """``softmax(q . k^T + attn_mask) v`` (scale 1) through SDPA, shaped as the module docstring says.

    Args:
        q: ``[N, Lq, E]`` or ``[N, G, Lq, E]``; k: ``[N(, G), Lk, E]``; v: ``[N(, G), Lk, Ev]``.
        attn_mask: an additive float bias broadcastable to ``[N(, G), Lq, Lk]``, or None.
        max_extent: the most rows of ``N`` (and the most ``G``) one call gets.

    Returns:
        ``[N(, G), Lq, Ev]`` in SDPA's output dtype.
    """
    three_d = q.dim() == 3
    if three_d:  # [N, L, E] -> [1, N, L, E]: N as heads, so that a fused kernel may take it
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.dim() == 3 else attn_mask
    dv = v.shape[-1]
    width = -(-max(q.shape[-1], dv) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    q, k, v = _pad_last(q, width), _pad_last(k, width), _pad_last(v, width)
    batch_dim = 1 if three_d else 0  # the dimension that holds N
    n = q.shape[batch_dim]
    if n <= max_extent and (three_d or q.shape[1] <= max_extent):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0)
    else:
        if not three_d and q.shape[1] > max_extent:
            raise ValueError(f"fused_sdpa: {q.shape[1]} heads in one call; at most {max_extent}")
        parts = []
        for start in range(0, n, max_extent):
            part = slice(start, start + max_extent)
            index = (slice(None), part) if three_d else (part,)
            mask = None
            if attn_mask is not None:
                m_dim = batch_dim + attn_mask.dim() - q.dim()  # the mask's dimension for N, if it has one
                mask = attn_mask
                if m_dim >= 0 and attn_mask.shape[m_dim] != 1:
                    mask = attn_mask.narrow(m_dim, start, min(max_extent, n - start))
            parts.append(F.scaled_dot_product_attention(q[index], k[index], v[index], attn_mask=mask, scale=1.0))
        out = torch.cat(parts, dim=batch_dim)
    out = out[..., :dv]
    return out.squeeze(0) if three_d else out
