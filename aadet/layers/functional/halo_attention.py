"""Blocked local 2D self-attention with relative positions: the attention of HaloNet (public API).

Paper: Vaswani, Ramachandran, Srinivas, Parmar, Hechtman, Shlens, "Scaling Local Self-Attention
for Parameter Efficient Visual Backbones", CVPR 2021, Sec. 2.2 and Figure 1. The map is cut into
non-overlapping ``b x b`` query blocks; every query of a block attends to one shared window, the
block plus a halo of ``h`` pixels. For one head, a query at ``(y, x)`` in block ``(Y, X) = (y // b,
x // b)``::

    out[y, x] = sum_{(a, c) in N(Y, X)} softmax( q[y, x] . k[a, c]
                                               + q[y, x, :d//2] . rel_h[a - y + b + h - 1]
                                               + q[y, x, d//2:] . rel_w[c - x + b + h - 1] ) v[a, c]

    N(Y, X) = {(a, c) inside the map : Y b - h <= a < Y b + b + h,  X b - h <= c < X b + b + h}

Any ``H, W`` works: the last blocks may be partial, and keys outside the map are *left out of the
softmax* (not zero-padded keys, as in the paper's and timm's implementations). The relative
embeddings have ``2(b + h) - 1`` rows (every key-minus-query offset within a window), split over
the query's channels as SASA's. No scaling happens here: the caller scales ``q``. With ``b = 1``
and ``h = r`` this is SASA's ``local_self_attention_2d`` with ``kernel_size = 2r + 1`` exactly.

Attention downsampling (HaloNet's strided layers, ``query_stride = s``): the queries lie on the
strided grid, ``q [B, Nh, ceil(H/s), ceil(W/s), d]`` (what a 1x1 projection of stride ``s``
gives); query ``(y', x')`` sits at input pixel ``(y, x) = (s y', s x')`` and attends, as above, to
the window of the block holding that pixel, keys and values at full resolution; ``s`` divides
``b``, so each block holds ``b / s`` queries a side. Offsets are measured from that pixel: rows
``0 .. s - 2`` of the embeddings are then never used (their gradient is 0).

:func:`halo_attention_2d` checks its arguments once (:mod:`.checks`) and dispatches on ``impl``
through :data:`HALO_ATTENTION_BACKENDS`, one implementation per file under ``backends/`` (the
PyTorch ones on the block layout of :mod:`.backends.halonet_blocks`), all exact (tested against
:func:`~aadet.layers.functional.reference.halo_attention_2d_reference`); ``"auto"`` is
:func:`auto_halo_attention_impl`. A layer that checked its constant arguments when it was built
calls :func:`halo_attention_2d_unchecked` in its forward.

:func:`halo_attention_probs_2d` returns the attention probabilities over each block's window (an
analysis/test helper).
"""
from typing import Optional

import torch

from .backends import halonet_cpp
from .backends.halonet_blocks import halo_geometry, pad_window
from .backends.halonet_bmm import bmm_halo_attention
from .backends.halonet_cpp import cpp_halo_attention
from .backends.halonet_materialized import halo_probs, materialized_halo_attention
from .backends.halonet_sdpa import sdpa_halo_attention
from .checks import check_halo_attention
from .dispatch import AUTO, Route, RouteRegistry, is_exporting, lazy_backend
from .route_table import CUDA_DEFAULT_ROUTES, measured_route

__all__ = [
    "HALO_ATTENTION_BACKENDS",
    "auto_halo_attention_impl",
    "halo_attention_2d",
    "halo_attention_2d_unchecked",
    "halo_attention_probs_2d",
]

#: ``impl`` name -> :class:`~.dispatch.Route` whose ``fn(q, k, v, rel_h, rel_w, block_size,
#: halo_size, query_stride) -> out`` runs on checked arguments (shapes as in
#: :func:`halo_attention_2d`; ``q`` already scaled; ``rel_h``/``rel_w`` both tensors or both
#: None): the one list of HaloNet's routes (``impl`` of the layer, ``MODEL.HALO.IMPL``, the export
#: check). Adding a route is one file and one entry here.
HALO_ATTENTION_BACKENDS = RouteRegistry("HaloNet blocked attention", {
    "cpp": Route(
        cpp_halo_attention,
        "a C++ kernel, block by block in cache with BLAS gemms, the logits recomputed in backward "
        "from a saved log-sum-exp (keeps only ``q, k, v``, the output and one value per query); "
        "CPU tensors, compiled on first use (:mod:`.backends.halonet_cpp`)",
        cuda=False,
    ),
    "bmm": Route(
        bmm_halo_attention,
        "batched matmuls over all blocks with a hand-written backward on channels-first maps "
        "(stores the ``(b + 2h)^2`` probabilities of every query); pure PyTorch "
        "(:mod:`.backends.halonet_bmm`)",
    ),
    "materialized": Route(
        materialized_halo_attention,
        "per block, batched matmuls and an explicit float32 softmax left to autograd; plain "
        "tensor ops, so it exports (:mod:`.backends.halonet_materialized`)",
        exports=True,
    ),
    "fused": Route(
        sdpa_halo_attention,
        "one fused SDPA over all blocks, the position tables and the border mask as its additive "
        "float bias (:mod:`.backends.halonet_sdpa`)",
    ),
    "triton": Route(
        lazy_backend("backends.halonet_triton", "triton_halo_attention"),
        "AA's Triton flash-attention kernel over every block's window, the position tables and the "
        "border mask added to the logit tiles in the kernel (no bias, no softmax stored); CUDA, or "
        "CPU under Triton's interpreter (:mod:`.backends.halonet_triton`)",
        requires=("triton",),
    ),
})
__doc__ = HALO_ATTENTION_BACKENDS.document(__doc__, "HALO_ATTENTION_BACKENDS")


def auto_halo_attention_impl(q: torch.Tensor) -> str:
    """What ``impl="auto"`` runs for queries ``q``: ``"materialized"`` while tracing/exporting
    (plain tensor ops only); on CUDA the route measured fastest for the GPU, precision and map
    size (:func:`~.route_table.measured_route`), else ``"fused"`` (the one route that runs every
    block in one fused kernel); on CPU the C++ kernel
    ``"cpp"`` where it builds (the fastest CPU route, and the one that keeps the least for
    backward), else ``"bmm"`` (with one warning saying why)."""
    if is_exporting():
        return "materialized"
    measured = measured_route("halonet", HALO_ATTENTION_BACKENDS, q, q.shape[2] * q.shape[3])
    if measured is not None:
        return measured
    if q.device.type == "cuda":
        return CUDA_DEFAULT_ROUTES["halonet"]
    if q.device.type == "cpu" and halonet_cpp.KERNEL.available():
        return "cpp"
    return "bmm"


def halo_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    block_size: int,
    halo_size: int,
    *,
    query_stride: int = 1,
    impl: str = AUTO,
) -> torch.Tensor:
    """HaloNet's blocked local self-attention, keys outside the map left out (module docstring).

    Args:
        q: ``[B, Nh, H, W, d]`` queries (already scaled); ``[B, Nh, ceil(H/s), ceil(W/s), d]``
            for ``query_stride = s``.
        k: ``[B, Nh, H, W, d]`` keys.
        v: ``[B, Nh, H, W, dv]`` values.
        rel_h: ``[2(b + h) - 1, d//2]`` embeddings of the row offset ``a - y`` (index ``a - y + b
            + h - 1``), or None together with ``rel_w`` (content only).
        rel_w: ``[2(b + h) - 1, d - d//2]`` embeddings of the column offset ``c - x``.
        block_size: the query block side ``b >= 1``.
        halo_size: the halo ``h >= 0`` around each block.
        query_stride: ``s``, a divisor of ``b``: queries on the strided grid (HaloNet's attention
            downsampling), keys and values at full resolution; 1 (default) for none.
        impl: ``"auto"`` (:func:`auto_halo_attention_impl`) or a route of
            :data:`HALO_ATTENTION_BACKENDS` (the module docstring lists them).

    Returns:
        ``[B, Nh, ceil(H/s), ceil(W/s), dv]``.
    """
    check_halo_attention(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride)
    HALO_ATTENTION_BACKENDS.check(impl)
    return halo_attention_2d_unchecked(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride, impl)


def halo_attention_2d_unchecked(
    q, k, v, rel_h, rel_w, block_size: int, halo_size: int, query_stride: int, impl: str
) -> torch.Tensor:
    """:func:`halo_attention_2d` on arguments its caller has checked: what a layer calls in its
    forward, having checked ``block_size``, ``halo_size``, ``query_stride`` and ``impl`` when it
    was built and made ``q, k, v`` and the embeddings itself."""
    if impl == AUTO:
        impl = auto_halo_attention_impl(q)
    return HALO_ATTENTION_BACKENDS[impl].fn(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride)


def halo_attention_probs_2d(
    q, k, rel_h, rel_w, block_size: int, halo_size: int, *, query_stride: int = 1
) -> torch.Tensor:
    """Attention probabilities of :func:`halo_attention_2d` (its arguments but ``v``) over each
    block's window.

    Stores ``(b + 2h)^2`` probabilities per query (an analysis/test helper; computed in float32,
    or float64 for float64 inputs, with keys outside the map at exactly 0).

    Returns:
        ``[B, Nh, Ho, Wo, b + 2h, b + 2h]``: ``p[..., y', x', u, u']`` is the weight of key
        ``(Y b - h + u, X b - h + u')``, ``(Y, X)`` the block of query ``(y', x')``'s pixel
        ``(s y', s x')``.
    """
    check_halo_attention(q, k, k, rel_h, rel_w, block_size, halo_size, query_stride)
    geo = halo_geometry(q.shape, k.shape, block_size, halo_size, query_stride)
    with torch.autocast(device_type=q.device.type, enabled=False):
        probs = halo_probs(q, k, rel_h, rel_w, geo)
    # [N, nblk, Pq, Uh, Uw] -> the query map, like the output of halo_attention_2d
    (nby, nbx), (bqh, bqw), (ho, wo), (uh, uw) = geo.grid, geo.query_tile, geo.out_hw, geo.window
    n = probs.shape[0]
    probs = probs.view(n, nby, nbx, bqh, bqw, uh, uw).permute(0, 1, 3, 2, 4, 5, 6)
    probs = probs.reshape(n, nby * bqh, nbx * bqw, uh, uw)[:, :ho, :wo]
    probs = probs.reshape(geo.batch, geo.heads, ho, wo, uh, uw)
    return pad_window(probs, geo)
