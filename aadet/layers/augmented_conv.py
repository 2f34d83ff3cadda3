"""Attention Augmented convolution: a kxk convolution concatenated with 2D self-attention.

Paper: Bello, Zoph, Vaswani, Shlens, Le, "Attention Augmented Convolutional Networks", ICCV 2019
(Section 3, Figure 3 and Appendix A.3 Figure 8).

``AAConv(X) = concat[Conv(X), MHA(X)]`` along channels: the convolution gives ``Fout - dv``
maps, multi-head attention gives ``dv``::

    X [B, Fin, H, W]
    |-- conv kxk/s ----------------------------------------------> [B, Fout - dv, Ho, Wo]
    '-- (avg-pool to stride s) (3x3/2 avg-pool if attention_downsample) (+ position encoding)
        -> 1x1 conv -> k, q, v [B, 2dk + dv, h, w];  q *= (dk / Nh) ** -0.5
        -> split heads [B, Nh, h, w, dk/Nh | dv/Nh]
        -> relative_self_attention_2d -> [B, Nh, h, w, dv/Nh] -> combine heads [B, dv, h, w]
        -> 1x1 conv dv -> dv (-> bilinear upsample to [Ho, Wo] if attention_downsample)
        ---------------------------------------------------------> [B, dv, Ho, Wo]

This module is norm-free: the paper follows the augmented convolution by a batch norm, which the
ResNet blocks apply (``aadet.modeling.backbone.aa_resnet``). It imports only torch.

Where we differ from the paper's listings (on purpose):

* The appendix's ``augmented_conv2d`` gives the conv ``Fout - dk`` filters; Figure 3 and Eq. (4)
  use ``Fout - dv`` (so that the output has ``Fout`` channels), as we do.
* ``tf.random_normal_initializer(dkh ** -0.5)`` sets the *mean* (its first argument) to
  ``dkh ** -0.5`` with stddev 1; we use the evident intent, mean 0 and std ``dkh ** -0.5``.
* The listings assume stride 1 and a fixed ``[H, W]``. Strided layers average-pool the attention
  input to the conv's output grid; relative tables are sized for the largest map
  (``max_size``) and sliced per input size.
"""
import math
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .functional.checks import (
    Interval,
    check_in,
    check_int,
    check_kernel_size,
    check_one_of,
    check_positive_int,
    check_query_chunk,
)
from .functional.dispatch import AUTO
from .functional.logit_tables import LOGIT_TABLE_BACKENDS
from .functional.relative_attention import (
    relative_attention_weights_2d,
    relative_self_attention_2d_unchecked,
    relative_table_for_length,
)
from .position_encoding import coord_channels, sine_2d

__all__ = ["AugmentedConv2d", "attention_depth", "KAPPA_RANGE", "NU_RANGE", "POSITIONAL_ENCODINGS"]

POSITIONAL_ENCODINGS = ("relative", "none", "sine2d", "coordconv")
#: ``kappa = dk / Fout``: any positive key depth (the layer's and ``MODEL.AA.KAPPA``'s range).
KAPPA_RANGE = Interval(0.0)
#: ``nu = dv / Fout``: ``dv < Fout``, so that some channels stay convolutional.
NU_RANGE = Interval(0.0, 1.0)


def attention_depth(ratio: float, out_channels: int, num_heads: int, min_per_head: int = 1) -> int:
    """Depth ``dk`` (or ``dv``) from a ratio ``kappa = dk / Fout`` (or ``nu = dv / Fout``).

    ``d = max(Nh * min_per_head, round(ratio * Fout / Nh) * Nh)``: the nearest multiple of the
    number of heads (halves round up), at least ``min_per_head`` channels per head. E.g.
    ``Fout=128, Nh=8``: kappa 0.2 -> 24, nu 0.1 -> 16; ``Fout=512``: 0.2 -> 104, 0.1 -> 48.
    """
    per_head = math.floor(ratio * out_channels / num_heads + 0.5)
    return num_heads * max(per_head, min_per_head, 1)


def _avg_pool_same(x: torch.Tensor, stride: int) -> torch.Tensor:
    """``[B, C, H, W] -> [B, C, floor((H - 1) / s) + 1, ...]``: average pool with kernel
    ``2*(s//2)+1``, padding ``s//2``, stride ``s`` (3x3/2 for s=2), the padding excluded from the
    average (TF's 'SAME' average pooling).

    On CPU it runs as a depthwise convolution with a constant all-ones kernel, divided by each
    window's count of in-map pixels: oneDNN's depthwise convolution and its input gradient cost
    less than ``avg_pool2d``'s channels-first CPU kernels and their backward (the demo AA's
    profile, BENCHMARKS.md); elsewhere, and under tracing (ONNX export, FLOP counting: a pool,
    not a convolution), ``F.avg_pool2d``. Equal to it up to float rounding.
    """
    p = stride // 2
    k = 2 * p + 1
    if x.device.type != "cpu" or torch.jit.is_tracing():
        return F.avg_pool2d(x, k, stride, p, count_include_pad=False)
    c, (h, w) = x.shape[1], x.shape[-2:]
    ones = x.new_ones(1, 1, h, w)
    count = F.conv2d(ones, x.new_ones(1, 1, k, k), stride=stride, padding=p)  # [1, 1, Ho, Wo]
    return F.conv2d(x, x.new_ones(c, 1, k, k), stride=stride, padding=p, groups=c) / count


def _pool_to_stride(x: torch.Tensor, stride: int) -> torch.Tensor:
    """Average pool to the stride (:func:`_avg_pool_same`; identity for stride 1). Output size
    ``floor((H - 1) / s) + 1``: that of a "same"-padded odd-kernel conv of stride s."""
    return x if stride == 1 else _avg_pool_same(x, stride)


def _conv_out_size(size: int, kernel_size: int, stride: int, dilation: int, padding: int) -> int:
    return (size + 2 * padding - dilation * (kernel_size - 1) - 1) // stride + 1


class AugmentedConv2d(nn.Module):
    """Attention Augmented 2D convolution (Bello et al., ICCV 2019).

    Output ``[B, out_channels, Ho, Wo]`` is ``concat[conv(x) [B, Fout - dv, Ho, Wo],
    attention(x) [B, dv, Ho, Wo]]`` with ``Ho = floor((H - 1) / stride) + 1`` (a "same"-padded
    convolution). The attention branch works at the conv's output resolution (its input is
    average pooled to the stride, 3x3/2 for stride 2), or at half of it when
    ``attention_downsample`` (then bilinearly upsampled back to exactly ``[Ho, Wo]``).

    Depths: ``kappa``/``nu`` (ratios to ``Fout``; paper: ``kappa = 2 nu = 0.2``), rounded by
    :func:`attention_depth` to the nearest multiple of ``num_heads`` (at least one channel per
    head, and for ``dk`` at least ``min_dk_per_head`` per head: the paper's CIFAR models use a
    minimum of 20), or ``dk``/``dv`` given as absolute depths instead.

    Position encodings (``positional_encoding``):
      * ``"relative"`` (paper): learned 2D relative logits; tables ``rel_h``, ``rel_w`` of shape
        ``[2 * max_size - 1, dk / Nh]`` shared across heads, normal init with std
        ``(dk / Nh) ** -0.5``; an ``h x w`` attention map uses their centre ``2h - 1`` /
        ``2w - 1`` rows. A side larger than ``max_size`` raises a ValueError unless
        ``clip_distances`` (distances beyond ``max_size - 1`` then share the end rows).
      * ``"none"``: position-unaware attention.
      * ``"sine2d"``: :func:`~aadet.layers.position_encoding.sine_2d` added to the attention
        input.
      * ``"coordconv"``: ``(x, y, r)`` channels concatenated to the attention input (the qkv
        1x1 conv then has ``in_channels + 3`` inputs).

    Parameters (``Fin`` = in_channels, ``Fout`` = out_channels, ``k`` = kernel_size, ``g`` =
    groups, ``L`` = max_size, ``c = 3`` for coordconv else 0)::

        (Fin / g) * (Fout - dv) * k^2 [+ (Fout - dv) if bias]       conv branch
        + (Fin + c) * (2 dk + dv) + (2 dk + dv)                      k, q, v 1x1 conv (biased)
        + dv * dv + dv                                               output 1x1 conv (biased)
        + 2 * (2L - 1) * dk / Nh   (relative only)                   rel_h, rel_w

    The attention 1x1 convs have biases as ``tf.layers.conv2d`` does in the paper's code.

    Args:
        in_channels: ``Fin``.
        out_channels: ``Fout`` (conv channels ``Fout - dv`` plus attention channels ``dv``).
        kernel_size, stride, dilation, groups, bias: of the conv branch (kernel_size odd, so
            that the "same"-padded conv's size matches the attention branch's).
        kappa, nu: ratios ``dk / Fout`` (:data:`KAPPA_RANGE`) and ``dv / Fout``
            (:data:`NU_RANGE`).
        dk, dv: key and value depths (multiples of ``num_heads``, ``0 < dv < Fout``); when
            given, they replace ``kappa`` / ``nu``.
        num_heads: ``Nh``.
        positional_encoding: one of ``POSITIONAL_ENCODINGS``.
        attention_downsample: run attention on a 3x3/2 average-pooled input (paper: in the
            first augmented stage, to save memory).
        max_size: ``Lmax``, the largest attention-map side the relative tables cover.
        clip_distances: clip relative distances to the tables instead of raising.
        min_dk_per_head: minimum ``dk / Nh`` when ``dk`` comes from ``kappa``.
        impl: ``"auto"`` (:func:`~aadet.layers.functional.logit_tables.auto_logit_table_impl`)
            or a route of :data:`~aadet.layers.functional.logit_tables.LOGIT_TABLE_BACKENDS`,
            passed to
            :func:`~aadet.layers.functional.relative_attention.relative_self_attention_2d`.
        query_chunk: queries per chunk of the materialized route (0 = all at once), which
            bounds its memory to ``B * Nh * query_chunk * hw`` logits; it matters only where that
            route runs.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = False,
        *,
        kappa: float = 0.2,
        nu: float = 0.1,
        dk: Optional[int] = None,
        dv: Optional[int] = None,
        num_heads: int = 8,
        positional_encoding: str = "relative",
        attention_downsample: bool = False,
        max_size: int = 64,
        clip_distances: bool = False,
        min_dk_per_head: int = 1,
        impl: str = AUTO,
        query_chunk: int = 0,
    ):
        super().__init__()
        check_positive_int(in_channels, "in_channels")
        check_int(out_channels, "out_channels", 2, note=" (some conv and some attention channels)")
        check_kernel_size(kernel_size)
        for name, value in (("stride", stride), ("dilation", dilation), ("groups", groups),
                            ("num_heads", num_heads), ("max_size", max_size),
                            ("min_dk_per_head", min_dk_per_head)):
            check_positive_int(value, name)
        check_query_chunk(query_chunk)
        check_one_of(positional_encoding, POSITIONAL_ENCODINGS, "positional_encoding")
        LOGIT_TABLE_BACKENDS.check(impl)

        dk = self._resolve_depth("dk", "kappa", dk, kappa, KAPPA_RANGE, out_channels, num_heads,
                                 min_dk_per_head, upper=None)
        dv = self._resolve_depth("dv", "nu", dv, nu, NU_RANGE, out_channels, num_heads, 1,
                                 upper=out_channels)
        if in_channels % groups != 0 or (out_channels - dv) % groups != 0:
            raise ValueError(
                f"AugmentedConv2d: groups={groups} must divide in_channels={in_channels} and the "
                f"conv branch's out_channels - dv = {out_channels} - {dv} = {out_channels - dv}; "
                f"change groups or dv/nu"
            )

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.dilation = dilation
        self.num_heads = num_heads
        self.dk, self.dv = dk, dv
        self.dkh, self.dvh = dk // num_heads, dv // num_heads
        self.positional_encoding = positional_encoding
        self.attention_downsample = bool(attention_downsample)
        self.max_size = max_size
        self.clip_distances = bool(clip_distances)
        self.impl = impl
        self.query_chunk = query_chunk
        self.padding = dilation * (kernel_size - 1) // 2

        self.conv = nn.Conv2d(
            in_channels, out_channels - dv, kernel_size, stride=stride, padding=self.padding,
            dilation=dilation, groups=groups, bias=bias,
        )
        attn_in = in_channels + (3 if positional_encoding == "coordconv" else 0)
        self.qkv = nn.Conv2d(attn_in, 2 * dk + dv, 1)
        self.proj = nn.Conv2d(dv, dv, 1)
        if positional_encoding == "relative":
            std = self.dkh ** -0.5
            self.rel_h = nn.Parameter(torch.randn(2 * max_size - 1, self.dkh) * std)
            self.rel_w = nn.Parameter(torch.randn(2 * max_size - 1, self.dkh) * std)
        else:
            self.register_parameter("rel_h", None)
            self.register_parameter("rel_w", None)

    @staticmethod
    def _resolve_depth(name, ratio_name, depth, ratio, ratio_range, fout, nh, min_per_head, upper):
        """``depth`` as given, else from ``ratio`` (:func:`attention_depth`); checked."""
        if depth is None:
            check_in(ratio, ratio_range, ratio_name)
            depth = attention_depth(ratio, fout, nh, min_per_head)
        else:
            ratio = None  # the message below names the ratio only where the depth came from it
        check_positive_int(depth, name)
        if depth % nh != 0:
            raise ValueError(f"AugmentedConv2d: num_heads={nh} must divide {name}={depth} "
                             f"({name} / num_heads >= 1 channels per head)")
        if upper is not None and depth >= upper:
            raise ValueError(f"AugmentedConv2d: {name} must satisfy 0 < {name} < out_channels="
                             f"{upper} (some channels must stay convolutional); got {depth}"
                             + (f" from {ratio_name}={ratio}" if ratio is not None else ""))
        return depth

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
            f"kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}, "
            f"dk={self.dk}, dv={self.dv}, num_heads={self.num_heads}, "
            f"positional_encoding={self.positional_encoding!r}, "
            f"attention_downsample={self.attention_downsample}, max_size={self.max_size}, "
            f"clip_distances={self.clip_distances}"
        )

    # ------------------------------------------------------------------ sizes
    def output_size(self, height: int, width: int) -> Tuple[int, int]:
        """``(Ho, Wo)`` of the layer (and its conv branch) for an ``height x width`` input."""
        k, s, d, p = self.kernel_size, self.stride, self.dilation, self.padding
        return _conv_out_size(height, k, s, d, p), _conv_out_size(width, k, s, d, p)

    def attention_grid_size(self, height: int, width: int) -> Tuple[int, int]:
        """``(h, w)`` of the map the attention runs on, for an ``height x width`` input."""
        h, w = self.output_size(height, width)
        if self.attention_downsample:
            h, w = (h - 1) // 2 + 1, (w - 1) // 2 + 1
        return h, w

    # ------------------------------------------------------------------ FLOPs
    #: The :meth:`flop_count` components that are the attention itself, not a child convolution
    #: (which a tracing counter such as fvcore counts on its own): what ``aadet.analysis``
    #: counts by formula.
    ATTENTION_FLOP_COMPONENTS = ("content_logits", "relative_logits", "weighted_sum")

    def flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> Dict[str, int]:
        """Multiply-adds of one call on a ``[batch, Fin, H, W]`` input (fvcore's convention:
        1 MAC = 1 flop; the paper counts 2 FLOPs per MAC; biases not counted).

        With ``(Ho, Wo)`` the output size (:meth:`output_size`), ``(h, w)`` the attention grid
        (:meth:`attention_grid_size`), ``n = h w`` (each query against all ``n`` keys), ``g``
        groups, ``c = 3`` for coordconv else 0, per image:

        * ``conv``: ``Ho Wo (Fin / g) (Fout - dv) k^2`` (the conv branch);
        * ``projections``: ``n (Fin + c) (2 dk + dv) + n dv^2`` (k, q, v and output 1x1 convs);
        * ``content_logits``: ``n^2 dk``;
        * ``relative_logits``: ``n (h + w) dk`` (each query needs ``h`` row and ``w`` column
          offsets ``q_h . r``; the paper's and our implementation evaluate ``2h - 1`` and
          ``2w - 1`` offsets per query row: :meth:`implementation_flop_count`), 0 unless
          ``"relative"``;
        * ``weighted_sum``: ``n^2 dv``;
        * ``total``: their sum; everything times ``batch``.
        """
        height, width = input_hw
        ho, wo = self.output_size(height, width)
        h, w = self.attention_grid_size(height, width)
        n, dk, dv = h * w, self.dk, self.dv
        attn_in = self.qkv.in_channels
        out = {
            "conv": ho * wo * (self.in_channels // self.conv.groups) * self.conv.out_channels
            * self.kernel_size ** 2,
            "projections": n * attn_in * (2 * dk + dv) + n * dv * dv,
            "content_logits": n * n * dk,
            "relative_logits": n * (h + w) * dk if self.positional_encoding == "relative" else 0,
            "weighted_sum": n * n * dv,
        }
        out = {key: batch * value for key, value in out.items()}
        out["total"] = sum(out.values())
        return out

    def implementation_flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> int:
        """Multiply-adds of the attention as the fused (SDPA) route computes it (an estimate;
        compare with the :attr:`ATTENTION_FLOP_COMPONENTS` of :meth:`flop_count`; the CPU C++
        kernel adds the tables without widening the heads).

        Logits with ``dkh + h + w`` dims (the row/column tables appended to ``q``, one-hot
        indicators to ``k``), the weighted sum, and the ``2h - 1`` / ``2w - 1`` offset matmuls
        building the tables; all ``Nh`` heads.
        """
        h, w = self.attention_grid_size(*input_hw)
        n, nh, rel = h * w, self.num_heads, self.positional_encoding == "relative"
        implemented = batch * nh * n * n * (self.dkh + self.dvh + ((h + w) if rel else 0))
        if rel:
            implemented += batch * nh * n * ((2 * h - 1) + (2 * w - 1)) * self.dkh
        return implemented

    # ------------------------------------------------------------------ attention pieces
    def _attention_input(self, x: torch.Tensor) -> torch.Tensor:
        """Pool ``x`` to the attention grid and add/concat the absolute position encoding."""
        x = _pool_to_stride(x, self.stride)  # [B, Fin, Ho, Wo]
        if self.attention_downsample:
            x = _avg_pool_same(x, 2)  # 3x3/2 [B, Fin, h, w]
        b, _, h, w = x.shape
        if self.positional_encoding == "sine2d":
            x = x + sine_2d(h, w, self.in_channels, device=x.device, dtype=x.dtype)
        elif self.positional_encoding == "coordconv":
            coords = coord_channels(h, w, device=x.device, dtype=x.dtype)  # [3, h, w]
            x = torch.cat([x, coords.expand(b, 3, h, w)], dim=1)  # [B, Fin + 3, h, w]
        return x

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Nh * d, h, w] -> [B, Nh, h, w, d]`` (channel ``c = head * d + j``)."""
        b, c, h, w = x.shape
        return x.view(b, self.num_heads, c // self.num_heads, h, w).permute(0, 1, 3, 4, 2)

    def _qkv(self, x: torch.Tensor):
        """Scaled queries, keys, values ``[B, Nh, h, w, dkh | dvh]`` from the attention input."""
        kqv = self.qkv(x)  # [B, 2dk + dv, h, w]
        k, q, v = torch.split(kqv, [self.dk, self.dk, self.dv], dim=1)  # k, q, v as in the paper
        q = q * self.dkh ** -0.5  # scaled dot-product; relative logits use the scaled q
        return self._split_heads(q), self._split_heads(k), self._split_heads(v)

    def _relative_embeddings(self, h: int, w: int):
        """``rel_h [2h-1, dkh]``, ``rel_w [2w-1, dkh]`` for an ``h x w`` map (or None, None)."""
        if self.positional_encoding != "relative":
            return None, None
        if max(h, w) > self.max_size and not self.clip_distances:
            raise ValueError(
                f"AugmentedConv2d: attention map of size {h}x{w} is larger than the layer's "
                f"max_size={self.max_size} (its relative tables cover distances up to "
                f"{self.max_size - 1}); raise MODEL.AA.MAX_INPUT_SIZE (or the layer's max_size) "
                f"or set MODEL.AA.CLIP_DISTANCES"
            )
        return relative_table_for_length(self.rel_h, h), relative_table_for_length(self.rel_w, w)

    def _check_input(self, x: torch.Tensor):
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"AugmentedConv2d expects input [B, {self.in_channels}, H, W]; got {tuple(x.shape)}"
            )

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Fin, H, W] -> [B, Fout, Ho, Wo]`` (conv channels first, then attention)."""
        self._check_input(x)
        conv_out = self.conv(x)  # [B, Fout - dv, Ho, Wo]
        xa = self._attention_input(x)  # [B, Fin (+3), h, w]
        q, k, v = self._qkv(xa)  # [B, Nh, h, w, dkh | dvh]
        b, nh, h, w, _ = v.shape
        rel_h, rel_w = self._relative_embeddings(h, w)
        # impl and query_chunk were checked when the layer was built; q, k, v are made above.
        attn = relative_self_attention_2d_unchecked(
            q, k, v, rel_h, rel_w, impl=self.impl, query_chunk=self.query_chunk
        )  # [B, Nh, h, w, dvh]
        attn = attn.permute(0, 1, 4, 2, 3).reshape(b, self.dv, h, w)  # combine heads [B, dv, h, w]
        attn = self.proj(attn)  # [B, dv, h, w]
        out_size = conv_out.shape[-2:]
        if self.attention_downsample:
            attn = F.interpolate(attn, size=out_size, mode="bilinear", align_corners=False)
        assert attn.shape[-2:] == out_size, (tuple(attn.shape), tuple(conv_out.shape))
        return torch.cat([conv_out, attn.to(conv_out.dtype)], dim=1)  # [B, Fout, Ho, Wo]

    def attention_maps(
        self, x: torch.Tensor, query_yx: Union[torch.Tensor, Sequence[Sequence[int]]]
    ) -> torch.Tensor:
        """Attention probabilities of ``P`` query positions (paper Appendix A.4's figures).

        Args:
            x: ``[B, Fin, H, W]`` layer input.
            query_yx: ``[P, 2]`` ``(y, x)`` positions on the attention grid
                (:meth:`attention_grid_size`; the output grid unless ``attention_downsample``).

        Returns:
            ``[B, Nh, P, h, w]``; each ``[h, w]`` map sums to 1. Runs under autograd if enabled;
            wrap in ``torch.no_grad()`` for visualization.
        """
        self._check_input(x)
        q, k, _ = self._qkv(self._attention_input(x))  # [B, Nh, h, w, dkh]
        rel_h, rel_w = self._relative_embeddings(q.shape[2], q.shape[3])
        return relative_attention_weights_2d(q, k, rel_h, rel_w, query_yx)
