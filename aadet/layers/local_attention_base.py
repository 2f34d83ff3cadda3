"""The set-up that SASA's and HaloNet's local self-attention layers share.

:class:`~aadet.layers.LocalSelfAttention2d` (SASA: a ``k x k`` window around every pixel) and
:class:`~aadet.layers.HaloSelfAttention2d` (HaloNet: a ``(b + 2h)^2`` window around every ``b x b``
block) differ in their windows and strides, not in what attends: 1x1 projections ``W_Q, W_K, W_V``
(no bias, ``out_channels`` each, ``N(0, in_channels ** -0.5)``: variance preserving), ``Nh`` heads
of ``dkh = out_channels / Nh`` channels, SASA's relative row and column embeddings ``rel_h
[rows, dkh//2]`` and ``rel_w [rows, dkh - dkh//2]`` (one row per key-minus-query offset, shared by
all heads, ``N(0, dkh ** -1)``: the initializer of the AA/SASA reference code, the relative logits
start below the content logits) and, like Detectron2's ``Conv2d``, an optional output ``bias``,
``norm`` and ``activation``. :class:`LocalAttention2dBase` builds them; each layer checks its own
arguments (:func:`check_heads` for the heads and the encoding), then calls
:meth:`~LocalAttention2dBase._init_attention` with its number of offsets and its query stride,
and ends its ``forward`` with :meth:`~LocalAttention2dBase._bias_norm_activation`.
"""
import inspect
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from .functional.checks import check_num_heads, check_one_of

__all__ = [
    "CONV_ARGUMENTS",
    "LocalAttention2dBase",
    "add_relative_embeddings",
    "attention_options",
    "check_heads",
    "min_head_channels",
]

#: The arguments of the layers that a stand-in for a convolution takes from that convolution
#: (:func:`~aadet.modeling.attention_layers.local_attention_for_conv`,
#: :func:`~aadet.modeling.attention_layers.halo_attention_for_conv`).
CONV_ARGUMENTS = ("in_channels", "out_channels", "stride", "bias", "norm", "activation")


def attention_options(layer_class: type) -> Tuple[str, ...]:
    """The arguments of ``layer_class`` that are not :data:`CONV_ARGUMENTS`: its attention
    options, which the models pass through unchanged from their config keys (whose defaults are
    read from the same signature)."""
    return tuple(name for name in inspect.signature(layer_class).parameters if name not in CONV_ARGUMENTS)


def min_head_channels(positional_encoding: str) -> int:
    """The fewest channels a head may have with ``positional_encoding``: 2 for ``"relative"``
    (the row and the column embedding take half each), else 1. The one rule for every layer with
    SASA's relative embeddings (SASA, HaloNet, the attention stem) and the models' config checks."""
    return 2 if positional_encoding == "relative" else 1


def check_heads(num_heads, out_channels: int, positional_encoding, positional_encodings: Sequence[str]) -> int:
    """``positional_encoding`` is one of ``positional_encodings`` and ``num_heads`` divides
    ``out_channels``, with at least 2 channels a head for ``"relative"`` (the row and the column
    embedding take half each). Returns ``dkh = out_channels // num_heads``."""
    check_one_of(positional_encoding, positional_encodings, "positional_encoding")
    return check_num_heads(
        num_heads,
        out_channels,
        min_per_head=min_head_channels(positional_encoding),
        per_head_reason=f"for positional_encoding='relative', out_channels={out_channels}",
    )


def add_relative_embeddings(module: nn.Module, rows: int, head_channels: int, positional_encoding: str) -> None:
    """SASA's relative row and column embeddings as ``module.rel_h [rows, dkh//2]`` and
    ``module.rel_w [rows, dkh - dkh//2]`` (``dkh = head_channels``), ``N(0, dkh ** -1)``, for
    ``"relative"``; for any other encoding both are registered as ``None``."""
    if positional_encoding == "relative":
        std = head_channels ** -0.5
        module.rel_h = nn.Parameter(torch.randn(rows, head_channels // 2) * std)
        module.rel_w = nn.Parameter(torch.randn(rows, head_channels - head_channels // 2) * std)
    else:
        module.register_parameter("rel_h", None)
        module.register_parameter("rel_w", None)


class LocalAttention2dBase(nn.Module):
    """The projections, heads, relative embeddings, output bias, norm and activation of a local
    self-attention layer (see the module docstring), its output size and its input check.

    A layer calls :meth:`_init_attention` once, after checking its arguments; its ``forward``
    stays its own.
    """

    def _init_attention(
        self,
        in_channels: int,
        out_channels: int,
        num_heads: int,
        stride: int,
        positional_encoding: str,
        *,
        relative_rows: int,
        query_stride: int,
        bias: bool,
        norm: Optional[nn.Module],
        activation: Optional[Callable[[torch.Tensor], torch.Tensor]],
    ) -> None:
        """Set the attributes and build the parameters shared by the layers (arguments checked).

        Args:
            in_channels, out_channels, num_heads, positional_encoding, bias, norm, activation:
                the layer's arguments of these names.
            stride: the layer's output stride (``output_size`` divides by it).
            relative_rows: rows of ``rel_h`` / ``rel_w`` (``"relative"`` only): the
                key-minus-query offsets of a window side.
            query_stride: stride of the query projection (1 where the layer pools afterwards).
        """
        dkh = out_channels // num_heads
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.num_heads = num_heads
        self.stride = stride
        self.positional_encoding = positional_encoding
        self.head_channels = dkh

        self.query = nn.Conv2d(in_channels, out_channels, 1, stride=query_stride, bias=False)
        self.key = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.value = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        for proj in (self.query, self.key, self.value):
            nn.init.normal_(proj.weight, std=in_channels ** -0.5)
        add_relative_embeddings(self, relative_rows, dkh, positional_encoding)
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.norm = norm
        self.activation = activation

    def _bias_norm_activation(self, out: torch.Tensor) -> torch.Tensor:
        """The end of ``forward``, as Detectron2's ``Conv2d``: ``out [B, out_channels, Ho, Wo]``
        ``+ bias`` (if any), then ``norm``, then ``activation`` (each where set)."""
        if self.bias is not None:
            out = out + self.bias.view(1, -1, 1, 1).to(out.dtype)
        if self.norm is not None:
            out = self.norm(out)
        if self.activation is not None:
            out = self.activation(out)
        return out

    def output_size(self, input_hw: Tuple[int, int]) -> Tuple[int, int]:
        """``(H, W)`` of the output for an ``(H, W)`` input: ``ceil`` of ``/ stride``."""
        h, w = input_hw
        return -(-h // self.stride), -(-w // self.stride)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__} expects [B, {self.in_channels}, H, W]; got {tuple(x.shape)}"
            )
