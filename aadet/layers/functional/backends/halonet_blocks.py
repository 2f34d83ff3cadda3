"""HaloNet's blocked local attention: the block layout, relative tables and border masks that
every HaloNet route shares (:mod:`.halonet_materialized`, :mod:`.halonet_sdpa`).

Paper: Vaswani, Ramachandran, Srinivas, Parmar, Hechtman, Shlens, "Scaling Local Self-Attention
for Parameter Efficient Visual Backbones", CVPR 2021, Sec. 2.2 and Figure 1. On checked
arguments (:func:`~..checks.check_halo_attention`), with ``b = block_size``, ``h = halo_size``,
``s = query_stride``, ``N = B * Nh``:

1. blocking: the ``H x W`` key map is cut into ``bk_h x bk_w`` blocks (``b``, capped at a side
   of the map that one block covers), zero-padded to whole blocks; a block's queries are the
   ``bq_h x bq_w`` points of the strided query grid whose input pixel ``(s y', s x')`` lies in
   it (``bq = ceil(bk / s)``, ``b / s`` for whole blocks) -> ``qb [N, nblk, Pq, d]``;
2. haloing: each block's window is the block plus ``h`` lines around it, ``Uh x Uw = (bk_h + 2h)
   x (bk_w + 2h)`` keys and values -> ``kb [N, nblk, L, d]``, ``vb [N, nblk, L, dv]``, ``L = Uh
   Uw`` (SASA's halo unfold, :func:`~.sasa_blocked._halo_windows`: ``(b + 2h)^2 / b^2`` copies of
   the map; gathered by index while exporting);
3. relative tables: ``row[.., p, u] = q_p[:d//2] . rel_h[u - s i_p + b - 1]`` for the query
   ``p`` on row ``i_p`` of its block and window row ``u`` (that is ``a - y + b + h - 1`` with
   key row ``a = n bk - h + u`` and query pixel row ``y = n bk + s i_p``); one matmul with all
   ``2(b + h) - 1`` embeddings, then a gather of the ``Uh`` a query uses. ``col`` likewise; the
   logit of window key ``(u, u')`` is ``q . k + row[u] + col[u']``;
4. border mask: window lines outside the map (the halo across the border, the padding of a
   partial block) are left out of the softmax: per block, ``valid [nblk, L]``, the same for all
   its queries. A block always holds an in-map pixel, so no softmax row is empty; the queries
   of padded block positions are dropped at the end (:func:`halo_unblock`).

Capping the block at a side no longer than ``b`` is exact: with one block along an axis its
window covers every line of the map either way, and the relative index depends only on map lines.
"""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..key_grid import cached_constant
from .sasa_blocked import _halo_windows, _pad_map, _query_blocks

__all__ = [
    "HaloGeometry",
    "constants_key",
    "halo_block_terms",
    "halo_geometry",
    "halo_key_validity",
    "halo_line_validity",
    "halo_key_windows",
    "halo_keys_all_inside",
    "halo_query_blocks",
    "halo_relative_index",
    "halo_relative_tables",
    "halo_unblock",
    "pad_window",
]


class HaloGeometry(NamedTuple):
    """Where the blocks of one call are (all Python ints)."""

    batch: int
    heads: int
    key_hw: Tuple[int, int]  #: ``(H, W)`` of ``k`` and ``v``
    out_hw: Tuple[int, int]  #: ``(ceil(H/s), ceil(W/s))`` of ``q`` and the output
    key_tile: Tuple[int, int]  #: ``(bk_h, bk_w)``: ``b`` capped at ``H``, ``W``
    query_tile: Tuple[int, int]  #: ``(bq_h, bq_w) = ceil(bk / s)``
    grid: Tuple[int, int]  #: ``(nby, nbx)`` blocks
    block_size: int
    halo: int
    stride: int

    @property
    def window(self) -> Tuple[int, int]:
        """``(Uh, Uw) = (bk_h + 2h, bk_w + 2h)``."""
        return self.key_tile[0] + 2 * self.halo, self.key_tile[1] + 2 * self.halo

    @property
    def num_blocks(self) -> int:
        return self.grid[0] * self.grid[1]


def _ceil_div(a, b):
    """``ceil(a / b)`` for ``a, b >= 1``, without ``-(-a // b)``: while ONNX export traces the
    sizes, that floor division of a negative number is folded with ONNX's truncating ``Div``."""
    return (a + b - 1) // b


def halo_geometry(q_shape, k_shape, block_size: int, halo_size: int, query_stride: int) -> HaloGeometry:
    """The blocks of ``q [B, Nh, ceil(H/s), ceil(W/s), d]`` over ``k [B, Nh, H, W, d]``."""
    bsz, nh, h, w = k_shape[:4]
    s = query_stride
    bkh, bkw = min(block_size, h), min(block_size, w)
    return HaloGeometry(
        batch=bsz, heads=nh, key_hw=(h, w), out_hw=(q_shape[2], q_shape[3]),
        key_tile=(bkh, bkw), query_tile=(_ceil_div(bkh, s), _ceil_div(bkw, s)),
        grid=(_ceil_div(h, bkh), _ceil_div(w, bkw)), block_size=block_size, halo=halo_size, stride=s,
    )


def halo_query_blocks(q: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """``q [B, Nh, Ho, Wo, d]`` -> ``[N, nblk, Pq, d]`` (each block's queries, row-major)."""
    (nby, nbx), (bqh, bqw) = geo.grid, geo.query_tile
    ho, wo = geo.out_hw
    x = q.reshape(geo.batch * geo.heads, ho, wo, q.shape[-1])
    x = _pad_map(x, nby * bqh, nbx * bqw, 0)  # [N, nby bq_h, nbx bq_w, d]
    return _query_blocks(x, bqh, bqw)


def halo_key_windows(x: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """``k`` or ``v`` ``[B, Nh, H, W, c]`` -> ``[N, nblk, L, c]`` (each block's window, row-major)."""
    (nby, nbx), (bkh, bkw) = geo.grid, geo.key_tile
    h, w = geo.key_hw
    x = x.reshape(geo.batch * geo.heads, h, w, x.shape[-1])
    x = _pad_map(x, nby * bkh, nbx * bkw, geo.halo)  # [N, nby bk_h + 2h, nbx bk_w + 2h, c]
    return _halo_windows(x, bkh, bkw, geo.halo)


def constants_key(geo: HaloGeometry, device) -> tuple:
    """What a constant of the block layout depends on: the geometry but for the batch and the
    heads, and the device (the cache key of :func:`~..key_grid.cached_constant`)."""
    return geo._replace(batch=0, heads=0), torch.device(device)


def _line_validity(size: int, tile: int, num_blocks: int, halo: int, device) -> torch.Tensor:
    """``[num_blocks, tile + 2 halo]``: window line ``u`` of block ``n`` (map line ``n tile - halo
    + u``) lies inside ``[0, size)``."""
    u = torch.arange(tile + 2 * halo, device=device)
    line = torch.arange(num_blocks, device=device)[:, None] * tile - halo + u[None, :]
    return (line >= 0) & (line < size)


def halo_line_validity(geo: HaloGeometry, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``rows [nby, Uh]``, ``cols [nbx, Uw]`` bool: which window rows / columns of each block row
    / column lie inside the map (a key is inside iff its row and its column are)."""
    (h, w), (bkh, bkw), (nby, nbx) = geo.key_hw, geo.key_tile, geo.grid
    return cached_constant(("halo_line_validity", *constants_key(geo, device)), lambda: (
        _line_validity(h, bkh, nby, geo.halo, device), _line_validity(w, bkw, nbx, geo.halo, device)))


def halo_keys_all_inside(geo: HaloGeometry) -> bool:
    """Every window line of every block lies inside the map: no halo and whole blocks (from the
    geometry alone: reading :func:`halo_line_validity` would make the host wait on CUDA)."""
    (h, w), (bkh, bkw), (nby, nbx) = geo.key_hw, geo.key_tile, geo.grid
    return geo.halo == 0 and h == nby * bkh and w == nbx * bkw


def halo_key_validity(geo: HaloGeometry, device) -> Optional[torch.Tensor]:
    """``[nblk, L]`` bool: the window keys inside the map (None when every key is: ``h = 0`` and
    whole blocks)."""
    if halo_keys_all_inside(geo):
        return None
    nby, nbx = geo.grid

    def make():
        rows, cols = halo_line_validity(geo, device)  # [nby, Uh], [nbx, Uw]
        valid = rows[:, None, :, None] & cols[None, :, None, :]  # [nby, nbx, Uh, Uw]
        return valid.reshape(nby * nbx, rows.shape[1] * cols.shape[1])

    return cached_constant(("halo_key_validity", *constants_key(geo, device)), make)


def halo_relative_index(geo: HaloGeometry, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``idx_r [Pq, Uh]``, ``idx_c [Pq, Uw]``: the embedding row ``u - s i + b - 1`` of window row
    (column) ``u`` for the block's query ``p = (i, j)`` (row-major), i.e. ``a - y + b + h - 1``."""
    (bqh, bqw), (uh, uw) = geo.query_tile, geo.window
    b, s = geo.block_size, geo.stride

    def make():
        t_r = torch.arange(uh, device=device)[None, :] - s * torch.arange(bqh, device=device)[:, None] + b - 1
        t_c = torch.arange(uw, device=device)[None, :] - s * torch.arange(bqw, device=device)[:, None] + b - 1
        idx_r = t_r[:, None, :].expand(bqh, bqw, uh).reshape(bqh * bqw, uh)  # query (i, j) -> t_r[i]
        idx_c = t_c[None, :, :].expand(bqh, bqw, uw).reshape(bqh * bqw, uw)  # query (i, j) -> t_c[j]
        return idx_r, idx_c

    return cached_constant(("halo_relative_index", *constants_key(geo, device)), make)


def halo_relative_tables(
    qb: torch.Tensor, rel_h: torch.Tensor, rel_w: torch.Tensor, geo: HaloGeometry
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The query-side position tables of step 3 of the module docstring.

    Args:
        qb: ``[..., Pq, d]``, e.g. ``[N, nblk, Pq, d]`` from :func:`halo_query_blocks`.
        rel_h: ``[2(b + h) - 1, d//2]``; rel_w: ``[2(b + h) - 1, d - d//2]`` (``qb``'s dtype).

    Returns:
        ``row [..., Pq, Uh]`` and ``col [..., Pq, Uw]``: the logit of window key ``(u, u')`` for
        query ``p`` gets ``row[.., p, u] + col[.., p, u']``.
    """
    idx_r, idx_c = halo_relative_index(geo, qb.device)
    dr = qb.shape[-1] // 2
    rh = torch.matmul(qb[..., :dr], rel_h.t())  # [..., Pq, 2(b + h) - 1]
    rw = torch.matmul(qb[..., dr:], rel_w.t())
    row = torch.gather(rh, -1, idx_r.expand(*rh.shape[:-2], *idx_r.shape))  # [..., Pq, Uh]
    col = torch.gather(rw, -1, idx_c.expand(*rw.shape[:-2], *idx_c.shape))  # [..., Pq, Uw]
    return row, col


def halo_block_terms(q, k, rel_h, rel_w, geo: HaloGeometry):
    """Steps 1-4 of the module docstring for ``q`` and ``k``: ``qb [N, nblk, Pq, d]``, ``kb [N,
    nblk, L, d]``, the position tables ``row [N, nblk, Pq, Uh]``, ``col [.., Uw]`` in ``qb``'s
    dtype (None, None without embeddings) and the border mask ``valid [nblk, L]`` (None where
    every key is inside the map)."""
    qb = halo_query_blocks(q, geo)
    kb = halo_key_windows(k, geo)
    row = col = None
    if rel_h is not None:
        row, col = halo_relative_tables(qb, rel_h.to(qb.dtype), rel_w.to(qb.dtype), geo)
    return qb, kb, row, col, halo_key_validity(geo, q.device)


def halo_unblock(out: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """``[N, nblk, Pq, dv]`` -> ``[B, Nh, Ho, Wo, dv]`` (padded query positions dropped)."""
    (nby, nbx), (bqh, bqw), (ho, wo) = geo.grid, geo.query_tile, geo.out_hw
    n, dv = out.shape[0], out.shape[-1]
    out = out.view(n, nby, nbx, bqh, bqw, dv).permute(0, 1, 3, 2, 4, 5)
    out = out.reshape(n, nby * bqh, nbx * bqw, dv)[:, :ho, :wo]
    return out.reshape(geo.batch, geo.heads, ho, wo, dv)


def pad_window(probs: torch.Tensor, geo: HaloGeometry) -> torch.Tensor:
    """``[..., Uh, Uw]`` -> ``[..., b + 2h, b + 2h]``: a capped block's window widened with zeros
    (the lines it leaves out are outside the map)."""
    full = geo.block_size + 2 * geo.halo
    uh, uw = geo.window
    return F.pad(probs, (0, full - uw, 0, full - uh))
