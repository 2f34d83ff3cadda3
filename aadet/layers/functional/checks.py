"""Argument checks of the public attention functions (one definition each; errors say what was
expected and what was given)."""
from typing import Optional

import torch

__all__ = ["check_block_size", "check_kernel_size", "check_qkv", "check_query_chunk"]


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
) -> None:
    """``q, k [B, Nh, H, W, dk]``, ``v [B, Nh, H, W, dv]``; ``rel_h [R, dk//2]`` and
    ``rel_w [R, dk - dk//2]`` with the same ``R``, or both None (SASA's split embeddings)."""
    if q.dim() != 5 or k.dim() != 5 or v.dim() != 5:
        raise ValueError(
            "q, k, v must be [B, Nh, H, W, d]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape; got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"v must be [B, Nh, H, W, dv] with q's first four dims {tuple(q.shape[:-1])}; "
            f"got {tuple(v.shape)}"
        )
    dk = q.shape[-1]
    if (rel_h is None) != (rel_w is None):
        raise ValueError("rel_h and rel_w must both be tensors or both be None")
    if rel_h is not None:
        if rel_h.dim() != 2 or rel_h.shape[1] != dk // 2:
            raise ValueError(f"rel_h must be [R, dk//2={dk // 2}]; got {tuple(rel_h.shape)}")
        if rel_w.dim() != 2 or rel_w.shape[1] != dk - dk // 2:
            raise ValueError(f"rel_w must be [R, dk - dk//2={dk - dk // 2}]; got {tuple(rel_w.shape)}")
        if rel_h.shape[0] != rel_w.shape[0]:
            raise ValueError(
                f"rel_h and rel_w must have the same number of rows; got {rel_h.shape[0]} and "
                f"{rel_w.shape[0]}"
            )


def check_kernel_size(kernel_size: int) -> int:
    """The radius ``r`` of an odd ``kernel_size = 2r + 1 >= 1``."""
    if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be an odd integer >= 1; got {kernel_size!r}")
    return (kernel_size - 1) // 2


def check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")


def check_query_chunk(query_chunk: int) -> None:
    if isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 0:
        raise ValueError(
            f"query_chunk must be >= 0 (0 = all queries at once); got {query_chunk!r}"
        )
