"""Absolute 2D position encodings: the baselines of the AA paper's position-encoding ablation.

Paper: Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019, Section 4.5
(Tables 6-7) compares its relative encodings with

* "2d Sine": the two-dimensional sinusoidal waves of the Image Transformer (Parmar et al., 2018),
  i.e. Tensor2Tensor's ``add_timing_signal_nd`` for 2 dims -- :func:`sine_2d`;
* "CoordConv" (Liu et al., 2018): ``(x, y, r)`` coordinate channels concatenated to the
  attention input -- :func:`coord_channels`.

Both are pure functions of the map size (no parameters), returned as ``[C, H, W]``.

The relative encodings themselves are parameters of their layers, named as in
:data:`RELATIVE_EMBEDDING_NAMES` by every layer that has them (``LocalSelfAttention2d``,
``AugmentedConv2d``, ``SpatiallyAwareAttentionStem``): the attention statistics find them by
these names.
"""
import math
from typing import Optional

import torch

__all__ = ["RELATIVE_EMBEDDING_NAMES", "sine_2d", "coord_channels"]

#: Parameter names of the relative row / column embeddings in every attention layer.
RELATIVE_EMBEDDING_NAMES = ("rel_h", "rel_w")


def _axis_signal(positions: torch.Tensor, num_timescales: int) -> torch.Tensor:
    """``[L, 2 * num_timescales]``: ``[sin(p / t_i), cos(p / t_i)]`` for timescales 1 .. 1e4."""
    if num_timescales == 0:
        return positions.new_zeros(positions.shape[0], 0)
    increment = math.log(1.0e4) / max(num_timescales - 1, 1)
    inv_timescales = torch.exp(
        torch.arange(num_timescales, dtype=positions.dtype, device=positions.device) * -increment
    )  # [T]
    scaled = positions[:, None] * inv_timescales[None, :]  # [L, T]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)  # [L, 2T]


def sine_2d(
    h: int,
    w: int,
    channels: int,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """2D sinusoidal position encoding ``[channels, H, W]`` (Image Transformer / T2T style).

    With ``T = channels // 4`` timescales ``t_i`` geometrically spaced in ``[1, 1e4]``, channels
    ``[0, 2T)`` encode the row ``y`` as ``[sin(y / t_i), cos(y / t_i)]`` and channels
    ``[2T, 4T)`` encode the column ``x`` likewise (half the channels for rows, half for
    columns); the ``channels % 4`` remaining channels are zero, as in
    ``tensor2tensor.layers.common_attention.add_timing_signal_nd``. Positions are integer pixel
    indices of the map, so the encoding of a pixel does not depend on the map size.

    Args:
        h, w: map size (>= 1).
        channels: number of channels (>= 1).
        device, dtype: of the result (computed in float32, then cast).

    Returns:
        ``[channels, H, W]``.
    """
    if h < 1 or w < 1:
        raise ValueError(f"h and w must be >= 1; got h={h}, w={w}")
    if channels < 1:
        raise ValueError(f"channels must be >= 1; got {channels}")
    nt = channels // 4
    ys = torch.arange(h, dtype=torch.float32, device=device)
    xs = torch.arange(w, dtype=torch.float32, device=device)
    sig_y = _axis_signal(ys, nt).t()[:, :, None].expand(2 * nt, h, w)  # [2T, H, W]
    sig_x = _axis_signal(xs, nt).t()[:, None, :].expand(2 * nt, h, w)  # [2T, H, W]
    pad = torch.zeros(channels - 4 * nt, h, w, device=device)  # [C % 4, H, W]
    out = torch.cat([sig_y, sig_x, pad], dim=0)  # [C, H, W]
    return out.to(dtype) if dtype is not None else out


def _linspace_or_zero(n: int, device) -> torch.Tensor:
    if n == 1:
        return torch.zeros(1, device=device)
    return torch.linspace(-1.0, 1.0, n, device=device)


def coord_channels(
    h: int,
    w: int,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """CoordConv channels ``(x, y, r)`` ``[3, H, W]``, all in ``[-1, 1]``.

    ``x`` runs linearly from -1 (left column) to 1 (right column), ``y`` likewise from top to
    bottom (a length-1 axis is 0), and ``r = sqrt(x^2 + y^2) / sqrt(2)`` is the distance to the
    centre scaled into ``[0, 1]``.

    Args:
        h, w: map size (>= 1).
        device, dtype: of the result (computed in float32, then cast).
    """
    if h < 1 or w < 1:
        raise ValueError(f"h and w must be >= 1; got h={h}, w={w}")
    ys = _linspace_or_zero(h, device)[:, None].expand(h, w)  # [H, W]
    xs = _linspace_or_zero(w, device)[None, :].expand(h, w)  # [H, W]
    r = torch.sqrt(xs * xs + ys * ys) / math.sqrt(2.0)  # [H, W]
    out = torch.stack([xs, ys, r], dim=0)  # [3, H, W]
    return out.to(dtype) if dtype is not None else out
