"""Every argument rule of the attention functions and layers, each defined once.

The public functions of this package check their arguments here, once, before they dispatch;
the layers (:mod:`aadet.layers`), the config validation (:mod:`aadet.config`) and the modeling
code check the same values with the same functions. A rule that can come from a config takes
``name`` (how the caller knows the value: ``"kernel_size"`` for a function or layer,
``"MODEL.SASA.KERNEL_SIZE"`` for the config) and ``error(name, allowed, given)``, which builds
the exception: :func:`argument_error` (a ``ValueError``) by default, ``aadet.config.config_error``
(a ``ConfigValueError`` naming the key) from the config. Errors say what was expected and what
was given.

A kernel's own requirements (the dtypes and devices it runs on, its tile sizes, options only it
has) stay in its file under ``backends/``, next to the code that imposes them.
"""
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = [
    "Interval",
    "argument_error",
    "check_block_attention",
    "check_bool",
    "check_block_map",
    "check_criss_cross_attention",
    "check_block_size",
    "check_grid_width",
    "check_halo_attention",
    "check_halo_size",
    "check_in",
    "check_int",
    "check_kernel_size",
    "check_local_attention",
    "check_logit_tables",
    "check_num_heads",
    "check_one_dtype",
    "check_one_of",
    "check_positive_int",
    "check_subset",
    "check_qkv",
    "check_query_chunk",
    "check_query_positions",
    "check_query_stride",
    "check_relative_embedding",
    "check_relative_qk",
    "check_relative_v",
    "check_row_col_tables",
]

#: ``error(name, allowed, given) -> Exception``: how a failed rule is reported.
ErrorFactory = Callable[[str, str, Any], Exception]


def argument_error(name: str, allowed: str, given: Any) -> ValueError:
    """``ValueError("<name> must be <allowed>; got <given!r>")``: the default ``error``."""
    return ValueError(f"{name} must be {allowed}; got {given!r}")


# ----------------------------------------------------------------------------- scalar rules
def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Interval(NamedTuple):
    """A range of real numbers, written once where its concept lives (``kappa``'s in
    :mod:`aadet.layers.augmented_conv`, the vote threshold's in :mod:`aadet.modeling.box_voting`)
    and checked with :func:`check_in` by the layer and the config alike. ``str()`` is how errors
    say it: ``"> 0"``, ``"in (0, 1]"``."""

    low: float
    high: float = math.inf
    low_closed: bool = False
    high_closed: bool = False

    def __contains__(self, value) -> bool:
        if not _is_number(value):
            return False
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>=' if self.low_closed else '>'} {self.low:g}"
        return f"in {'[' if self.low_closed else '('}{self.low:g}, {self.high:g}{']' if self.high_closed else ')'}"


def check_in(
    value, interval: Interval, name: str, error: ErrorFactory = argument_error, note: str = ""
) -> None:
    """A number in ``interval`` (``note``: why, appended to the allowed range in the message)."""
    if value not in interval:
        raise error(name, f"{interval}{note}", value)


def check_int(
    value, name: str, minimum: int = 1, error: ErrorFactory = argument_error, note: str = ""
) -> None:
    """An integer >= ``minimum`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(name, f"an integer >= {minimum}{note}", value)


def check_positive_int(value, name: str, error: ErrorFactory = argument_error) -> None:
    """An integer >= 1 (not a bool)."""
    check_int(value, name, 1, error)


def check_bool(value, name: str, error: ErrorFactory = argument_error) -> None:
    """A switch: ``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise error(name, "True or False", value)


def check_one_of(
    value, allowed: Sequence, name: str, error: ErrorFactory = argument_error, note: str = ""
) -> None:
    """``value`` is one of ``allowed`` (the owner's tuple, or a registry's names read when the
    check runs)."""
    if value not in allowed:
        raise error(name, f"one of {tuple(allowed)}{note}", value)


def check_subset(values, allowed: Sequence, name: str, error: ErrorFactory = argument_error) -> None:
    """Every element of ``values`` is one of ``allowed``."""
    if any(v not in allowed for v in values):
        raise error(name, f"a subset of {tuple(allowed)}", tuple(values))


def check_kernel_size(
    kernel_size, name: str = "kernel_size", error: ErrorFactory = argument_error
) -> int:
    """A window or "same"-padded convolution side: an odd ``kernel_size = 2r + 1 >= 1``.
    Returns the radius ``r``."""
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 \
            or kernel_size % 2 == 0:
        raise error(name, "an odd integer >= 1", kernel_size)
    return (kernel_size - 1) // 2


def check_num_heads(
    num_heads,
    channels: int,
    *,
    min_per_head: int = 1,
    name: str = "num_heads",
    channels_name: Optional[str] = None,
    per_head_reason: str = "",
    error: ErrorFactory = argument_error,
) -> int:
    """``num_heads`` heads split ``channels`` evenly, with at least ``min_per_head`` each.

    Args:
        channels_name: what ``channels`` is, for the message (default ``out_channels=<channels>``).
        per_head_reason: why ``min_per_head`` channels are needed (ends the message).

    Returns:
        The channels per head.
    """
    check_positive_int(num_heads, name, error)
    what = f"out_channels={channels}" if channels_name is None else channels_name
    if channels % num_heads != 0:
        raise error(name, f"a divisor of {what}", num_heads)
    if channels // num_heads < min_per_head:
        raise error(
            name,
            f"at most {channels // min_per_head} (>= {min_per_head} channels per head"
            f"{' ' + per_head_reason if per_head_reason else ''})",
            num_heads,
        )
    return channels // num_heads


def check_block_size(block_size, name: str = "block_size") -> None:
    """A query tile or stem block side: an integer >= 1."""
    check_positive_int(block_size, name)


def check_query_chunk(query_chunk) -> None:
    """Queries per chunk of the materialized logit-table route: >= 0 (0 = all at once)."""
    check_int(query_chunk, "query_chunk", 0, note=" (0 = all queries at once)")


# ----------------------------------------------------------------------------- SASA
def check_qkv_maps(q, k, v) -> None:
    """``q, k [B, Nh, H, W, d]`` of one shape and ``v [B, Nh, H, W, dv]`` on their map (SASA's and
    CCNet's arguments)."""
    if q.dim() != 5 or k.dim() != 5 or v.dim() != 5:
        raise ValueError(
            "q, k, v must be [B, Nh, H, W, d]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}; got {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"v must be [B, Nh, H, W, dv] with q's first four dims {tuple(q.shape[:-1])}; "
            f"got {tuple(v.shape)}"
        )


def check_qkv(q, k, v, rel_h, rel_w) -> None:
    """``q, k [B, Nh, H, W, dk]``, ``v [B, Nh, H, W, dv]``; ``rel_h [R, dk//2]`` and
    ``rel_w [R, dk - dk//2]`` with the same ``R``, or both None (SASA's split embeddings)."""
    check_qkv_maps(q, k, v)
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


def check_local_attention(q, k, v, rel_h, rel_w, kernel_size) -> int:
    """The arguments of SASA's local attention (``local_self_attention_2d``): an odd
    ``kernel_size``, :func:`check_qkv` shapes, ``kernel_size`` embedding rows. Returns the radius."""
    r = check_kernel_size(kernel_size)
    check_qkv(q, k, v, rel_h, rel_w)
    if rel_h is not None and rel_h.shape[0] != kernel_size:
        raise ValueError(
            f"rel_h/rel_w must have kernel_size={kernel_size} rows; got {rel_h.shape[0]}"
        )
    return r


# ----------------------------------------------------------------------------- SASA stem blocks
def check_block_attention(q, k, v, rel_h, rel_w, block_size) -> None:
    """Block layout: ``q, k [N, Nh, b*b, dk]``, ``v [N, Nh, b*b, dv]``, ``rel_h [2b - 1, dk//2]``
    and ``rel_w [2b - 1, dk - dk//2]`` or None."""
    check_block_size(block_size)
    bs, p = block_size, block_size * block_size
    if q.dim() != 4 or q.shape[-2] != p or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"q, k must be [N, Nh, {p}, dk] and v [N, Nh, {p}, dv] for block_size={bs}; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    dk = q.shape[-1]
    if rel_h is not None and (rel_h.shape != (2 * bs - 1, dk // 2) or rel_w is None
                              or rel_w.shape != (2 * bs - 1, dk - dk // 2)):
        raise ValueError(
            f"rel_h/rel_w must be [{2 * bs - 1}, {dk // 2}] and [{2 * bs - 1}, {dk - dk // 2}]; got "
            f"{tuple(rel_h.shape)} and {None if rel_w is None else tuple(rel_w.shape)}"
        )


def check_block_map(q, k, v, rel_h, rel_w, block_size) -> None:
    """Map layout of block attention: :func:`check_qkv` shapes, ``2 * block_size - 1`` rows."""
    check_block_size(block_size)
    check_qkv(q, k, v, rel_h, rel_w)
    if rel_h is not None and rel_h.shape[0] != 2 * block_size - 1:
        raise ValueError(
            f"rel_h/rel_w must have 2 * block_size - 1 = {2 * block_size - 1} rows; got {rel_h.shape[0]}"
        )


# ----------------------------------------------------------------------------- HaloNet
def check_halo_size(halo_size, name: str = "halo_size", error: ErrorFactory = argument_error) -> None:
    """HaloNet's halo ``h``: the rows/columns of keys around a query block, an integer >= 0."""
    check_int(halo_size, name, 0, error)


def check_query_stride(
    query_stride, block_size: int, name: str = "query_stride", error: ErrorFactory = argument_error
) -> None:
    """HaloNet's attention downsampling: an integer >= 1 dividing ``block_size`` (each block
    holds ``block_size // query_stride`` queries a side)."""
    check_positive_int(query_stride, name, error)
    if block_size % query_stride:
        raise error(
            name, f"a divisor of block_size={block_size} (a block holds block_size // "
            f"{name} queries a side)", query_stride,
        )


def check_halo_attention(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride=1) -> int:
    """The arguments of HaloNet's blocked attention (``halo_attention_2d``): ``block_size >= 1``,
    ``halo_size >= 0``, ``query_stride`` dividing ``block_size``; ``k [B, Nh, H, W, d]`` with
    ``H, W, d >= 1``, ``v [B, Nh, H, W, dv]``, ``q [B, Nh, ceil(H/s), ceil(W/s), d]`` (``s =
    query_stride``; ``k``'s shape for ``s = 1``); ``rel_h [2(b + h) - 1, d//2]`` and ``rel_w
    [2(b + h) - 1, d - d//2]`` or both None. Returns the embedding rows ``2(b + h) - 1``."""
    check_block_size(block_size)
    check_halo_size(halo_size)
    check_query_stride(query_stride, block_size)
    if q.dim() != 5 or k.dim() != 5 or v.dim() != 5:
        raise ValueError(
            "q, k, v must be [B, Nh, H, W, d]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, nh, h, w, d = k.shape
    if h < 1 or w < 1 or d < 1:
        raise ValueError(f"k must be [B, Nh, H, W, d] with H, W, d >= 1; got {tuple(k.shape)}")
    s = query_stride
    want = (b, nh, -(-h // s), -(-w // s), d)
    if tuple(q.shape) != want:
        where = "k's shape" if s == 1 else f"[B, Nh, ceil(H/{s}), ceil(W/{s}), d] for query_stride={s}"
        raise ValueError(f"q must be {where} = {want} (k is {tuple(k.shape)}); got {tuple(q.shape)}")
    check_qkv(k, k, v, rel_h, rel_w)  # v on k's map; the embeddings split d as SASA's
    rows = 2 * (block_size + halo_size) - 1
    if rel_h is not None and rel_h.shape[0] != rows:
        raise ValueError(
            f"rel_h/rel_w must have 2 * (block_size + halo_size) - 1 = {rows} rows; got "
            f"{rel_h.shape[0]}"
        )
    return rows


# ----------------------------------------------------------------------------- CCNet
def check_criss_cross_attention(q, k, v) -> None:
    """The arguments of CCNet's criss-cross attention (``criss_cross_attention_2d``): ``q, k [B,
    Nh, H, W, d]`` and ``v [B, Nh, H, W, dv]`` with ``H, W, d, dv >= 1``, of one floating dtype
    and on one device."""
    check_qkv_maps(q, k, v)
    if min(q.shape[2], q.shape[3], q.shape[4], v.shape[4]) < 1:
        raise ValueError(
            f"q and v must have H, W, d, dv >= 1; got {tuple(q.shape)} and {tuple(v.shape)}"
        )
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point; got {q.dtype}")
    check_one_dtype(q, k, v)
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


# ----------------------------------------------------------------------------- AA
def check_relative_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    """AA's ``q, k [B, Nh, H, W, dk]`` with ``H, W, dk >= 1``."""
    if q.dim() != 5:
        raise ValueError(f"q must have shape [B, Nh, H, W, dk]; got {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}; got {tuple(k.shape)}")
    if q.shape[2] < 1 or q.shape[3] < 1 or q.shape[4] < 1:
        raise ValueError(f"q must have H, W, dk >= 1; got {tuple(q.shape)}")


def check_relative_v(q: torch.Tensor, v: torch.Tensor) -> None:
    """AA's ``v [B, Nh, H, W, dv]`` on ``q``'s map."""
    b, nh, h, w = q.shape[:4]
    if v.dim() != 5 or tuple(v.shape[:4]) != (b, nh, h, w):
        raise ValueError(
            f"v must have shape [B, Nh, H, W, dv] with [B, Nh, H, W] = {[b, nh, h, w]}; "
            f"got {tuple(v.shape)}"
        )


def check_relative_embedding(
    name: str, rel: Optional[torch.Tensor], length: int, axis: str, d: int
) -> None:
    """AA's ``rel_h [2H - 1, dk]`` / ``rel_w [2W - 1, dk]`` (or None) for an axis of ``length``."""
    if rel is None:
        return
    if rel.dim() != 2 or tuple(rel.shape) != (2 * length - 1, d):
        raise ValueError(
            f"{name} must have shape [2*{axis}-1, dk] = [{2 * length - 1}, {d}] for a map with "
            f"{axis}={length}; got {tuple(rel.shape)}"
        )


def check_query_positions(query_yx, h: int, w: int, device) -> torch.Tensor:
    """``query_yx``: ``P`` integer ``(y, x)`` positions on an ``[H, W]`` map. Returns them as a
    ``[P, 2]`` long tensor on ``device``."""
    yx = torch.as_tensor(query_yx, dtype=torch.long, device=device)
    if yx.dim() == 1 and yx.numel() == 2:
        yx = yx.view(1, 2)
    if yx.dim() != 2 or yx.shape[1] != 2:
        raise ValueError(f"query_yx must be P (y, x) pairs, shape [P, 2]; got {tuple(yx.shape)}")
    bad = (yx[:, 0] < 0) | (yx[:, 0] >= h) | (yx[:, 1] < 0) | (yx[:, 1] >= w)
    if bool(bad.any()):
        raise ValueError(
            f"query_yx must lie in [0, {h}) x [0, {w}) (the attention map); got "
            f"{yx[bad].tolist()}"
        )
    return yx


# ----------------------------------------------------------------------------- logit tables
def check_logit_tables(q, k, v, tables, key_index) -> None:
    """``attention_with_logit_tables``'s arguments: ``q [*, Lq, d]``, ``k [*, Lk, d]``,
    ``v [*, Lk, dv]``, one ``[*, Lq, M_g]`` table per ``[Lk]`` key index."""
    if len(tables) != len(key_index):
        raise ValueError(f"got {len(tables)} tables but {len(key_index)} key indices")
    *batch, lq, d = q.shape
    lk = k.shape[-2]
    if k.dim() != q.dim() or tuple(k.shape[:-2]) != tuple(batch) or k.shape[-1] != d:
        raise ValueError(f"k must have shape [*, Lk, d] with [*] = {batch}, d = {d}; "
                         f"got {tuple(k.shape)}")
    if v.dim() != q.dim() or tuple(v.shape[:-1]) != (*batch, lk):
        raise ValueError(f"v must have shape [*, Lk, dv] = [{batch}, {lk}, dv]; got {tuple(v.shape)}")
    for t, idx in zip(tables, key_index):
        if t.dim() != q.dim() or tuple(t.shape[:-1]) != (*batch, lq):
            raise ValueError(f"each table must have shape [*, Lq, M] with [*, Lq] = "
                             f"{[*batch, lq]}; got {tuple(t.shape)}")
        if tuple(idx.shape) != (lk,):
            raise ValueError(f"each key index must have shape [Lk] = [{lk}]; got {tuple(idx.shape)}")


def check_one_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``q, k, v`` share one dtype (what the flex and Triton kernels take)."""
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def check_grid_width(width: int, length: int) -> None:
    """``length = H * W`` positions of a row-major grid ``width`` wide."""
    if width < 1 or length % width:
        raise ValueError(f"width must divide L = {length} (L = H * W); got width={width}")


def check_row_col_tables(q, k, v, t_row, t_col, width: int) -> Tuple[int, int]:
    """AA's 2D case of the logit tables on a row-major ``H x W`` grid: ``q, k [*, L, dk]``,
    ``v [*, L, dv]`` (one dtype), ``t_row [*, L, H]``, ``t_col [*, L, W]`` (or None) on ``q``'s
    device. Returns ``(H, W)``."""
    *batch, length, _ = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}; got {tuple(k.shape)}")
    if v.dim() != q.dim() or tuple(v.shape[:-1]) != tuple(q.shape[:-1]):
        raise ValueError(f"v must have shape [*, L, dv] with [*, L] = {list(q.shape[:-1])}; "
                         f"got {tuple(v.shape)}")
    check_one_dtype(q, k, v)
    check_grid_width(width, length)
    h, w = length // width, width
    for name, t, m in (("t_row", t_row, h), ("t_col", t_col, w)):
        if t is not None and tuple(t.shape) != (*batch, length, m):
            raise ValueError(f"{name} must have shape [*, L, {'H' if name == 't_row' else 'W'}] "
                             f"= {[*batch, length, m]}; got {tuple(t.shape)}")
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return h, w
