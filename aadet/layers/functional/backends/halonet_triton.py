"""HaloNet attention on the Triton flash-attention kernel of AA's tables: the ``"triton"`` route.

Computes :func:`~aadet.layers.functional.halo_attention.halo_attention_2d` on the block layout of
:mod:`.halonet_blocks` with :func:`~.aa_triton.triton_attention_on_key_grid`: each (batch, head,
block) is one problem of the kernel, its ``Pq`` queries over its ``Uh x Uw`` window on a row-major
key grid, with the position tables ``row [.., Pq, Uh]`` and ``col [.., Pq, Uw]`` added to the logit
tiles inside the kernel (what the ``"fused"`` route broadcasts to a ``[Pq, Uh Uw]`` bias per block
and hands to SDPA). The border mask goes into the same tables: a window row (column) outside the
map gets :data:`MASKED` in ``row`` (``col``), so its keys' weights come out 0 (exactly, in float32,
once a real logit is seen; a block always holds an in-map pixel). Online softmax in float32;
only the output and one log-sum-exp per query are kept for backward, which recomputes the
probabilities; the tables' gradients flow back to ``q`` and the embeddings through autograd.

``q, k, v`` in float32, float16 or bfloat16 (the kernel's :data:`~.aa_triton.TRITON_DTYPES`), the
tables in float32. CUDA, or CPU under Triton's interpreter (tests), as :mod:`.aa_triton`.
"""
import torch

from .aa_triton import _MAX_GRID_Y, triton_attention_on_key_grid
from .halonet_blocks import halo_block_terms, halo_geometry, halo_key_windows, halo_line_validity, halo_unblock

__all__ = ["MASKED", "triton_halo_attention"]

#: The table entry of a window line outside the map: finite, so that a tile of the kernel whose
#: key rows all lie outside (a halo wider than the kernel's tile at a border) keeps a finite
#: running maximum; far below any real logit, so that its keys' weights are exactly 0 in float32.
MASKED = -1e30


def triton_halo_attention(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride):
    """The Triton kernel over every block's window (``impl="triton"``), a route of
    :data:`~aadet.layers.functional.halo_attention.HALO_ATTENTION_BACKENDS`."""
    geo = halo_geometry(q.shape, k.shape, block_size, halo_size, query_stride)
    qb, kb, row, col, _ = halo_block_terms(q, k, rel_h, rel_w, geo)  # [N, nblk, Pq / L, d], tables
    vb = halo_key_windows(v, geo)  # [N, nblk, L, dv]
    (uh, uw), (nby, nbx) = geo.window, geo.grid
    n, nblk, pq = qb.shape[:3]
    rows_in, cols_in = halo_line_validity(geo, q.device)  # [nby, Uh], [nbx, Uw]
    rows_in = rows_in[:, None, :].expand(nby, nbx, uh).reshape(nblk, uh)  # block (y, x) -> its rows
    cols_in = cols_in[None, :, :].expand(nby, nbx, uw).reshape(nblk, uw)
    if row is None:  # no embeddings: the tables hold only the border mask
        row = qb.new_zeros(n, nblk, pq, uh, dtype=torch.float32)
        col = qb.new_zeros(n, nblk, pq, uw, dtype=torch.float32)
    row = row.float().masked_fill(~rows_in[None, :, None, :], MASKED)
    col = col.float().masked_fill(~cols_in[None, :, None, :], MASKED)
    args = [t.flatten(0, 1) for t in (qb, kb, vb, row, col)]  # [N nblk, ...]: one problem a block
    # The kernel runs one program row per problem, at most CUDA's 65,535: larger calls go in chunks.
    out = torch.cat([triton_attention_on_key_grid(*(t[i:i + _MAX_GRID_Y] for t in args), (uh, uw))
                     for i in range(0, n * nblk, _MAX_GRID_Y)])
    return halo_unblock(out.view(n, nblk, pq, -1), geo)
