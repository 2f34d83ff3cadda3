"""SASA local attention computed in query blocks with haloed windows: SASA's ``"fused"`` and
``"materialized"`` routes (:data:`~aadet.layers.functional.local_attention.LOCAL_ATTENTION_BACKENDS`,
``blocked=True``).

This is SASA's attention, not HaloNet's: every query still attends to its own centred ``k x k``
window (keys further than ``r`` are masked), and the blocks only tile the work. It computes
:func:`~aadet.layers.functional.local_attention.local_self_attention_2d` (SASA Eq. 3, windows
clipped to the map) as the paper's TPU implementation and timm's ``HaloAttn`` do, but exact at
the borders and for any size:

1. pad the map to multiples of a block ``bh x bw`` (``min(block_size, H or W)``); queries are
   the ``bh * bw`` pixels of a block; keys/values the ``(bh + 2r) x (bw + 2r)`` window around it
   (a "halo" unfold: ``(b + 2r)^2 / b^2`` copies of ``k`` and ``v``, never ``k^2``);
2. everything positional is a *query-side table* over the window's rows (and one over its
   columns): ``T_row[i, u] = q_i[:dk//2] . rel_h[u - row(i)]`` when key row ``u`` is within
   ``r`` of the query's row *and* inside the map, ``MASK_VALUE`` otherwise (same for columns);
   the logit of key ``(u, u')`` is ``q.k + T_row[i, u] + T_col[i, u']``;
3. one of AA's logit-table routes, called directly, adds the tables: inside a fused SDPA kernel
   (``"fused"``, :mod:`.aa_sdpa`: one kernel per layer, never the attention matrix) or an
   explicit float32 softmax (``"materialized"``, :mod:`.aa_materialized`: plain tensor ops only,
   so it exports);
4. padded query positions are dropped.

Every query's own position is always unmasked (padded queries too), so no softmax row is
empty. The finite ``MASK_VALUE`` (-1e4) is exact as long as content logits stay far below 5e3
in magnitude (they are O(1)-O(10) in trained models).
"""
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ..dispatch import is_exporting
from ..key_grid import cached_constant, grid_key_index
from ..relative_attention import diagonal_window_view
from .aa_materialized import materialized_attention_with_logit_tables
from .aa_sdpa import sdpa_attention_with_logit_tables

__all__ = [
    "MASK_VALUE",
    "halo_local_attention",
    "halo_local_attention_fused",
    "halo_local_attention_macs",
    "halo_local_attention_materialized",
]

# Large negative logit used as a mask. Finite (no inf-inf = NaN), representable in fp16
# (|x| < 65504) and far below any real logit, so exp(MASK_VALUE - max) underflows to 0.
MASK_VALUE = -1.0e4


def _tile(block_size: int, h: int, w: int) -> Tuple[int, int]:
    """The query tile ``(bh, bw)``: ``block_size`` capped at the map's sides."""
    return min(block_size, h), min(block_size, w)


def _pad_map(x: torch.Tensor, hp: int, wp: int, halo: int) -> torch.Tensor:
    """``[N, H, W, d]`` -> ``[N, hp + 2 halo, wp + 2 halo, d]``, zeros around (``halo`` before)."""
    h, w = x.shape[1], x.shape[2]
    return F.pad(x, (0, 0, halo, wp - w + halo, halo, hp - h + halo))


def _query_blocks(x: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """``[N, hp, wp, d]`` -> ``[N, nby * nbx, bh * bw, d]`` (row-major pixels of each block)."""
    n, hp, wp, d = x.shape
    x = x.view(n, hp // bh, bh, wp // bw, bw, d).permute(0, 1, 3, 2, 4, 5)  # [N, nby, nbx, bh, bw, d]
    return x.reshape(n, (hp // bh) * (wp // bw), bh * bw, d)


def _halo_windows(x: torch.Tensor, bh: int, bw: int, halo: int) -> torch.Tensor:
    """``[N, hp + 2h, wp + 2h, d]`` -> ``[N, nby * nbx, (bh + 2h) * (bw + 2h), d]``.

    Windows of consecutive blocks overlap by ``2h`` rows/columns; the unfold is a view and the
    final reshape copies ``(bh + 2h)(bw + 2h) / (bh bw)`` times the map. While exporting, the
    same windows come from two ``index_select`` (ONNX ``Gather``): ``Tensor.unfold`` has no
    ONNX form once the map's size is traced.
    """
    n, hp2, wp2, d = x.shape
    uh, uw = bh + 2 * halo, bw + 2 * halo
    nby, nbx = (hp2 - 2 * halo) // bh, (wp2 - 2 * halo) // bw
    if is_exporting():
        rows = (torch.arange(nby, device=x.device)[:, None] * bh
                + torch.arange(uh, device=x.device)[None, :])  # [nby, Uh] map row of window row
        cols = (torch.arange(nbx, device=x.device)[:, None] * bw
                + torch.arange(uw, device=x.device)[None, :])  # [nbx, Uw]
        x = x.index_select(1, rows.flatten()).view(n, nby, uh, wp2, d)
        x = x.index_select(3, cols.flatten()).view(n, nby, uh, nbx, uw, d)
        x = x.permute(0, 1, 3, 2, 4, 5)  # [N, nby, nbx, bh + 2h, bw + 2h, d]
    else:
        x = x.unfold(1, uh, bh)  # [N, nby, Wp + 2h, d, bh + 2h]
        x = x.unfold(2, uw, bw)  # [N, nby, nbx, d, bh + 2h, bw + 2h]
        x = x.permute(0, 1, 2, 4, 5, 3)  # [N, nby, nbx, bh + 2h, bw + 2h, d]
    return x.reshape(n, nby * nbx, uh * uw, d)


def _axis_validity(
    size: int, block: int, num_blocks: int, halo: int, radius: int, device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Along one axis: which window lines a query line may attend to, and their offset index.

    For block ``n``, query line ``i`` (in the block) and window line ``u`` (map line
    ``n * block - halo + u``), the relative index is ``t = u - i + radius - halo`` (the key-minus-
    query offset plus ``radius``). Returns ``valid [num_blocks, block, U]`` (``0 <= t <= 2 radius``
    and the key line inside the map, or ``u`` being the query's own line) and ``t [block, U]``.
    """
    win = block + 2 * halo
    i = torch.arange(block, device=device)[:, None]  # [block, 1]
    u = torch.arange(win, device=device)[None, :]  # [1, U]
    t = u - i + (radius - halo)  # [block, U]
    in_window = (t >= 0) & (t <= 2 * radius)  # [block, U]
    line = torch.arange(num_blocks, device=device)[:, None] * block - halo + u  # [nb, U]
    in_map = (line >= 0) & (line < size)  # [nb, U]
    own = (u == i + halo)  # [block, U]: the query's own line (also for padded queries)
    valid = (in_window[None] & in_map[:, None, :]) | own[None]  # [nb, block, U]
    return valid, t


def _cached_axis_validity(size: int, block: int, num_blocks: int, halo: int, radius: int, device):
    """:func:`_axis_validity`, made once per its arguments (:func:`~..key_grid.cached_constant`)."""
    return cached_constant(("sasa_axis_validity", size, block, num_blocks, halo, radius, torch.device(device)),
                           lambda: _axis_validity(size, block, num_blocks, halo, radius, device))


def _offset_window_view(logits: torch.Tensor, win: int, shift: int, dim: int) -> torch.Tensor:
    """``out[..., i, ..., u] = logits[..., i, ..., u - i + shift]`` for the ``U = win`` window lines
    ``u``, ``i`` the query line along ``dim``: :func:`~..relative_attention.diagonal_window_view`
    of ``logits`` zero-padded along its last (offset) axis so that every ``u - i + shift`` falls
    inside its own row. Entries whose
    offset lies outside ``[0, R)`` read padding or another offset's logit: the caller masks them."""
    num_rel, block = logits.shape[-1], logits.shape[dim]
    left = max(0, block - 1 - shift)  # the smallest index, shift - (block - 1), moved to 0
    right = max(0, shift + win - 1 - (num_rel - 1))
    return diagonal_window_view(F.pad(logits, (left, right)), dim, win, shift + left)


def _axis_table(
    q_part: torch.Tensor,
    rel: Optional[torch.Tensor],
    valid: torch.Tensor,
    t: torch.Tensor,
    axis: str,
    shift: int,
) -> torch.Tensor:
    """One query-side logit table over the window's rows (``axis="row"``) or columns.

    Args:
        q_part: ``[N, nby, nbx, bh, bw, dr]`` the query channels paired with ``rel``.
        rel: ``[R, dr]`` offset embeddings (``R = 2 radius + 1``) or None (no positional term).
        valid: ``[nb, b, U]`` from :func:`_axis_validity` (``nb, b`` = blocks/lines of ``axis``).
        t: ``[b, U]`` relative index of window line ``u`` for query line ``i``, ``u - i + shift``.
        shift: ``radius - halo``.

    Returns:
        ``[N, nby, nbx, bh, bw, U]``: ``q_part . rel[t]`` where valid, ``MASK_VALUE`` elsewhere.
    """
    if axis == "row":
        valid = valid[:, None, :, None, :]  # [nby, 1, bh, 1, U]
    else:
        valid = valid[None, :, None, :, :]  # [1, nbx, 1, bw, U]
    if rel is None:
        zero = torch.zeros((), dtype=q_part.dtype, device=q_part.device)
        table = torch.where(valid, zero, torch.full_like(zero, MASK_VALUE))
        return table.expand(*q_part.shape[:-1], valid.shape[-1])
    num_rel = rel.shape[0]
    logits = torch.matmul(q_part, rel.to(q_part.dtype).t())  # [N, nby, nbx, bh, bw, R]
    if is_exporting():
        # ONNX has no strided view: a one-hot E[i, t, u] = [t(i, u) == t] moves relative index t
        # to window line u, an exact 0/1 matmul (one nonzero per output), batched over line i.
        onehot = (t[:, None, :] == torch.arange(num_rel, device=t.device)[None, :, None]).to(logits.dtype)
        equation = "nyxijt,itu->nyxiju" if axis == "row" else "nyxijt,jtu->nyxiju"
        table = torch.einsum(equation, logits, onehot)  # [b, R, U] onehot
    else:
        table = _offset_window_view(logits, t.shape[-1], shift, dim=-3 if axis == "row" else -2)
    return torch.where(valid, table, torch.full_like(table[..., :1], MASK_VALUE))


def _blocked_attention(
    q, k, v, rel_h, rel_w, *, radius: int, halo: int, block_hw: Tuple[int, int],
    attend: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Shared core: queries in ``bh x bw`` blocks, keys in the block plus ``halo``, keys further
    than ``radius`` (per axis) or outside the map masked. Arguments as :func:`halo_local_attention`'s."""
    b, nh, h, w, dk = q.shape
    dv = v.shape[-1]
    bh, bw = block_hw
    nby, nbx = -(-h // bh), -(-w // bw)
    hp, wp = nby * bh, nbx * bw
    n = b * nh

    qb = _query_blocks(_pad_map(q.reshape(n, h, w, dk), hp, wp, 0), bh, bw)  # [N, nblk, bh*bw, dk]
    kb = _halo_windows(_pad_map(k.reshape(n, h, w, dk), hp, wp, halo), bh, bw, halo)  # [N, nblk, Lk, dk]
    vb = _halo_windows(_pad_map(v.reshape(n, h, w, dv), hp, wp, halo), bh, bw, halo)  # [N, nblk, Lk, dv]

    dev = q.device
    valid_r, t_r = _cached_axis_validity(h, bh, nby, halo, radius, dev)  # [nby, bh, Uh], [bh, Uh]
    valid_c, t_c = _cached_axis_validity(w, bw, nbx, halo, radius, dev)  # [nbx, bw, Uw], [bw, Uw]
    q6 = qb.view(n, nby, nbx, bh, bw, dk)
    dr = dk // 2
    row_t = _axis_table(q6[..., :dr], rel_h, valid_r, t_r, "row", radius - halo)  # [N, nby, nbx, bh, bw, Uh]
    col_t = _axis_table(q6[..., dr:], rel_w, valid_c, t_c, "col", radius - halo)  # [N, nby, nbx, bh, bw, Uw]
    uh, uw = bh + 2 * halo, bw + 2 * halo
    row_t = row_t.reshape(n, nby * nbx, bh * bw, uh)
    col_t = col_t.reshape(n, nby * nbx, bh * bw, uw)
    # Key l = u * Uw + u' of the window sits on window row u and window column u': the window is
    # a row-major Uh x Uw key grid.
    key_row, key_col = grid_key_index(uh, uw, dev)  # [Lk] each

    out = attend(qb, kb, vb, [row_t, col_t], [key_row, key_col])  # [N, nblk, bh*bw, dv]
    out = out.view(n, nby, nbx, bh, bw, dv).permute(0, 1, 3, 2, 4, 5).reshape(n, hp, wp, dv)
    return out[:, :h, :w].reshape(b, nh, h, w, dv)


def halo_local_attention(
    q, k, v, rel_h, rel_w, kernel_size: int, *, block_size: int, attend: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """SASA local attention in query blocks with haloed windows, on checked arguments of
    :func:`~aadet.layers.functional.local_attention.local_self_attention_2d`: ``block_size`` the
    query tile side (capped at ``H`` / ``W``; any value gives the same result), ``attend`` the
    logit-table route ``attend(q, k, v, tables, key_index) -> out`` (:mod:`.aa_sdpa` or
    :mod:`.aa_materialized`).
    """
    r = (kernel_size - 1) // 2
    block_hw = _tile(block_size, q.shape[2], q.shape[3])
    return _blocked_attention(
        q, k, v, rel_h, rel_w, radius=r, halo=r, block_hw=block_hw, attend=attend
    )


def halo_local_attention_fused(q, k, v, rel_h, rel_w, kernel_size, *, block_size: int):
    """:func:`halo_local_attention` through fused SDPA (``impl="fused"``)."""
    return halo_local_attention(
        q, k, v, rel_h, rel_w, kernel_size, block_size=block_size,
        attend=sdpa_attention_with_logit_tables,
    )


def halo_local_attention_materialized(q, k, v, rel_h, rel_w, kernel_size, *, block_size: int):
    """:func:`halo_local_attention` with explicit float32 logits (``impl="materialized"``)."""
    return halo_local_attention(
        q, k, v, rel_h, rel_w, kernel_size, block_size=block_size,
        attend=materialized_attention_with_logit_tables,
    )


def halo_local_attention_macs(
    batch: int, heads: int, hw: Tuple[int, int], kernel_size: int, block_size: int,
    dk: int, dv: int, relative: bool,
) -> int:
    """Multiply-adds of :func:`halo_local_attention`'s fused route (an estimate): every query of
    a padded ``bh x bw`` tile scores the ``(bh + 2r) x (bw + 2r)`` window, each logit with
    ``dk + Uh + Uw`` dims when position tables ride on the augmented dot product (the masks use
    them too), plus the weighted sum over ``dv``. The one-hot einsums placing the tables in
    window coordinates and the ``k``-offset table matmuls are not included."""
    h, w = hw
    r = (kernel_size - 1) // 2
    bh, bw = _tile(block_size, h, w)
    queries = (-(-h // bh) * bh) * (-(-w // bw) * bw)  # padded to whole tiles
    uh, uw = bh + 2 * r, bw + 2 * r
    extra = (uh + uw) if relative else 0
    return batch * heads * queries * uh * uw * (dk + extra + dv)
