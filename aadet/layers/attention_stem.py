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
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .functional.backends import stem_cpp
from .functional.backends.stem_cpp import cpp_stem_attention, cpp_stem_attention_norm_relu_pool
from .functional.blocks import (
    add_block_relative_logits,
    block_attention_unchecked,
    block_attention_probs,
    block_padding_mask,
    block_softmax,
    blocks_to_map,
    map_to_blocks,
)
from .functional.checks import check_one_of, check_positive_int
from .functional.dispatch import is_exporting
from .local_attention_base import add_relative_embeddings, check_heads

__all__ = ["SpatiallyAwareAttentionStem", "POSITIONAL_ENCODINGS", "STEM_IMPLS", "STEM_ROUTES",
           "STEM_EXPORTABLE_IMPLS"]

#: The stem's ``positional_encoding`` values: relative logits inside the block, or none.
POSITIONAL_ENCODINGS = ("relative", "none")
#: The stem's ``impl`` values (``MODEL.SASA.STEM_IMPL``): ``"auto"``
#: (:meth:`SpatiallyAwareAttentionStem.route`), the two PyTorch routes, and ``"cpp"``, the fused
#: C++ kernel (CPU; :mod:`~aadet.layers.functional.backends.stem_cpp`).
#: All compute the same numbers (tested against a float64 brute force).
STEM_IMPLS = ("auto", "factorized", "projected", "cpp")
#: The routes themselves: what ``"auto"`` chooses from.
STEM_ROUTES = tuple(impl for impl in STEM_IMPLS if impl != "auto")
#: The ``impl`` values that trace into plain tensor ops (TorchScript/ONNX export): all but the kernel.
STEM_EXPORTABLE_IMPLS = tuple(impl for impl in STEM_IMPLS if impl != "cpp")

NormSpec = Union[str, None, nn.Module, Callable[[int], nn.Module]]


def _make_norm(norm: NormSpec, channels: int) -> Optional[nn.Module]:
    """``"BN"`` -> BatchNorm2d, another name -> Detectron2's ``get_norm(name, channels)`` ("GN",
    "SyncBN", ...: plain values, as a LazyConfig holds them), ``""``/None -> none, a module as is,
    a callable ``f(channels)``."""
    if norm is None or norm == "":
        return None
    if norm == "BN":
        return nn.BatchNorm2d(channels)
    if isinstance(norm, str):
        from detectron2.layers import get_norm  # only for Detectron2's names (as freeze())

        try:
            return get_norm(norm, channels)
        except KeyError:
            pass
    elif isinstance(norm, nn.Module):
        return norm
    elif callable(norm):
        return norm(channels)
    raise ValueError(
        "norm must be '', a name detectron2.layers.get_norm knows ('BN', 'GN', ...), an "
        f"nn.Module or a callable channels -> module; got {norm!r}"
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
        norm: ``"BN"`` (default), another name of Detectron2's ``get_norm`` (``"GN"``, ...),
            ``""``, a module, or a callable ``channels -> module``.
        impl: how the attention is computed, one of :data:`STEM_IMPLS` (see :meth:`forward`):
            ``"auto"`` (default: ``"factorized"`` where :attr:`factorized`, else
            ``"projected"``), ``"factorized"``, ``"projected"``, or ``"cpp"`` (the fused C++
            kernel, CPU tensors only; raises with the build error where it cannot be built).

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
                            ("block_size", block_size), ("num_mixtures", num_mixtures)):
            check_positive_int(value, name)
        dkh = check_heads(num_heads, out_channels, positional_encoding, POSITIONAL_ENCODINGS)
        check_one_of(impl, STEM_IMPLS, "impl")
        d_emb = out_channels if embedding_dim is None else embedding_dim
        check_positive_int(d_emb, "embedding_dim")

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.stride = block_size
        self.block_size = block_size
        self.num_heads = num_heads
        self.num_mixtures = num_mixtures
        self.positional_encoding = positional_encoding
        self.head_channels = dkh
        self.impl = impl

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
        add_relative_embeddings(self, 2 * block_size - 1, dkh, positional_encoding)
        self.norm = _make_norm(norm, out_channels)

    def mixture_weights(self) -> torch.Tensor:
        """``p(a, b, m)``: ``[block, block, m]``, a softmax over ``m`` (sums to 1 per position)."""
        emb = self.emb_row[:, None, :] + self.emb_col[None, :, :]  # [b, b, d_emb]
        return torch.softmax(emb @ self.nu.t(), dim=-1)  # [b, b, m]

    @property
    def factorized(self) -> bool:
        """Whether ``impl="auto"`` factorizes the attention through the input (``Nh * b^2 * in
        <= 3 * out``, e.g. RGB with one head) rather than projecting q, k, v per pixel."""
        return self.num_heads * self.block_size ** 2 * self.in_channels <= 3 * self.out_channels

    @property
    def cpp_factorized(self) -> bool:
        """Whether the ``"cpp"`` route gives its kernel the factorized weight form (``in <= d``,
        e.g. RGB: the per-pixel work grows with the feature width, ``in`` factorized, ``d``
        projected; :meth:`_cpp_weights`)."""
        return self.in_channels <= self.head_channels

    def route(self, device: Union[str, torch.device] = "cpu") -> str:
        """The route :meth:`forward` takes for an input on ``device``: ``impl``, or for
        ``"auto"``: the C++ kernel ``"cpp"`` on CPU where it builds (faster than the factorized
        route there; BENCHMARKS.md has the times), else (CUDA, tracing or
        export, no kernel) ``"factorized"`` where :attr:`factorized`, ``"projected"`` otherwise."""
        if self.impl != "auto":
            return self.impl
        if torch.device(device).type == "cpu" and not is_exporting() and stem_cpp.KERNEL.available():
            return "cpp"
        return "factorized" if self.factorized else "projected"

    def _values(self, x: torch.Tensor) -> torch.Tensor:
        """Spatially-aware values ``[B, out, H, W]``: ``v_ab = (sum_m p(a,b,m) W_V^m) x_ab``.

        Map layout (for inspection and tests; :meth:`forward` computes them in block layout)."""
        bsz, c, h, w = x.shape
        s = self.block_size
        hp, wp = -(-h // s) * s, -(-w // s) * s
        w_eff = torch.einsum("abm,moc->aboc", self.mixture_weights(), self.value_weight)  # [b, b, out, in]
        xp = F.pad(x, (0, wp - w, 0, hp - h)).view(bsz, c, hp // s, s, wp // s, s)  # [B, in, nby, a, nbx, b]
        v = torch.einsum("ncyaxb,aboc->noyaxb", xp, w_eff.to(x.dtype))  # [B, out, nby, a, nbx, b]
        return v.reshape(bsz, self.out_channels, hp, wp)[:, :, :h, :w]

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"SpatiallyAwareAttentionStem expects [B, {self.in_channels}, H, W]; got {tuple(x.shape)}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, in, H, W]`` -> ``[B, out, ceil(H / b), ceil(W / b)]``.

        The attention runs by one of three routes (:meth:`route`, chosen by ``impl``) with the
        same numbers (each tested against a float64 brute force). The two PyTorch routes work in
        block layout ``[B * blocks, b*b, channels]`` (only the ``in``-channel input is rearranged
        into blocks; the output is written back once):

        * factorized through the input (:attr:`factorized`: ``Nh * b^2 * in <= 3 * out``, e.g.
          RGB, 1 head):
          ``q_i . k_j = x_i^T (W_Q^T W_K) x_j``, ``q_i . rel[t] = x_i^T (W_Q^T rel[t])`` and the
          output ``sum_j p_ij W_V(j) x_j`` is one matmul of the weighted inputs ``p_ij x_j``
          ``[b^2, b^2 * in]`` with the stacked per-position value matrices -- the full-resolution
          ``out``-channel q, k and v are never written;
        * projected: q, k and the spatially-aware v computed per pixel, then
          :func:`~aadet.layers.functional.block_attention`.

        The ``"cpp"`` route (:meth:`_attend_cpp`) is one fused C++ kernel that reads the map and
        writes ``[B, out, H, W]`` directly, block by block in cache (no block-layout copies);
        where the norm is a :class:`torch.nn.GroupNorm` (Detectron2's ``"GN"``) or none
        (:attr:`fuses_norm`), the kernel also pools for the norm, and the full-resolution map is
        never written
        (:func:`~aadet.layers.functional.backends.stem_cpp.cpp_stem_attention_norm_relu_pool`).
        """
        self._check_input(x)
        bsz, cin, h, w = x.shape
        s = self.block_size
        ct = torch.promote_types(x.dtype, torch.float32)
        route = self.route(x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if route == "cpp" and self.fuses_norm:
                return self._attend_cpp(x.to(ct), pooled=True).to(x.dtype)  # [B, out, H / b, W / b]
            if route == "cpp":
                out = self._attend_cpp(x.to(ct)).to(x.dtype)  # [B, out, H, W]
            else:
                xb = map_to_blocks(x.to(ct), s)  # [N, P, in], N = B * blocks
                mask = block_padding_mask((h, w), s, x.device)
                if mask is not None:
                    mask = mask.repeat(bsz, 1, 1, 1)
                if route == "factorized":
                    out = self._attend_factorized(xb, mask)
                else:
                    out = self._attend_projected(xb, mask)  # [N, P, out]
                out = blocks_to_map(out, bsz, (h, w), s).to(x.dtype)  # [B, out, H, W]
        return self._norm_relu_pool(out)

    def _norm_relu_pool(self, out: torch.Tensor) -> torch.Tensor:
        """The stem's tail, ``[B, out, H, W]`` -> ``[B, out, ceil(H / b), ceil(W / b)]``: the norm,
        ``b x b`` max pooling with stride ``b``, ReLU (what the fused C++ route computes inside
        its kernel)."""
        if self.norm is not None:
            out = self.norm(out)
        s = self.block_size
        # ceil_mode: the last window may be cut by the border and pools only in-map pixels.
        # ReLU after the pooling: max commutes with it (values, and the gradient, which reaches
        # the window's maximum only where it is positive), and it then runs on a 16x smaller map.
        return F.relu(F.max_pool2d(out, kernel_size=s, stride=s, ceil_mode=True))

    def _head_weights(self, dtype):
        """Scaled ``W_Q``, ``W_K`` ``[Nh, d, in]`` and the per-position value matrices
        ``W_V(a, b) = sum_m p(a, b, m) W_V^m`` as ``[b*b, out, in]``."""
        nh, d, cin = self.num_heads, self.head_channels, self.in_channels
        wq = self.query.weight.to(dtype).view(nh, d, cin) * d ** -0.5
        wk = self.key.weight.to(dtype).view(nh, d, cin)
        w_v = torch.einsum("abm,moc->aboc", self.mixture_weights().to(dtype), self.value_weight.to(dtype))
        return wq, wk, w_v.reshape(self.block_size ** 2, self.out_channels, cin)

    def _block_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[N, P, Nh * d]`` -> ``[N, Nh, P, d]``."""
        n, p, _ = t.shape
        return t.view(n, p, self.num_heads, self.head_channels).transpose(1, 2)

    def _project_qk(self, xb: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor):
        """``xb [N, P, in]`` -> scaled queries and keys ``[N, Nh, P, d]``."""
        cin = xb.shape[-1]
        q = torch.matmul(xb, wq.reshape(-1, cin).t())  # [N, P, out]
        k = torch.matmul(xb, wk.reshape(-1, cin).t())
        return self._block_heads(q), self._block_heads(k)

    def _attend_projected(self, xb: torch.Tensor, mask) -> torch.Tensor:
        """``xb [N, P, in]`` -> ``[N, P, out]``: q, k, v per pixel, then block attention."""
        n, p, _ = xb.shape
        wq, wk, w_v = self._head_weights(xb.dtype)
        q, k = self._project_qk(xb, wq, wk)
        v = self._block_heads(torch.einsum("npi,poi->npo", xb, w_v))  # v_j = W_V(j) x_j
        # q, k, v are made above from the layer's checked weights: no argument to check again.
        out = block_attention_unchecked(q, k, v, self.rel_h, self.rel_w, self.block_size, mask)
        return out.transpose(1, 2).reshape(n, p, self.out_channels)

    def attention_probs(self, x: torch.Tensor, blocks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention probabilities of :meth:`forward` (for analysis; both of its routes compute
        the same numbers), under ``torch.no_grad()`` or not as the caller chooses.

        Args:
            x: ``[B, in, H, W]`` stem input.
            blocks: optional 1-D index of the blocks to compute, into the ``B * nby * nbx``
                blocks of :func:`~aadet.layers.functional.map_to_blocks`'s layout (image, block
                row, block column); None = all.

        Returns:
            ``[N, Nh, b*b, b*b]`` (``N`` = ``len(blocks)`` or ``B * nby * nbx``), float32 (float64
            for float64 input): ``p[n, :, i, j]`` is the weight of pixel ``j`` of block ``n`` for
            its pixel ``i`` (row-major in the block). Keys outside the map (blocks cut by its
            border) have weight exactly 0; rows of such pixels as queries are not used by
            :meth:`forward`.
        """
        self._check_input(x)
        bsz, _, h, w = x.shape
        s = self.block_size
        ct = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xb = map_to_blocks(x.to(ct), s)  # [N, P, in]
            mask = block_padding_mask((h, w), s, x.device)
            if mask is not None:
                mask = mask.repeat(bsz, 1, 1, 1)
            if blocks is not None:
                xb = xb[blocks]
                mask = None if mask is None else mask[blocks]
            wq, wk, _ = self._head_weights(ct)
            q, k = self._project_qk(xb, wq, wk)
            return block_attention_probs(q, k, self.rel_h, self.rel_w, s, mask)

    def _attend_factorized(self, xb: torch.Tensor, mask) -> torch.Tensor:
        """``xb [N, P, in]`` -> ``[N, P, out]``, factorized through the input (see :meth:`forward`).

        Every product with a weight is one matrix product over all ``N * P`` pixels (the heads
        stacked along its columns, or a batch of ``Nh``), never a batch of ``N`` products with
        a broadcast weight: those copy the weight per block and, in backward, write a weight
        gradient per block before summing them."""
        n, p, cin = xb.shape
        nh, d = self.num_heads, self.head_channels
        wq, wk, w_v = self._head_weights(xb.dtype)
        x2 = xb.reshape(n * p, cin)  # [N*P, in]

        def per_head(w):  # [Nh, in, t] -> x_i^T w per pixel and head, [N, Nh, P, t]
            t = w.shape[-1]
            return torch.mm(x2, w.permute(1, 0, 2).reshape(cin, nh * t)).view(n, p, nh, t).transpose(1, 2)

        qk = torch.matmul(wq.transpose(1, 2), wk)  # [Nh, in, in]: W_Q^T W_K per head
        logits = torch.matmul(per_head(qk), xb.transpose(1, 2)[:, None])  # [N, Nh, P, P]
        if self.rel_h is not None:
            dr = d // 2
            row_w = torch.matmul(wq[:, :dr].transpose(1, 2), self.rel_h.to(xb.dtype).t())  # [Nh, in, 2b-1]
            col_w = torch.matmul(wq[:, dr:].transpose(1, 2), self.rel_w.to(xb.dtype).t())
            logits = add_block_relative_logits(logits, per_head(row_w), per_head(col_w), self.block_size)
        probs = block_softmax(logits, mask)  # [N, Nh, P, P]
        w_v = w_v.view(p, nh, d, cin).permute(1, 0, 3, 2).reshape(nh, p * cin, d)  # [Nh, P * in, d]
        weighted = probs[..., None] * xb[:, None, None]  # [N, Nh, P, P, in]: p_ij x_j
        weighted = weighted.transpose(0, 1).reshape(nh, n * p, p * cin)  # a view for one head
        out = torch.bmm(weighted, w_v)  # [Nh, N*P, d]
        return out.view(nh, n, p, d).permute(1, 2, 0, 3).reshape(n, p, self.out_channels)

    def _cpp_weights(self, dtype, factorized: bool):
        """The C++ kernel's weights (:func:`~aadet.layers.functional.backends.stem_cpp.cpp_stem_attention`)
        from the parameters, by differentiable weight algebra (autograd takes the kernel's
        gradients back to ``query``, ``key``, ``value_weight``, ``emb_row``, ``emb_col``, ``nu``,
        ``rel_h`` and ``rel_w``).

        Returns ``wq, wk [Nh, e, in]``, ``tr [Nh, 2b-1, er]``, ``tc [Nh, 2b-1, ec]`` (None
        without relative logits) and ``wv [b*b, in, out]``:

        * ``factorized``: ``wq = I``, ``wk = W_Q^T W_K`` per head, ``tr = rel_h W_Q[:d/2]``,
          ``tc = rel_w W_Q[d/2:]`` (``e = er = ec = in``);
        * projected: ``wq = W_Q`` (scaled), ``wk = W_K``, ``tr = rel_h``, ``tc = rel_w`` (the same
          for every head; ``e = d``, ``er = d/2``, ``ec = d - d/2``).
        """
        nh, cin = self.num_heads, self.in_channels
        wq, wk, w_v = self._head_weights(dtype)  # [Nh, d, in], [Nh, d, in], [P, out, in]
        tr = tc = None
        if factorized:
            if self.rel_h is not None:
                dr = self.head_channels // 2
                tr = torch.matmul(self.rel_h.to(dtype), wq[:, :dr])  # [Nh, 2b-1, in]
                tc = torch.matmul(self.rel_w.to(dtype), wq[:, dr:])
            wk = torch.matmul(wq.transpose(1, 2), wk)  # [Nh, in, in]: W_Q^T W_K
            wq = torch.eye(cin, dtype=dtype, device=wk.device).expand(nh, cin, cin)
        elif self.rel_h is not None:
            r = 2 * self.block_size - 1
            tr = self.rel_h.to(dtype).expand(nh, r, self.rel_h.shape[1])
            tc = self.rel_w.to(dtype).expand(nh, r, self.rel_w.shape[1])
        return wq, wk, tr, tc, w_v.transpose(1, 2)

    def _attend_cpp(self, x: torch.Tensor, factorized: Optional[bool] = None, pooled: bool = False) -> torch.Tensor:
        """``x [B, in, H, W]`` (float32/64, CPU) -> the attention ``[B, out, H, W]`` in the fused C++
        kernel (:mod:`~aadet.layers.functional.backends.stem_cpp`; built on first use), or with
        ``pooled`` (the norm a GroupNorm or none) the stem's output after its norm, pooling and
        ReLU, ``[B, out, ceil(H / b), ceil(W / b)]``, without the full-resolution map.

        ``factorized`` (None: :attr:`cpp_factorized`) picks the weights of :meth:`_cpp_weights`;
        both forms give the same numbers.
        """
        if is_exporting():
            raise ValueError("impl='cpp' (a C++ kernel) does not trace or export; use impl='auto'")
        if factorized is None:
            factorized = self.cpp_factorized
        wq, wk, tr, tc, wv = self._cpp_weights(x.dtype, factorized)
        if pooled:
            return cpp_stem_attention_norm_relu_pool(x, wq, wk, tr, tc, wv, self.block_size, self.norm)
        return cpp_stem_attention(x, wq, wk, tr, tc, wv, self.block_size)

    @property
    def fuses_norm(self) -> bool:
        """Whether the C++ route fuses the norm, pooling and ReLU into its kernel (the norm a
        :class:`torch.nn.GroupNorm`, Detectron2's ``"GN"``, or none)."""
        return self.norm is None or type(self.norm) is nn.GroupNorm

    #: The :meth:`flop_count` components that are the attention itself: all of them (the stem
    #: applies its ``query``/``key`` weights directly, not as child convolutions), i.e. what
    #: ``aadet.analysis`` counts by formula.
    ATTENTION_FLOP_COMPONENTS = (
        "projections", "value_mixing", "content_logits", "relative_logits", "weighted_sum"
    )

    def flop_count(self, input_hw: Tuple[int, int], batch: int = 1) -> Dict[str, int]:
        """Multiply-adds of one call on a ``[batch, in, H, W]`` input (fvcore convention, 1 MAC
        = 1 flop).

        With ``n = H * W`` pixels, ``C_in``, ``C = out_channels``, block ``b``, ``m`` mixtures,
        per image: ``projections = 3 n C_in C`` (q, k and the mixed value matrix, applied once
        per pixel), ``content_logits = weighted_sum = n b^2 C``, ``relative_logits = n b C``
        (each query needs ``b`` row and ``b`` column offsets of ``dkh / 2``, as the SASA layer
        counts ``k``; 0 for ``"none"``); once per call, not per image: ``value_mixing = b^2 m C
        C_in`` (the ``b^2`` mixed matrices). Norm, ReLU and pooling are not counted. Idealised:
        every block is full.
        """
        h, w = input_hw
        n, b, c = h * w, self.block_size, self.out_channels
        out = {
            "projections": batch * 3 * n * self.in_channels * c,
            "value_mixing": b * b * self.num_mixtures * c * self.in_channels,
            "content_logits": batch * n * b * b * c,
            "relative_logits": batch * n * b * c if self.rel_h is not None else 0,
            "weighted_sum": batch * n * b * b * c,
        }
        out["total"] = sum(out.values())
        return out

    def implementation_flop_count(
        self, input_hw: Tuple[int, int], batch: int = 1, route: Optional[str] = None
    ) -> int:
        """Multiply-adds of ``route`` (default: ``impl``, and for ``"auto"`` its CPU route
        ``"cpp"``, whether or not the kernel builds here: counting never builds it), an estimate
        to compare with :meth:`flop_count`: blocks padded to whole ``b x b`` blocks, and the extra work of the
        route -- factorized (:attr:`factorized`): ``W_Q^T W_K`` (``C C_in^2``), logits as
        ``b^2 C_in``-wide products per head, the ``2b - 1`` offset tables through the input and
        the ``b^2 C_in``-wide output matmul; projected: q, k, v per padded pixel, logits and
        weighted sum over ``C``, the ``2b - 1`` offset tables; ``"cpp"``: the kernel's blocks are
        clipped to the map (``H W`` queries, counted with ``b^2`` keys each), per pixel its value
        ``W_V x`` and per head the two features of width ``e`` (``C_in`` in the factorized form,
        :attr:`cpp_factorized`, with ``W_Q^T W_K`` and the tables through the input once per
        call; else ``d``), the logits, the tables and the weighted sum over ``d``.
        """
        h, w = input_hw
        s, c, nh, cin = self.block_size, self.out_channels, self.num_heads, self.in_channels
        pix = batch * -(-h // s) * s * -(-w // s) * s  # padded to whole blocks
        rel = self.rel_h is not None
        implemented = s * s * self.num_mixtures * c * cin  # the mixed value matrices
        route = route or (self.impl if self.impl != "auto" else "cpp")
        check_one_of(route, STEM_ROUTES, "route")
        if route == "cpp":
            d, fact = self.head_channels, self.cpp_factorized
            e = cin if fact else d
            tables = (2 * s - 1) * (2 * cin if fact else d) if rel else 0
            if fact:  # W_Q^T W_K and the tables through the input, once per call
                implemented += cin * cin * c + ((2 * s - 1) * cin * c if rel else 0)
            n = batch * h * w
            return implemented + n * cin * c + n * nh * (2 * e * cin + s * s * e + tables + s * s * d)
        if route == "factorized":
            implemented += cin * cin * c  # W_Q^T W_K: Nh heads of [in, d] x [d, in]
            implemented += pix * nh * (2 * s * s * cin + (2 * (2 * s - 1) * cin if rel else 0))
            implemented += pix * s * s * cin * c  # [P, P * in] x [P * in, d] per head
        else:  # projected
            implemented += 3 * pix * cin * c
            implemented += pix * s * s * 2 * c + (pix * (2 * s - 1) * c if rel else 0)
        return implemented

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
            f"positional_encoding={self.positional_encoding!r}, impl={self.impl!r}"
        )
