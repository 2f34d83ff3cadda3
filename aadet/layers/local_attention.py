"""The stand-alone local self-attention layer of SASA, a drop-in for a spatial convolution.

Paper: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019.
Section 2.2 (Eq. 2-3): per pixel, ``Nh`` heads attend over the ``k x k`` neighbourhood with
queries/keys/values from 1x1 projections ``W_Q, W_K, W_V`` (``d_out x d_in``, no bias) and
relative logits ``q . r_{a-i, b-j}`` (row and column offset embeddings of ``dkh/2`` channels
each, concatenated). Section 3.1: when a spatial convolution had a stride, the attention layer
is followed by a 2x2 average pooling with stride 2.

The attention itself is :func:`aadet.layers.functional.local_self_attention_2d` (one of the
routes of ``LOCAL_ATTENTION_BACKENDS``, all exact at the map borders; see there). This module
adds the projections, the head
split, the scaling ``q *= dkh ** -0.5``, the positional encoding and the pooling, and, like
Detectron2's ``Conv2d``, an optional output ``bias``, ``norm`` and ``activation`` so that it can
stand wherever a ``Conv2d(..., norm=...)`` stood.
"""
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .functional.backends.sasa_blocked import halo_local_attention_macs
from .functional.checks import check_block_size, check_kernel_size, check_positive_int
from .functional.dispatch import AUTO
from .functional.local_attention import (
    DEFAULT_BLOCK_SIZE,
    LOCAL_ATTENTION_BACKENDS,
    check_recompute,
    local_self_attention_2d_unchecked,
)
from .local_attention_base import LocalAttention2dBase, attention_options, check_heads
from .position_encoding import sine_2d

__all__ = [
    "ATTENTION_OPTIONS",
    "LocalSelfAttention2d",
    "POSITIONAL_ENCODINGS",
    "split_heads",
    "merge_heads",
]

# Allowed ``positional_encoding`` values (the one definition; the config imports it). "sine2d" is
# the same 2D sine encoding as AugmentedConv2d's.
POSITIONAL_ENCODINGS = ("relative", "sine2d", "none")


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, Nh * d, H, W]`` -> ``[B, Nh, H, W, d]``."""
    b, c, h, w = x.shape
    return x.view(b, num_heads, c // num_heads, h, w).permute(0, 1, 3, 4, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, Nh, H, W, d]`` -> ``[B, Nh * d, H, W]``."""
    b, nh, h, w, d = x.shape
    return x.permute(0, 1, 4, 2, 3).reshape(b, nh * d, h, w)


class LocalSelfAttention2d(LocalAttention2dBase):
    """Multi-head local self-attention over ``k x k`` windows (SASA), optionally strided.

    ``forward(x)``: ``x [B, in_channels, H, W]`` ->

    * ``q, k, v = W_Q x', W_K x', W_V x`` (1x1, no bias, ``out_channels`` each), split into
      ``Nh`` heads of ``dkh = out_channels / Nh`` channels: ``[B, Nh, H, W, dkh]``;
      ``x' = x`` except for ``positional_encoding="sine2d"``;
    * ``q *= dkh ** -0.5``;
    * local attention over centred ``k x k`` windows clipped to the map: ``[B, Nh, H, W, dkh]``,
      heads concatenated: ``[B, out_channels, H, W]``;
    * ``stride == 2``: 2x2 average pooling with stride 2 (``ceil_mode``, averaging only in-map
      pixels), so the output is ``[B, out, ceil(H/2), ceil(W/2)]`` -- the size a stride-2 1x1
      or 3x3/pad-1 convolution gives;
    * ``+ bias`` (if any), ``norm``, ``activation``.

    Positional encodings (paper Table 5):

    * ``"relative"``: ``rel_h [k, dkh//2]`` and ``rel_w [k, dkh - dkh//2]``, shared by all heads,
      initialised ``N(0, dkh ** -1)`` (:mod:`~aadet.layers.local_attention_base`, the set-up
      shared with :class:`~aadet.layers.HaloSelfAttention2d`);
    * ``"sine2d"``: the 2D sine encoding of the Image Transformer
      (:func:`aadet.layers.position_encoding.sine_2d`, integer pixel positions of this map) is
      added to the input of the query and key projections, not of the values;
    * ``"none"``: content only (permutation-equivariant inside each window).

    Initialisation: ``W_Q, W_K, W_V ~ N(0, in_channels ** -0.5)`` (variance preserving);
    callers replacing a convolution re-initialise ``value`` with that convolution's scheme.

    Args:
        in_channels, out_channels: channels of input and output (``out_channels`` is also the
            width of ``q``, ``k`` and ``v``).
        kernel_size: odd spatial extent ``k >= 1`` (paper: 7).
        num_heads: ``Nh``, must divide ``out_channels`` (paper: 8).
        stride: 1 or 2.
        positional_encoding: one of :data:`POSITIONAL_ENCODINGS` (``"relative"`` needs
            ``dkh >= 2``).
        block_size: query tile side of the blocked routes (speed/memory only).
        impl: ``"auto"`` or a route of
            :data:`~aadet.layers.functional.local_attention.LOCAL_ATTENTION_BACKENDS` (see
            :func:`~aadet.layers.functional.local_self_attention_2d`).
        recompute_attention: keep no attention weights for backward but recompute them there
            (the C++ kernel's recompute mode: less training memory; BENCHMARKS.md has its time
            and memory); only with ``impl`` ``"auto"`` (where the route it takes can)
            or a route that can (see :func:`~aadet.layers.functional.local_self_attention_2d`).
            On CPU ``"auto"`` recomputes anyway at heads of up to
            :data:`~aadet.layers.functional.local_attention.AUTO_RECOMPUTE_MAX_HEAD_CHANNELS`
            channels, where that is the faster mode.
        bias: add a learned per-channel bias to the output (off in the paper; used where the
            layer replaces a biased convolution).
        norm: module applied after pooling and bias (e.g. ``nn.BatchNorm2d(out_channels)``).
        activation: callable applied last (e.g. ``F.relu``).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 7,
        num_heads: int = 8,
        stride: int = 1,
        positional_encoding: str = "relative",
        block_size: int = DEFAULT_BLOCK_SIZE,
        impl: str = AUTO,
        *,
        recompute_attention: bool = False,
        bias: bool = False,
        norm: Optional[nn.Module] = None,
        activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ):
        super().__init__()
        check_positive_int(in_channels, "in_channels")
        check_positive_int(out_channels, "out_channels")
        check_block_size(block_size)
        check_kernel_size(kernel_size)
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2; got {stride!r}")
        check_heads(num_heads, out_channels, positional_encoding, POSITIONAL_ENCODINGS)
        LOCAL_ATTENTION_BACKENDS.check(impl)
        check_recompute(recompute_attention, impl, "recompute_attention")

        self.kernel_size = kernel_size
        self.block_size = block_size
        self.impl = impl
        self.recompute_attention = recompute_attention
        # Queries at every pixel; a stride-2 layer pools the output (forward).
        self._init_attention(
            in_channels,
            out_channels,
            num_heads,
            stride,
            positional_encoding,
            relative_rows=kernel_size,
            query_stride=1,
            bias=bias,
            norm=norm,
            activation=activation,
        )

    def queries_keys(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The scaled queries and the keys :meth:`forward` attends with (for analysis, e.g.
        :func:`~aadet.layers.functional.local_attention_probs_2d`).

        Args:
            x: ``[B, in_channels, H, W]`` layer input.

        Returns:
            ``q, k``: ``[B, Nh, H, W, dkh]`` each, ``q`` already multiplied by ``dkh ** -0.5``
            (the sine encoding added to their input for ``"sine2d"``).
        """
        self._check_input(x)
        _, _, h, w = x.shape
        x_qk = x
        if self.positional_encoding == "sine2d":
            x_qk = x + sine_2d(h, w, self.in_channels, device=x.device, dtype=x.dtype)
        nh = self.num_heads
        q = split_heads(self.query(x_qk), nh) * self.head_channels ** -0.5  # [B, Nh, H, W, dkh]
        k = split_heads(self.key(x_qk), nh)  # [B, Nh, H, W, dkh]
        return q, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, in_channels, H, W]`` -> ``[B, out_channels, ceil(H/stride), ceil(W/stride)]``."""
        q, k = self.queries_keys(x)  # [B, Nh, H, W, dkh]
        v = split_heads(self.value(x), self.num_heads)  # [B, Nh, H, W, dkh]
        # The arguments were checked when the layer was built; q, k, v are made above.
        out = local_self_attention_2d_unchecked(
            q, k, v, self.rel_h, self.rel_w, self.kernel_size, self.block_size, self.impl,
            self.recompute_attention,
        )  # [B, Nh, H, W, dkh]
        out = merge_heads(out)  # [B, out_channels, H, W]
        if self.stride == 2:
            out = F.avg_pool2d(out, 2, 2, ceil_mode=True, count_include_pad=False)
        return self._bias_norm_activation(out)

    #: The :meth:`flop_count` components that are the attention itself, not a child convolution
    #: (which a tracing counter such as fvcore counts on its own) or pooling (never counted by
    #: ``aadet.analysis``): what ``aadet.analysis`` counts by formula.
    ATTENTION_FLOP_COMPONENTS = ("content_logits", "relative_logits", "weighted_sum")

    def flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> Dict[str, int]:
        """Multiply-adds of one call on a ``[batch, C_in, H, W]`` input (fvcore's convention:
        1 MAC = 1 flop; the paper counts 2 FLOPs per MAC).

        Idealised like a zero-padded convolution: every query scores ``k^2`` keys, whatever the
        border, and the blocked implementation's extra halo work is not counted
        (:meth:`implementation_flop_count`). With ``n = H * W`` queries, ``C_in``,
        ``C = out_channels``, ``Nh`` heads of ``dkh``, per image:

        * ``projections``: ``3 * n * C_in * C`` (q, k, v 1x1 convolutions);
        * ``content_logits``: ``n * k^2 * C`` (``Nh * k^2`` dot products of ``dkh``);
        * ``relative_logits``: ``n * k * C`` (``Nh`` heads x (``k`` row + ``k`` column) dot
          products of ``dkh/2``), 0 unless ``"relative"``;
        * ``weighted_sum``: ``n * k^2 * C``;
        * ``pooling``: ``n * C`` additions for stride 2, else 0;
        * ``total``: their sum; everything times ``batch``.
        """
        h, w = input_hw
        n = h * w
        c, k = self.out_channels, self.kernel_size
        out = {
            "projections": 3 * n * self.in_channels * c,
            "content_logits": n * k * k * c,
            "relative_logits": n * k * c if self.positional_encoding == "relative" else 0,
            "weighted_sum": n * k * k * c,
            "pooling": n * c if self.stride == 2 else 0,
        }
        out = {key: batch * value for key, value in out.items()}
        out["total"] = sum(out.values())
        return out

    def implementation_flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> int:
        """Multiply-adds of the attention as the fused (blocked, halo) route computes it, an
        estimate to compare with the :attr:`ATTENTION_FLOP_COMPONENTS` of :meth:`flop_count`:
        :func:`~aadet.layers.functional.backends.sasa_blocked.halo_local_attention_macs` plus the
        ``k``-offset row/column table matmuls. (The cpp and neighborhood routes, the CPU ones, do
        exactly the idealised count.)"""
        h, w = input_hw
        rel = self.rel_h is not None
        d = self.head_channels
        implemented = halo_local_attention_macs(
            batch, self.num_heads, (h, w), self.kernel_size, self.block_size, d, d, rel
        )
        if rel:
            implemented += batch * h * w * self.kernel_size * self.out_channels
        return implemented

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"num_heads={self.num_heads}, stride={self.stride}, "
            f"positional_encoding={self.positional_encoding!r}, block_size={self.block_size}, "
            f"impl={self.impl!r}, recompute_attention={self.recompute_attention}, "
            f"bias={self.bias is not None}"
        )


#: The arguments of :class:`LocalSelfAttention2d` other than those a stand-in for a convolution
#: takes from that convolution (:data:`~aadet.layers.local_attention_base.CONV_ARGUMENTS`): the
#: attention options (``kernel_size``, ``num_heads``, ``positional_encoding``, ``block_size``,
#: ``impl``, ``recompute_attention``, ...), which the SASA models pass through unchanged (``**kwargs``) from
#: ``MODEL.SASA.*``, whose defaults are read from this signature.
ATTENTION_OPTIONS = attention_options(LocalSelfAttention2d)
