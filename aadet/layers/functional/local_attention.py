"""Local (windowed) 2D self-attention with relative positions: the layer of SASA (public API).

Paper: Ramachandran, Parmar, Vaswani, Bello, Levskaya, Shlens, "Stand-Alone Self-Attention in
Vision Models", NeurIPS 2019, Section 2.2, Equation 3. For an odd spatial extent
``k = 2r + 1`` the output of one head at pixel ``(y, x)`` of an ``[H, W]`` map is::

    out[y, x] = sum_{(y', x') in N(y, x)} softmax( q[y, x] . k[y', x']
                                                 + q[y, x, :dk//2] . rel_h[y' - y + r]
                                                 + q[y, x, dk//2:] . rel_w[x' - x + r] ) v[y', x']

    N(y, x) = {(y', x') inside the map : |y' - y| <= r, |x' - x| <= r}

Windows are centred on the pixel; neighbours outside the map are *excluded* from the softmax
(not zero-padded keys), so any ``H, W`` works, including maps smaller than the window. The row
and column offsets get embeddings of ``dk//2`` and ``dk - dk//2`` channels, dotted with the
matching halves of the query (the paper's concatenated ``r_{a-i, b-j}``). No scaling happens
here: the caller scales ``q``.

:func:`local_self_attention_2d` checks its arguments once (:mod:`.checks`) and dispatches on
``impl`` through :data:`LOCAL_ATTENTION_BACKENDS`, one implementation per file under
``backends/``, all exact (tested against
:func:`~aadet.layers.functional.reference.local_self_attention_2d_reference`); ``"auto"`` is
:func:`auto_local_attention_impl`. A layer that checked its constant arguments when it was built
calls :func:`local_self_attention_2d_unchecked` in its forward.

``recompute=True`` asks the route not to keep the attention weights (``k^2`` per pixel and
head) for backward but to recompute them there: less memory in training for more time. The C++
kernel ``"cpp"`` does it on request and Triton's kernels always do; ``"auto"`` passes the request
to the route it takes, and where that route cannot honour it (the neighborhood fallback without
the C++ kernel, the materialized route of an export, ``"fused"`` on CUDA) it runs as without it.
At narrow heads (``dk <= AUTO_RECOMPUTE_MAX_HEAD_CHANNELS``) ``"auto"`` takes the C++ kernel's
recompute mode whether asked or not: there the ``k^2`` attention weights per pixel and head
(written in forward, read twice in backward) cost more time than recomputing their ``dk``-channel
logits, so recomputing is both faster and smaller. ``impl="cpp"`` does what ``recompute`` says.
Naming a route without a recompute mode (``"neighborhood"``, ``"fused"``, ``"materialized"``)
together with ``recompute=True`` is an error (:func:`check_recompute`).

:func:`local_attention_probs_2d` returns the attention probabilities over each window (it does
store ``k^2`` values per pixel: an analysis/test helper, not a training path). The stem's
attention within non-overlapping blocks is :mod:`.blocks`.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from .backends import sasa_cpp
from .backends.sasa_cpp import cpp_local_attention
from .backends.sasa_blocked import halo_local_attention_fused, halo_local_attention_materialized
from .backends.sasa_neighborhood import neighborhood_local_attention
from .checks import ErrorFactory, argument_error, check_block_size, check_bool, check_local_attention
from .dispatch import AUTO, Route, RouteRegistry, is_exporting, lazy_backend
from .precision import compute_dtype
from .route_table import CUDA_DEFAULT_ROUTES, measured_route

__all__ = [
    "AUTO_RECOMPUTE_MAX_HEAD_CHANNELS",
    "DEFAULT_BLOCK_SIZE",
    "LOCAL_ATTENTION_BACKENDS",
    "auto_local_attention_impl",
    "check_recompute",
    "local_attention_probs_2d",
    "local_self_attention_2d",
    "local_self_attention_2d_unchecked",
]

#: Query tile side of the blocked routes when none is given (speed/memory only; the layer's and
#: ``MODEL.SASA.BLOCK_SIZE``'s default too).
DEFAULT_BLOCK_SIZE = 8


#: ``impl`` name -> :class:`~.dispatch.Route` whose ``fn(q, k, v, rel_h, rel_w, kernel_size) ->
#: out`` runs on checked arguments (shapes as in :func:`local_self_attention_2d`; ``q`` already
#: scaled; ``rel_h``/``rel_w`` both tensors or both None; plus ``block_size=`` when ``blocked``,
#: ``recompute=`` when ``recompute``):
#: the one list of SASA's routes (``impl`` of the layer, ``MODEL.SASA.IMPL``, the export check).
#: Adding a route is one file and one entry here.
LOCAL_ATTENTION_BACKENDS = RouteRegistry("SASA local attention", {
    "neighborhood": Route(
        neighborhood_local_attention,
        "window offsets one at a time, with its own backward; stores only the ``k^2`` attention "
        "weights per pixel; pure PyTorch (:mod:`.backends.sasa_neighborhood`)",
    ),
    "cpp": Route(
        cpp_local_attention,
        "a C++ kernel that visits the window once per query row and pass, vectorized along the "
        f"row; CPU tensors, ``kernel_size`` up to {sasa_cpp.MAX_KERNEL_SIZE}, compiled on first "
        "use; keeps the attention weights for backward, or with ``recompute=True`` one "
        "log-sum-exp per query (:mod:`.backends.sasa_cpp`)",
        cuda=False,
        recompute=True,
    ),
    "fused": Route(
        halo_local_attention_fused,
        "blocked with halos, the logits' position and mask terms as query-side tables added "
        "inside fused SDPA; never stores the attention matrix (:mod:`.backends.sasa_blocked`)",
        blocked=True,
    ),
    "materialized": Route(
        halo_local_attention_materialized,
        "blocked with halos, explicit float32 softmax; plain tensor ops, so it exports "
        "(:mod:`.backends.sasa_blocked`)",
        exports=True,
        blocked=True,
    ),
    "triton": Route(
        lazy_backend("backends.sasa_triton", "launch_triton_local_attention", drop=("recompute",)),
        "fused Triton kernels: online softmax over the window, ``q . r`` in-kernel, only the "
        "output and logsumexp saved for backward (it always recomputes); CUDA, or CPU under "
        "Triton's interpreter (:mod:`.backends.sasa_triton`)",
        recompute=True,
        requires=("triton",),
    ),
})
__doc__ = LOCAL_ATTENTION_BACKENDS.document(__doc__, "LOCAL_ATTENTION_BACKENDS")


#: Head widths (``dk``, channels per head of ``q``) up to which ``impl="auto"`` runs the C++
#: kernel in its recompute mode even with ``recompute=False`` (module docstring): faster there.
#: At 8 heads that is the demo's res2-res4 layers (4, 8, 16 channels a head); ResNet-50's
#: (32 and wider) keep their attention weights.
AUTO_RECOMPUTE_MAX_HEAD_CHANNELS = 16


def auto_local_attention_impl(q: torch.Tensor, kernel_size: int, recompute: bool = False) -> str:
    """What ``impl="auto"`` runs for queries ``q``: ``"materialized"`` while tracing/exporting
    (plain tensor ops only); on CUDA the route measured fastest for the GPU, precision and map
    size (:func:`~.route_table.measured_route`; one that can ``recompute`` where asked), else
    ``"fused"``; and on CPU the C++ kernel ``"cpp"`` where it builds and takes ``kernel_size``
    (the fastest exact CPU route: below a 3x3 conv's training time where ``"neighborhood"`` takes
    over twice it; figures in BENCHMARKS.md), else ``"neighborhood"`` (with one warning saying
    why)."""
    if is_exporting():
        return "materialized"
    measured = measured_route("sasa", LOCAL_ATTENTION_BACKENDS, q, q.shape[2] * q.shape[3], recompute=recompute)
    if measured is not None:
        return measured
    if q.device.type == "cuda":
        return CUDA_DEFAULT_ROUTES["sasa"]
    if kernel_size <= sasa_cpp.MAX_KERNEL_SIZE and sasa_cpp.KERNEL.available():
        return "cpp"
    return "neighborhood"


def check_recompute(
    recompute,
    impl: str,
    name: str = "recompute",
    impl_name: str = "impl",
    error: ErrorFactory = argument_error,
) -> None:
    """``recompute`` is True or False, and True only with an ``impl`` that can recompute the
    attention weights in backward (:meth:`~.dispatch.RouteRegistry.recomputing`: ``"auto"`` or
    a route flagged ``recompute``). ``name``/``impl_name``: how the caller knows the two values
    (``"MODEL.SASA.RECOMPUTE_ATTENTION"`` / ``"MODEL.SASA.IMPL"`` for the config)."""
    check_bool(recompute, name, error)
    allowed = LOCAL_ATTENTION_BACKENDS.recomputing()
    if recompute and impl not in allowed:
        raise error(
            name,
            f"False with {impl_name}={impl!r}, a route without a recompute mode (the "
            f"{impl_name} values that can recompute the attention weights: {allowed})",
            recompute,
        )


def local_self_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    kernel_size: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    impl: str = AUTO,
    recompute: bool = False,
) -> torch.Tensor:
    """SASA local self-attention over centred ``k x k`` windows clipped to the map (Eq. 3).

    Args:
        q: ``[B, Nh, H, W, dk]`` queries (already scaled).
        k: ``[B, Nh, H, W, dk]`` keys.
        v: ``[B, Nh, H, W, dv]`` values.
        rel_h: ``[kernel_size, dk//2]`` embeddings of the row offset ``y' - y`` (index
            ``y' - y + r``), or None together with ``rel_w`` (no positional term).
        rel_w: ``[kernel_size, dk - dk//2]`` embeddings of the column offset ``x' - x``.
        kernel_size: odd spatial extent ``k = 2r + 1``.
        block_size: query tile side ``b`` of the blocked routes (capped at ``H`` / ``W``); any
            value gives the same result, it trades the ``((b + 2r) / b)^2`` halo copies against
            the ``(b + 2r)^2`` keys every query of a tile scores.
        impl: ``"auto"`` (:func:`auto_local_attention_impl`) or a route of
            :data:`LOCAL_ATTENTION_BACKENDS` (the module docstring lists them).
        recompute: keep no attention weights for backward, recompute them there (less memory,
            more time; only with ``impl`` ``"auto"`` or a route that can: the module docstring).

    Returns:
        ``[B, Nh, H, W, dv]``.
    """
    check_local_attention(q, k, v, rel_h, rel_w, kernel_size)
    check_block_size(block_size)
    LOCAL_ATTENTION_BACKENDS.check(impl)
    check_recompute(recompute, impl)
    return local_self_attention_2d_unchecked(
        q, k, v, rel_h, rel_w, kernel_size, block_size, impl, recompute
    )


def local_self_attention_2d_unchecked(
    q, k, v, rel_h, rel_w, kernel_size: int, block_size: int, impl: str, recompute: bool = False
) -> torch.Tensor:
    """:func:`local_self_attention_2d` on arguments its caller has checked: what a layer calls in
    its forward, having checked ``kernel_size``, ``block_size``, ``impl`` and ``recompute`` when
    it was built and made ``q, k, v`` and the embeddings itself."""
    if impl == AUTO:
        impl = auto_local_attention_impl(q, kernel_size, recompute)
        if impl == "cpp" and q.shape[-1] <= AUTO_RECOMPUTE_MAX_HEAD_CHANNELS:
            recompute = True  # faster at narrow heads (module docstring)
    route = LOCAL_ATTENTION_BACKENDS[impl]
    options = {}
    if route.blocked:
        options["block_size"] = block_size
    if route.recompute:
        options["recompute"] = recompute
    return route.fn(q, k, v, rel_h, rel_w, kernel_size, **options)


def local_attention_probs_2d(q, k, rel_h, rel_w, kernel_size: int) -> torch.Tensor:
    """Attention probabilities of :func:`local_self_attention_2d` (its arguments but ``v``), per
    window offset.

    Stores ``k^2`` probabilities per pixel (an analysis/test helper; computed in float32, or
    float64 for float64 inputs, with out-of-map neighbours at exactly 0).

    Returns:
        ``[B, Nh, H, W, k, k]``: ``p[..., y, x, a, c]`` is the weight of key ``(y + a - r, x + c - r)``.
    """
    r = check_local_attention(q, k, k, rel_h, rel_w, kernel_size)
    b, nh, h, w, dk = q.shape
    ct = compute_dtype(q.dtype)
    qc, kc = q.to(ct), k.to(ct)
    kp = F.pad(kc, (0, 0, r, r, r, r))  # [B, Nh, H + 2r, W + 2r, dk]
    kw = kp.unfold(2, kernel_size, 1).unfold(3, kernel_size, 1)  # [B, Nh, H, W, dk, k, k]
    logits = torch.einsum("bnyxd,bnyxdac->bnyxac", qc, kw)
    if rel_h is not None:
        dr = dk // 2
        logits = logits + torch.matmul(qc[..., :dr], rel_h.to(ct).t())[..., :, None]
        logits = logits + torch.matmul(qc[..., dr:], rel_w.to(ct).t())[..., None, :]
    off = torch.arange(kernel_size, device=q.device) - r
    rows = torch.arange(h, device=q.device)[:, None] + off[None, :]  # [H, k]
    cols = torch.arange(w, device=q.device)[:, None] + off[None, :]  # [W, k]
    in_map = ((rows >= 0) & (rows < h))[:, None, :, None] & ((cols >= 0) & (cols < w))[None, :, None, :]
    logits = logits.masked_fill(~in_map, float("-inf"))  # [.., H, W, k, k]; the centre is in-map
    probs = torch.softmax(logits.flatten(-2), dim=-1)
    return probs.view(b, nh, h, w, kernel_size, kernel_size)
