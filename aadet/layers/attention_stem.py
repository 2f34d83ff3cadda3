"""The spatially-aware attention stem of SASA: attention in 4x4 blocks, then 4x4 max pooling.

Paper: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019,
Section 3.2 and 4.1. RGB pixels are individually uninformative, so plain content attention makes
a poor stem (Table 7). The stem injects distance-based information into the *values*: each of
``m`` value matrices ``W_V^m`` is a 1x1 projection, and the value of the pixel at position
``(a, b)`` of its block is their convex mixture::

    v_ab = sum_m p(a, b, m) W_V^m x_ab,      p(a, b, m) = softmax_m((emb_row(a) + emb_col(b)) . nu_m)

with learned row/column embeddings ``emb_row, emb_col [block, d_emb]`` and mixture vectors
``nu [m, d_emb]`` (the paper's appendix form). Queries and keys are 1x1 projections; every pixel
attends to the pixels of its own non-overlapping ``block x block`` block with SASA's relative
logits (offsets ``-(block-1) .. block-1``), then norm + ReLU and a ``block x block`` max pooling
with stride ``block`` (the pooling window is the attention block: "the attention receptive
field aligns with the max pooling window"). With ``block = 4`` the output is
``[B, C, ceil(H/4), ceil(W/4)]``, exactly the size Detectron2's ``BasicStem`` (7x7/2 conv, 3x3/2
max pool) gives; blocks and pooling windows cut by the border use only in-map pixels.

The module follows the conventions of a Detectron2 stem (``in_channels``, ``out_channels``,
``stride`` attributes and ``freeze()``), so ``detectron2.modeling.backbone.ResNet`` takes it as
its ``stem``; it imports only torch (``freeze`` uses Detectron2's ``FrozenBatchNorm2d`` when
Detectron2 is installed).
"""
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .functional.local_attention import block_self_attention_2d
from .local_attention import merge_heads, split_heads

__all__ = ["SpatiallyAwareAttentionStem"]

NormSpec = Union[str, None, nn.Module, Callable[[int], nn.Module]]


def _make_norm(norm: NormSpec, channels: int) -> Optional[nn.Module]:
    """``"BN"`` -> BatchNorm2d, ``""``/None -> none, a module as is, a callable ``f(channels)``."""
    if norm is None or norm == "":
        return None
    if norm == "BN":
        return nn.BatchNorm2d(channels)
    if isinstance(norm, nn.Module):
        return norm
    if callable(norm):
        return norm(channels)
    raise ValueError(
        "norm must be '', 'BN', an nn.Module or a callable channels -> module "
        f"(e.g. lambda c: detectron2.layers.get_norm('GN', c)); got {norm!r}"
    )


class SpatiallyAwareAttentionStem(nn.Module):
    """SASA's attention stem: ``[B, in, H, W]`` -> ``[B, out, ceil(H/b), ceil(W/b)]``.

    Args:
        in_channels: input channels (3 for RGB).
        out_channels: output channels (ResNet stem: 64).
        block_size: ``b``, side of the attention blocks and of the max pooling (paper: 4); the
            stem's stride is ``b``.
        num_heads: attention heads (must divide ``out_channels``).
        num_mixtures: ``m``, value matrices mixed per position (paper's ImageNet model: 4).
        embedding_dim: ``d_emb`` of the position embeddings and mixture vectors (default
            ``out_channels``; the paper does not state it).
        positional_encoding: ``"relative"`` (relative logits inside the block, as in the SASA
            layer) or ``"none"``; the spatially-aware values are there in both cases.
        norm: ``"BN"`` (default), ``""``, a module, or a callable ``channels -> module``.
        impl: see :func:`aadet.layers.functional.attention_with_logit_tables`.

    Parameters: ``query``/``key`` ``[out, in, 1, 1]`` and ``value_weight [m, out, in]`` ~
    ``N(0, in ** -0.5)``; ``rel_h [2b-1, dkh//2]``, ``rel_w [2b-1, dkh - dkh//2]`` ~
    ``N(0, dkh ** -0.5)``; ``emb_row``, ``emb_col`` ``[b, d_emb]`` ~ ``N(0, 1)``; ``nu [m, d_emb]``
    ~ ``N(0, d_emb ** -0.5)`` (mixture logits O(1): position-dependent from the start).
    """

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 64,
        *,
        block_size: int = 4,
        num_heads: int = 1,
        num_mixtures: int = 4,
        embedding_dim: Optional[int] = None,
        positional_encoding: str = "relative",
        norm: NormSpec = "BN",
        impl: str = "auto",
    ):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels),
                            ("block_size", block_size), ("num_heads", num_heads),
                            ("num_mixtures", num_mixtures)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if out_channels % num_heads != 0:
            raise ValueError(
                f"num_heads must divide out_channels; got num_heads={num_heads}, "
                f"out_channels={out_channels}"
            )
        if positional_encoding not in ("relative", "none"):
            raise ValueError(
                f"positional_encoding must be 'relative' or 'none'; got {positional_encoding!r}"
            )
        dkh = out_channels // num_heads
        if positional_encoding == "relative" and dkh < 2:
            raise ValueError(
                "positional_encoding='relative' needs at least 2 channels per head; got "
                f"out_channels={out_channels}, num_heads={num_heads}"
            )
        d_emb = out_channels if embedding_dim is None else embedding_dim
        if not isinstance(d_emb, int) or d_emb < 1:
            raise ValueError(f"embedding_dim must be an integer >= 1; got {embedding_dim!r}")

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.stride = block_size
        self.block_size = block_size
        self.num_heads = num_heads
        self.num_mixtures = num_mixtures
        self.positional_encoding = positional_encoding
        self.impl = impl
        self.head_channels = dkh

        self.query = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.key = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        nn.init.normal_(self.query.weight, std=in_channels ** -0.5)
        nn.init.normal_(self.key.weight, std=in_channels ** -0.5)
        self.value_weight = nn.Parameter(
            torch.randn(num_mixtures, out_channels, in_channels) * in_channels ** -0.5
        )  # W_V^m: [m, out, in]
        self.emb_row = nn.Parameter(torch.randn(block_size, d_emb))  # [b, d_emb]
        self.emb_col = nn.Parameter(torch.randn(block_size, d_emb))  # [b, d_emb]
        self.nu = nn.Parameter(torch.randn(num_mixtures, d_emb) * d_emb ** -0.5)  # [m, d_emb]
        if positional_encoding == "relative":
            r = 2 * block_size - 1
            self.rel_h = nn.Parameter(torch.randn(r, dkh // 2) * dkh ** -0.5)
            self.rel_w = nn.Parameter(torch.randn(r, dkh - dkh // 2) * dkh ** -0.5)
        else:
            self.register_parameter("rel_h", None)
            self.register_parameter("rel_w", None)
        self.norm = _make_norm(norm, out_channels)

    def mixture_weights(self) -> torch.Tensor:
        """``p(a, b, m)``: ``[block, block, m]``, a softmax over ``m`` (sums to 1 per position)."""
        emb = self.emb_row[:, None, :] + self.emb_col[None, :, :]  # [b, b, d_emb]
        return torch.softmax(emb @ self.nu.t(), dim=-1)  # [b, b, m]

    def _values(self, x: torch.Tensor) -> torch.Tensor:
        """Spatially-aware values ``[B, out, H, W]``: ``v_ab = (sum_m p(a,b,m) W_V^m) x_ab``."""
        bsz, c, h, w = x.shape
        s = self.block_size
        hp, wp = -(-h // s) * s, -(-w // s) * s
        w_eff = torch.einsum("abm,moc->aboc", self.mixture_weights(), self.value_weight)  # [b, b, out, in]
        xp = F.pad(x, (0, wp - w, 0, hp - h)).view(bsz, c, hp // s, s, wp // s, s)  # [B, in, nby, a, nbx, b]
        v = torch.einsum("ncyaxb,aboc->noyaxb", xp, w_eff.to(x.dtype))  # [B, out, nby, a, nbx, b]
        return v.reshape(bsz, self.out_channels, hp, wp)[:, :, :h, :w]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, in, H, W]`` -> ``[B, out, ceil(H / b), ceil(W / b)]``."""
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"SpatiallyAwareAttentionStem expects [B, {self.in_channels}, H, W]; got {tuple(x.shape)}"
            )
        nh = self.num_heads
        q = split_heads(self.query(x), nh) * self.head_channels ** -0.5  # [B, Nh, H, W, dkh]
        k = split_heads(self.key(x), nh)  # [B, Nh, H, W, dkh]
        v = split_heads(self._values(x), nh)  # [B, Nh, H, W, dkh]
        out = block_self_attention_2d(
            q, k, v, self.rel_h, self.rel_w, self.block_size, impl=self.impl
        )  # [B, Nh, H, W, dkh]
        out = merge_heads(out)  # [B, out, H, W]
        if self.norm is not None:
            out = self.norm(out)
        out = F.relu(out)
        s = self.block_size
        # ceil_mode: the last window may be cut by the border and pools only in-map pixels.
        return F.max_pool2d(out, kernel_size=s, stride=s, ceil_mode=True)

    def flop_count(self, input_hw) -> dict:
        """Multiply-adds for one ``(H, W)`` image (fvcore convention, 1 MAC = 1 flop).

        With ``n = H * W`` pixels, ``C_in``, ``C = out_channels``, block ``b``, ``m`` mixtures:
        ``projections = 3 n C_in C`` (q, k and the mixed value matrix, applied once per pixel),
        ``value_mixing = b^2 m C C_in`` (the ``b^2`` mixed matrices), ``content_logits =
        weighted_sum = n b^2 C``, ``relative_logits = n (2b - 1) C`` (0 for ``"none"``);
        norm, ReLU and pooling are not counted. Idealised: every block is full.
        """
        h, w = input_hw
        n, b, c = h * w, self.block_size, self.out_channels
        out = {
            "projections": 3 * n * self.in_channels * c,
            "value_mixing": b * b * self.num_mixtures * c * self.in_channels,
            "content_logits": n * b * b * c,
            "relative_logits": n * (2 * b - 1) * c if self.rel_h is not None else 0,
            "weighted_sum": n * b * b * c,
        }
        out["total"] = sum(out.values())
        return out

    def freeze(self):
        """Make the stem untrainable (Detectron2 convention): no gradients, BN -> FrozenBN."""
        for p in self.parameters():
            p.requires_grad = False
        try:
            from detectron2.layers import FrozenBatchNorm2d
        except ImportError:  # plain torch: eval mode fixes the statistics (until .train())
            if self.norm is not None:
                self.norm.eval()
        else:
            FrozenBatchNorm2d.convert_frozen_batchnorm(self)
        return self

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, block_size={self.block_size}, "
            f"num_heads={self.num_heads}, num_mixtures={self.num_mixtures}, "
            f"positional_encoding={self.positional_encoding!r}"
        )
