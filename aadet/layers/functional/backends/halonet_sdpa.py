"""HaloNet attention through fused SDPA: the ``"fused"`` route.

Computes :func:`~aadet.layers.functional.halo_attention.halo_attention_2d` on the block layout
of :mod:`.halonet_blocks` as one :func:`torch.nn.functional.scaled_dot_product_attention` over all
blocks (``[N, nblk]`` as its batch and heads, ``Pq`` queries, ``L`` window keys), with the
position tables and the border mask as its additive float ``attn_mask``: ``row[.., p, u] +
col[.., p, u']`` broadcast to ``[N, nblk, Pq, L]``, plus ``-inf`` for window keys outside the map.
On CUDA the memory-efficient kernel takes such a bias with its gradient and never stores the
softmax; on CPU SDPA runs its flash kernel without autograd and its math kernel (the
materialized computation) when the bias needs a gradient. SDPA keeps logits and softmax in
float32 under autocast, the bias in the inputs' dtype.
"""

from ..key_grid import cached_constant
from .halonet_blocks import constants_key, halo_block_terms, halo_geometry, halo_key_windows, halo_unblock
from .sdpa import fused_sdpa

__all__ = ["sdpa_halo_attention"]


def sdpa_halo_attention(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride):
    """Fused SDPA with the position tables and border mask as its bias (``impl="fused"``), a
    route of :data:`~aadet.layers.functional.halo_attention.HALO_ATTENTION_BACKENDS`."""
    geo = halo_geometry(q.shape, k.shape, block_size, halo_size, query_stride)
    qb, kb, row, col, valid = halo_block_terms(q, k, rel_h, rel_w, geo)  # [N, nblk, Pq / L, d], ...
    vb = halo_key_windows(v, geo)  # [N, nblk, L, dv]
    bias = None
    if row is not None:
        bias = (row[..., :, None] + col[..., None, :]).flatten(-2)  # [N, nblk, Pq, L]
    if valid is not None:
        mask = cached_constant(  # [nblk, 1, L]
            ("halo_sdpa_mask", *constants_key(geo, q.device), qb.dtype),
            lambda: qb.new_zeros(valid.shape).masked_fill(~valid, float("-inf"))[:, None, :])
        bias = mask if bias is None else bias + mask
    out = fused_sdpa(qb, kb, vb, bias)
    return halo_unblock(out, geo)
