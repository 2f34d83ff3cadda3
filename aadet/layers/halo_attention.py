"""The blocked local self-attention layer of HaloNet, a drop-in for a spatial convolution.

Paper: Vaswani, Ramachandran, Srinivas, Parmar, Hechtman, Shlens, "Scaling Local Self-Attention
for Parameter Efficient Visual Backbones", CVPR 2021 (blocked local attention, Figure 1). The map is cut into ``b x b``
query blocks; the queries of a block share one window, the block plus a halo of ``h`` pixels
(paper: ``b = 8``, ``h = 3``, 8 heads), with SASA's relative row/column logits. A strided layer
downsamples by attention (the paper's "attention downsampling", as timm's ``HaloAttn``): the
queries lie on the strided grid -- query ``(y', x')`` at input pixel ``(s y', s x')`` -- while
keys and values stay at full resolution with the halo, so no pooling follows.

The attention itself is :func:`aadet.layers.functional.halo_attention_2d` (a route of
``HALO_ATTENTION_BACKENDS``, all exact at the map borders, where keys outside the map are left
out of the softmax instead of zero-padded; any ``H, W``). This module adds the projections, the
head split, the scaling ``q *= dkh ** -0.5``, the relative embeddings and, like
:class:`~aadet.layers.LocalSelfAttention2d` (whose set-up it shares:
:mod:`~aadet.layers.local_attention_base`), an optional output ``bias``, ``norm`` and
``activation`` so that it can stand where a ``Conv2d(..., norm=...)`` stood.
"""
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .functional.checks import check_block_size, check_halo_size, check_positive_int, check_query_stride
from .functional.dispatch import AUTO
from .functional.halo_attention import HALO_ATTENTION_BACKENDS, halo_attention_2d_unchecked
from .local_attention import merge_heads, split_heads
from .local_attention_base import LocalAttention2dBase, attention_options, check_heads

__all__ = ["HALO_ATTENTION_OPTIONS", "HaloSelfAttention2d", "POSITIONAL_ENCODINGS"]

#: Allowed ``positional_encoding`` values (the one definition; the config imports it):
#: ``"relative"`` (the paper's) or ``"none"`` (content only).
POSITIONAL_ENCODINGS = ("relative", "none")


class HaloSelfAttention2d(LocalAttention2dBase):
    """Multi-head blocked local self-attention with halos (HaloNet), optionally strided.

    ``forward(x)``: ``x [B, in_channels, H, W]`` -> ``[B, out_channels, Ho, Wo]``, ``Ho =
    ceil(H / stride)``, ``Wo = ceil(W / stride)`` (the size a strided 1x1 or 3x3/pad-1
    convolution gives):

    * ``q = W_Q x`` on the strided grid (a 1x1 convolution of stride ``s``: the input pixels
      ``(s y', s x')``), ``k, v = W_K x, W_V x`` at full resolution (1x1, no bias,
      ``out_channels`` each), split into ``Nh`` heads of ``dkh = out_channels / Nh`` channels:
      ``q [B, Nh, Ho, Wo, dkh]``, ``k, v [B, Nh, H, W, dkh]``;
    * ``q *= dkh ** -0.5``;
    * blocked attention: query ``(y', x')`` attends to the keys of the window of the ``b x b``
      block holding its pixel, rows ``[Y b - h, Y b + b + h)`` and columns likewise, clipped to
      the map: ``[B, Nh, Ho, Wo, dkh]``, heads concatenated: ``[B, out_channels, Ho, Wo]``;
    * ``+ bias`` (if any), ``norm``, ``activation``.

    Relative embeddings (``"relative"``): ``rel_h [2(b + h) - 1, dkh//2]`` and ``rel_w [2(b + h)
    - 1, dkh - dkh//2]`` for the key-minus-query offsets, shared by all heads, initialised ``N(0,
    dkh ** -1)`` as :class:`~aadet.layers.LocalSelfAttention2d`'s. ``W_Q, W_K, W_V ~ N(0,
    in_channels ** -0.5)`` (variance preserving); callers replacing a convolution re-initialise
    ``value`` with that convolution's scheme.

    Args:
        in_channels, out_channels: channels of input and output (``out_channels`` is also the
            width of ``q``, ``k`` and ``v``).
        block_size: query block side ``b >= 1`` (paper: 8); with ``b = 1`` the layer is SASA's
            with ``kernel_size = 2 h + 1``.
        halo_size: halo ``h >= 0`` around each block (paper: 3).
        num_heads: ``Nh``, must divide ``out_channels`` (paper: 8).
        stride: attention downsampling ``s >= 1``, a divisor of ``block_size``.
        positional_encoding: one of :data:`POSITIONAL_ENCODINGS` (``"relative"`` needs ``dkh >=
            2``).
        impl: ``"auto"`` or a route of
            :data:`~aadet.layers.functional.halo_attention.HALO_ATTENTION_BACKENDS` (see
            :func:`~aadet.layers.functional.halo_attention_2d`).
        bias: add a learned per-channel bias to the output (used where the layer replaces a
            biased convolution).
        norm: module applied after the bias (e.g. ``nn.BatchNorm2d(out_channels)``).
        activation: callable applied last (e.g. ``F.relu``).

    Raises:
        ValueError: at construction, naming the argument, its allowed range and the given value.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        block_size: int = 8,
        halo_size: int = 3,
        num_heads: int = 8,
        stride: int = 1,
        positional_encoding: str = "relative",
        impl: str = AUTO,
        *,
        bias: bool = False,
        norm: Optional[nn.Module] = None,
        activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ):
        super().__init__()
        check_positive_int(in_channels, "in_channels")
        check_positive_int(out_channels, "out_channels")
        check_block_size(block_size)
        check_halo_size(halo_size)
        check_query_stride(stride, block_size, "stride")
        check_heads(num_heads, out_channels, positional_encoding, POSITIONAL_ENCODINGS)
        HALO_ATTENTION_BACKENDS.check(impl)

        self.block_size = block_size
        self.halo_size = halo_size
        self.impl = impl
        # Attention downsampling: queries on the strided grid, keys and values at full resolution.
        self._init_attention(
            in_channels,
            out_channels,
            num_heads,
            stride,
            positional_encoding,
            relative_rows=self.relative_rows,
            query_stride=stride,
            bias=bias,
            norm=norm,
            activation=activation,
        )

    @property
    def window(self) -> int:
        """The window side ``b + 2h`` every block's queries attend over (fewer at the borders)."""
        return self.block_size + 2 * self.halo_size

    @property
    def relative_rows(self) -> int:
        """Rows of ``rel_h`` / ``rel_w``: every key-minus-query offset in a window, ``2(b + h) - 1``."""
        return 2 * (self.block_size + self.halo_size) - 1

    def queries_keys(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The scaled queries and the keys :meth:`forward` attends with (for analysis, e.g.
        :func:`~aadet.layers.functional.halo_attention_probs_2d` with ``query_stride=stride``).

        Args:
            x: ``[B, in_channels, H, W]`` layer input.

        Returns:
            ``q [B, Nh, Ho, Wo, dkh]`` (already multiplied by ``dkh ** -0.5``) and ``k [B, Nh,
            H, W, dkh]``.
        """
        self._check_input(x)
        nh = self.num_heads
        q = split_heads(self.query(x), nh) * self.head_channels ** -0.5  # [B, Nh, Ho, Wo, dkh]
        k = split_heads(self.key(x), nh)  # [B, Nh, H, W, dkh]
        return q, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, in_channels, H, W]`` -> ``[B, out_channels, ceil(H/stride), ceil(W/stride)]``."""
        q, k = self.queries_keys(x)  # [B, Nh, Ho, Wo, dkh], [B, Nh, H, W, dkh]
        v = split_heads(self.value(x), self.num_heads)  # [B, Nh, H, W, dkh]
        # The arguments were checked when the layer was built; q, k, v are made above.
        out = halo_attention_2d_unchecked(
            q, k, v, self.rel_h, self.rel_w, self.block_size, self.halo_size, self.stride, self.impl
        )  # [B, Nh, Ho, Wo, dkh]
        out = merge_heads(out)  # [B, out_channels, Ho, Wo]
        return self._bias_norm_activation(out)

    #: The :meth:`flop_count` components that are the attention itself, not a child convolution
    #: (which a tracing counter such as fvcore counts on its own): what ``aadet.analysis``
    #: counts by formula.
    ATTENTION_FLOP_COMPONENTS = ("content_logits", "relative_logits", "weighted_sum")

    def flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> Dict[str, int]:
        """Multiply-adds of one call on a ``[batch, C_in, H, W]`` input (fvcore's convention:
        1 MAC = 1 flop; the papers count 2 FLOPs per MAC).

        Idealised like a zero-padded convolution: every query scores the whole ``u x u`` window
        (``u = b + 2h``), whatever the border. With ``n = H W`` input pixels, ``n_q = Ho Wo``
        queries, ``C_in``, ``C = out_channels``, per image:

        * ``projections``: ``n_q C_in C + 2 n C_in C`` (q on the strided grid, k and v at full
          resolution);
        * ``content_logits``: ``n_q u^2 C`` (``Nh u^2`` dot products of ``dkh``);
        * ``relative_logits``: ``n_q u C`` (``Nh`` heads x (``u`` row + ``u`` column) dot
          products of ``dkh/2``), 0 without relative embeddings;
        * ``weighted_sum``: ``n_q u^2 C``;
        * ``total``: their sum; everything times ``batch``.
        """
        h, w = input_hw
        ho, wo = self.output_size(input_hw)
        n, nq = h * w, ho * wo
        c, u = self.out_channels, self.window
        out = {
            "projections": (nq + 2 * n) * self.in_channels * c,
            "content_logits": nq * u * u * c,
            "relative_logits": nq * u * c if self.rel_h is not None else 0,
            "weighted_sum": nq * u * u * c,
        }
        out = {key: batch * value for key, value in out.items()}
        out["total"] = sum(out.values())
        return out

    def implementation_flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> int:
        """Multiply-adds of the attention as the routes compute it, an estimate to compare with
        the :attr:`ATTENTION_FLOP_COMPONENTS` of :meth:`flop_count`: the window products of
        whole ``u x u`` windows (what the fused route does; the C++ route skips the keys
        outside the map) plus the position terms of all ``2(b + h) - 1`` offsets per query."""
        nq = batch * self.output_size(input_hw)[0] * self.output_size(input_hw)[1]
        c, u = self.out_channels, self.window
        implemented = 2 * nq * u * u * c
        if self.rel_h is not None:
            implemented += nq * self.relative_rows * c
        return implemented

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, block_size={self.block_size}, "
            f"halo_size={self.halo_size}, num_heads={self.num_heads}, stride={self.stride}, "
            f"positional_encoding={self.positional_encoding!r}, impl={self.impl!r}, "
            f"bias={self.bias is not None}"
        )


#: The arguments of :class:`HaloSelfAttention2d` other than those a stand-in for a convolution
#: takes from that convolution (:data:`~aadet.layers.local_attention_base.CONV_ARGUMENTS`): the
#: attention options (``block_size``, ``halo_size``, ``num_heads``, ``positional_encoding``,
#: ``impl``), which the HaloNet models pass through from ``MODEL.HALO.*``, whose defaults are read
#: from this signature.
HALO_ATTENTION_OPTIONS = attention_options(HaloSelfAttention2d)
