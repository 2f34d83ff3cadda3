"""CCNet's criss-cross attention block and its recurrent module (RCCA).

Paper: Huang, Wang, Huang, Huang, Wei, Liu, "CCNet: Criss-Cross Attention for Semantic
Segmentation", ICCV 2019 / TPAMI 2020, Sections 3.2-3.3.

* :class:`CrissCrossAttention2d` (Sec. 3.2, the paper's ``CrissCrossAttention``): 1x1
  projections ``q, k`` to ``C / reduction`` channels (``C/8`` in the paper) and ``v`` to ``C``
  (each with a bias, as the paper's code), every pixel attending over its row and column
  (:func:`~aadet.layers.functional.criss_cross.criss_cross_attention_2d`: ``H + W - 1`` keys,
  the pixel once), added back to the input as ``x + gamma * attention(x)`` with the learned
  scalar ``gamma`` initialised to 0 (the block starts as the identity). No ``1/sqrt(d)`` scaling
  of ``q``: the paper's code has none (the projection learns the scale). ``num_heads`` splits
  ``q, k`` and ``v`` into heads (1 in the paper).
* :class:`RecurrentCrissCrossAttention` (Sec. 3.3, RCCA): a 3x3 conv reducing the input to
  ``inter_channels`` (``C_in / 4``), the *same* criss-cross block applied ``recurrence`` times
  (``R = 2`` in the paper: two passes reach every pixel of the map, the shared weights add no
  parameters), a 3x3 conv, concatenation with the input and a bottleneck conv to
  ``out_channels`` (3x3 in the paper's code, ``bottleneck_kernel_size``); each conv followed by a
  norm and ReLU (the paper's code: ``conva``,
  ``convb``, ``bottleneck``, its classifier and dropout left to the caller).

Plain ``nn.Module`` layers, usable without Detectron2 (only a norm named by a Detectron2 name
other than ``"BN"`` imports it).
"""
from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .attention_stem import NormSpec, _make_norm
from .functional.checks import (
    ErrorFactory,
    argument_error,
    check_bool,
    check_kernel_size,
    check_num_heads,
    check_positive_int,
)
from .functional.criss_cross import CRISS_CROSS_BACKENDS, criss_cross_attention_2d_unchecked
from .functional.dispatch import AUTO
from .local_attention import merge_heads, split_heads

__all__ = [
    "CrissCrossAttention2d",
    "RecurrentCrissCrossAttention",
    "check_criss_cross_heads",
    "rcca_inter_channels",
]


def check_criss_cross_heads(
    num_heads, reduction, channels: int, channels_name: str = "channels", *,
    names: Tuple[str, str] = ("num_heads", "reduction"), error: ErrorFactory = argument_error,
) -> int:
    """``reduction`` an integer in ``[1, channels]`` (``q, k`` get ``channels // reduction >= 1``
    channels) and ``num_heads`` dividing both that width and ``channels`` (``v``'s). Returns the
    ``q, k`` width ``channels // reduction``. ``channels_name``: how the caller knows
    ``channels``; ``names``: of ``num_heads`` and ``reduction`` in the message (config keys with
    ``error=config_error``)."""
    heads_name, reduction_name = names
    if isinstance(reduction, bool) or not isinstance(reduction, int) or not 1 <= reduction <= channels:
        raise error(
            reduction_name,
            f"an integer in [1, {channels_name}={channels}] (q and k get {channels_name} // "
            "reduction >= 1 channels)",
            reduction,
        )
    qk = channels // reduction
    what = f"{channels_name} // reduction = {qk} (the q/k width)"
    check_num_heads(num_heads, qk, name=heads_name, channels_name=what, error=error)
    check_num_heads(num_heads, channels, name=heads_name, channels_name=f"{channels_name}={channels} (the v width)",
                    error=error)
    return qk


def rcca_inter_channels(
    in_channels: int, inter_channels, *, name: str = "inter_channels", default=None,
    error: ErrorFactory = argument_error,
) -> int:
    """The width RCCA attends in: ``inter_channels``, an integer >= 1, or where it is ``default``
    (how the caller says "the paper's": the layer's ``None``, the config's 0) ``in_channels // 4``
    (512 for a 2048-channel res5), which must then be >= 1. ``name``: of ``inter_channels`` in
    the message (a config key with ``error=config_error``)."""
    uses_default = inter_channels is None if default is None else (
        type(inter_channels) is int and inter_channels == default)
    if uses_default:
        inter = in_channels // 4
        if inter < 1:
            raise error(name, f"an integer >= 1 ({default!r} means in_channels // 4, which is 0 for "
                        f"in_channels={in_channels})", inter_channels)
        return inter
    check_positive_int(inter_channels, name, error)
    return inter_channels


def _check_input(module: nn.Module, x: torch.Tensor) -> None:
    if x.dim() != 4 or x.shape[1] != module.in_channels:
        raise ValueError(f"{type(module).__name__} expects [B, {module.in_channels}, H, W]; got {tuple(x.shape)}")


class CrissCrossAttention2d(nn.Module):
    """CCNet's criss-cross attention block: ``[B, C, H, W]`` -> ``[B, C, H, W]``.

    ``forward(x) = x + gamma * attention(x)`` (:meth:`attention`):

    * ``q, k = W_Q x + b_Q, W_K x + b_K`` (1x1, ``C // reduction`` channels each), ``v = W_V x +
      b_V`` (1x1, ``C`` channels), split into ``Nh`` heads: ``[B, Nh, H, W, d]`` and
      ``[B, Nh, H, W, C / Nh]``;
    * criss-cross attention (each pixel over its column and row, itself once):
      ``[B, Nh, H, W, C / Nh]``, heads concatenated: ``[B, C, H, W]``.

    Args:
        channels: ``C``, channels of input and output.
        num_heads: ``Nh``, dividing ``C // reduction`` and ``C`` (paper: 1).
        reduction: ``q, k`` have ``C // reduction`` channels, an integer in ``[1, C]`` (paper: 8).
        impl: ``"auto"`` or a route of
            :data:`~aadet.layers.functional.criss_cross.CRISS_CROSS_BACKENDS`.

    Parameters: ``query``, ``key`` ``[C // reduction, C, 1, 1]`` and ``value`` ``[C, C, 1, 1]``
    with biases (PyTorch's default init, as the paper's code), ``gamma [1]`` = 0.
    """

    def __init__(self, channels: int, *, num_heads: int = 1, reduction: int = 8, impl: str = AUTO):
        super().__init__()
        check_positive_int(channels, "channels")
        qk = check_criss_cross_heads(num_heads, reduction, channels)
        CRISS_CROSS_BACKENDS.check(impl)
        self.in_channels = self.out_channels = channels
        self.num_heads = num_heads
        self.reduction = reduction
        self.impl = impl
        self.query = nn.Conv2d(channels, qk, 1)
        self.key = nn.Conv2d(channels, qk, 1)
        self.value = nn.Conv2d(channels, channels, 1)
        self.gamma = nn.Parameter(torch.zeros(1))  # the paper's: the block starts as the identity

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> ``[B, C, H, W]``: the criss-cross attention output, before ``gamma``
        and the residual."""
        _check_input(self, x)
        nh = self.num_heads
        q = split_heads(self.query(x), nh)  # [B, Nh, H, W, d]
        k = split_heads(self.key(x), nh)  # [B, Nh, H, W, d]
        v = split_heads(self.value(x), nh)  # [B, Nh, H, W, C / Nh]
        # impl was checked when the block was built; q, k, v are made above.
        out = criss_cross_attention_2d_unchecked(q, k, v, self.impl)  # [B, Nh, H, W, C / Nh]
        return merge_heads(out)  # [B, C, H, W]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> ``x + gamma * attention(x)``, ``[B, C, H, W]``."""
        out = self.attention(x)
        return x + self.gamma.to(out.dtype) * out

    ATTENTION_FLOP_COMPONENTS = ("content_logits", "weighted_sum")

    def flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> Dict[str, int]:
        """Multiply-adds of one call on a ``[batch, C, H, W]`` input (fvcore's convention: 1 MAC =
        1 flop; the papers count 2 FLOPs per MAC). With ``n = H W`` pixels, ``d = C // reduction``
        and ``H + W - 1`` keys a pixel (its column and its row, itself once), per image:

        * ``projections``: ``n C (2 d + C)`` (``q, k`` to ``d``, ``v`` to ``C``);
        * ``content_logits``: ``n (H + W - 1) d``;
        * ``weighted_sum``: ``n (H + W - 1) C``;
        * ``total``: their sum; everything times ``batch``.
        """
        h, w = input_hw
        n, keys, c, d = h * w, h + w - 1, self.in_channels, self.query.out_channels
        out = {"projections": n * c * (2 * d + c), "content_logits": n * keys * d, "weighted_sum": n * keys * c}
        out = {k: batch * v for k, v in out.items()}
        out["total"] = sum(out.values())
        return out

    def implementation_flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> int:
        """Multiply-adds of the attention as the ``"materialized"`` route computes it, to compare
        with the :attr:`ATTENTION_FLOP_COMPONENTS` of :meth:`flop_count`: the column and the row
        products each score the pixel itself (``H + W`` keys, one of them masked)."""
        h, w = input_hw
        return batch * h * w * (h + w) * (self.query.out_channels + self.in_channels)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, num_heads={self.num_heads}, reduction={self.reduction}, impl={self.impl!r}"


def _conv_norm_relu(
    in_channels: int, out_channels: int, norm: NormSpec, relu: bool = True, kernel_size: int = 3
) -> nn.Sequential:
    """A ``kernel_size`` conv ("same" padding; a bias only without a norm), the norm, ReLU (where
    ``relu``): ``[B, in, H, W]`` -> ``[B, out, H, W]``. The conv is MSRA-filled (Detectron2's
    ``c2_msra_fill``: He normal, fan-out)."""
    norm_module = _make_norm(norm, out_channels)
    conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=norm_module is None)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)
    layers = [("conv", conv)] + ([("norm", norm_module)] if norm_module is not None else [])
    return nn.Sequential(OrderedDict(layers + ([("relu", nn.ReLU())] if relu else [])))


class RecurrentCrissCrossAttention(nn.Module):
    """CCNet's RCCA module: ``[B, in_channels, H, W]`` -> ``[B, out_channels, H, W]``.

    ``forward(x)``, in order:

    * ``conva``: 3x3 conv + norm + ReLU to ``inter_channels``: ``[B, inter, H, W]``;
    * the criss-cross block ``cca`` (a :class:`CrissCrossAttention2d`) applied ``recurrence``
      times with the same weights (:meth:`recurrent_attention`): ``[B, inter, H, W]``;
    * ``convb``: 3x3 conv + norm + ReLU: ``[B, inter, H, W]``;
    * concatenation with ``x``: ``[B, in + inter, H, W]``;
    * ``bottleneck``: ``bottleneck_kernel_size`` conv + norm + ReLU to ``out_channels``:
      ``[B, out, H, W]``.

    Args:
        in_channels, out_channels: channels of input and output.
        inter_channels: channels of the attended map, an integer >= 1; None (default):
            ``in_channels // 4`` (the paper's: 512 for a 2048-channel res5).
        recurrence: ``R``, passes of the shared block, an integer >= 1 (paper: 2, which reaches
            every pixel).
        num_heads, reduction, impl: of the block (:class:`CrissCrossAttention2d`; paper: 1, 8).
        norm: ``"BN"`` (default), another name of Detectron2's ``get_norm`` (``"GN"``, ...),
            ``""`` (none: the convs get a bias), a module, or a callable ``channels -> module``.
        bottleneck_relu: whether the bottleneck ends with its ReLU (the paper's module: True);
            False for a residual branch, which ends at its norm (the ReLU follows the sum).
        bottleneck_kernel_size: the bottleneck conv's kernel, an odd integer >= 1 (the paper's
            code: 3). Of the module's convs it is the widest (``in + inter`` -> ``out``
            channels): 1 makes it 9x cheaper (at ``inter = in / 4`` and ``out = in``, the module's
            conv FLOPs drop from 14.1 to 4.1 ``in^2`` per pixel), a departure from the paper.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        inter_channels: Optional[int] = None,
        recurrence: int = 2,
        num_heads: int = 1,
        reduction: int = 8,
        norm: NormSpec = "BN",
        bottleneck_relu: bool = True,
        bottleneck_kernel_size: int = 3,
        impl: str = AUTO,
    ):
        super().__init__()
        check_positive_int(in_channels, "in_channels")
        check_positive_int(out_channels, "out_channels")
        inter = rcca_inter_channels(in_channels, inter_channels)
        check_positive_int(recurrence, "recurrence")
        check_bool(bottleneck_relu, "bottleneck_relu")
        check_kernel_size(bottleneck_kernel_size, "bottleneck_kernel_size")
        check_criss_cross_heads(num_heads, reduction, inter, "inter_channels")
        CRISS_CROSS_BACKENDS.check(impl)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.inter_channels = inter
        self.recurrence = recurrence
        self.conva = _conv_norm_relu(in_channels, inter, norm)
        self.cca = CrissCrossAttention2d(inter, num_heads=num_heads, reduction=reduction, impl=impl)
        self.convb = _conv_norm_relu(inter, inter, norm)
        self.bottleneck = _conv_norm_relu(in_channels + inter, out_channels, norm, relu=bottleneck_relu,
                                          kernel_size=bottleneck_kernel_size)

    def recurrent_attention(self, y: torch.Tensor) -> torch.Tensor:
        """The shared block ``cca`` applied ``recurrence`` times: ``[B, inter, H, W]`` ->
        ``[B, inter, H, W]``."""
        for _ in range(self.recurrence):
            y = self.cca(y)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, in_channels, H, W]`` -> ``[B, out_channels, H, W]``."""
        _check_input(self, x)
        y = self.conva(x)  # [B, inter, H, W]
        y = self.recurrent_attention(y)  # [B, inter, H, W]
        y = self.convb(y)  # [B, inter, H, W]
        return self.bottleneck(torch.cat([x, y], dim=1))  # [B, out, H, W]

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, inter_channels={self.inter_channels}, "
            f"recurrence={self.recurrence}, bottleneck_kernel_size={self.bottleneck.conv.kernel_size[0]}"
        )
