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
:func:`~aadet.layers.functional.reference.local_self_attention_2d_reference`):

* ``"cpp"`` (:mod:`.backends.sasa_cpp`, the CPU default): a C++ kernel that visits the window
  once per query row and pass, vectorized along the row, compiled on first use;
* ``"neighborhood"`` (:mod:`.backends.sasa_neighborhood`, the CPU fallback where the C++ kernel
  does not build): offset by offset with its own backward; stores only the ``k^2`` attention
  weights per pixel;
* ``"fused"`` / ``"materialized"`` (:mod:`.backends.sasa_halo`): blocked with halos, the logits'
  position and mask terms as query-side tables added inside fused SDPA (the CUDA default) or an
  explicit float32 softmax (plain tensor ops: the route ``"auto"`` takes under tracing / ONNX
  export);
* ``"triton"`` (:mod:`.backends.sasa_triton`): fused Triton kernels (CUDA).

:func:`local_attention_probs_2d` returns the attention probabilities over each window (it does
store ``k^2`` values per pixel: an analysis/test helper, not a training path). The stem's
attention within non-overlapping blocks is :mod:`.blocks`.
"""
from typing import Callable, Dict, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .backends import sasa_cpp
from .backends.sasa_cpp import cpp_local_attention
from .backends.sasa_halo import halo_local_attention_fused, halo_local_attention_materialized
from .backends.sasa_neighborhood import neighborhood_local_attention
from .checks import check_block_size, check_impl, check_local_attention
from .dispatch import is_exporting, lazy_backend

__all__ = [
    "LOCAL_ATTENTION_BACKENDS",
    "LOCAL_ATTENTION_IMPLS",
    "LocalAttentionBackend",
    "auto_local_attention_impl",
    "local_attention_probs_2d",
    "local_self_attention_2d",
]


class LocalAttentionBackend(NamedTuple):
    """One implementation of :func:`local_self_attention_2d`.

    Attributes:
        fn: ``fn(q, k, v, rel_h, rel_w, kernel_size) -> out`` on checked arguments (shapes as in
            :func:`local_self_attention_2d`; ``q`` already scaled; ``rel_h``/``rel_w`` both
            tensors or both None), plus ``block_size=`` when ``blocked``.
        blocked: the implementation tiles queries and takes the ``block_size`` keyword.
        cuda: it runs on CUDA tensors (the C++ CPU kernel does not).
    """

    fn: Callable[..., torch.Tensor]
    blocked: bool = False
    cuda: bool = True


#: ``impl`` name -> implementation (one file each; adding one is one file and one line here).
LOCAL_ATTENTION_BACKENDS: Dict[str, LocalAttentionBackend] = {
    "neighborhood": LocalAttentionBackend(neighborhood_local_attention),
    # C++ kernel, one pass over the window per query row (CPU; compiled on first use).
    "cpp": LocalAttentionBackend(cpp_local_attention, cuda=False),
    "fused": LocalAttentionBackend(halo_local_attention_fused, blocked=True),
    "materialized": LocalAttentionBackend(halo_local_attention_materialized, blocked=True),
    # Fused Triton kernels: online softmax over the window, q.r in-kernel, only out + logsumexp
    # saved for backward. CUDA, or CPU under Triton's interpreter (tests).
    "triton": LocalAttentionBackend(
        lazy_backend("backends.sasa_triton", "launch_triton_local_attention")
    ),
}

#: Allowed values of ``impl`` (the one definition; the layer and the config import it).
LOCAL_ATTENTION_IMPLS = ("auto",) + tuple(LOCAL_ATTENTION_BACKENDS)


def auto_local_attention_impl(q: torch.Tensor, kernel_size: int = 7) -> str:
    """What ``impl="auto"`` runs for queries ``q``: ``"materialized"`` while tracing/exporting
    (plain tensor ops only), ``"fused"`` on CUDA, and on CPU the C++ kernel ``"cpp"`` where it
    builds and takes ``kernel_size`` (the fastest exact CPU route: below a 3x3 conv's training
    time where ``"neighborhood"`` takes over twice it; figures in BENCHMARKS.md), else ``"neighborhood"``
    (with one warning saying why)."""
    if is_exporting():
        return "materialized"
    if q.device.type == "cuda":
        return "fused"
    if kernel_size <= sasa_cpp.MAX_KERNEL_SIZE and sasa_cpp.available():
        return "cpp"
    return "neighborhood"


def local_self_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    kernel_size: int,
    *,
    block_size: int = 8,
    impl: str = "auto",
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
        impl: one of :data:`LOCAL_ATTENTION_IMPLS`: ``"neighborhood"`` (offset by offset,
            float32 softmax), ``"cpp"`` (C++ kernel, one pass over the window; CPU, ``kernel_size``
            up to 15), ``"fused"`` (blocked, SDPA), ``"materialized"`` (blocked, explicit
            float32 softmax), ``"triton"`` (fused Triton kernels; CUDA) or ``"auto"``
            (:func:`auto_local_attention_impl`).

    Returns:
        ``[B, Nh, H, W, dv]``.
    """
    check_local_attention(q, k, v, rel_h, rel_w, kernel_size)
    check_block_size(block_size)
    check_impl(impl, LOCAL_ATTENTION_IMPLS)
    if impl == "auto":
        impl = auto_local_attention_impl(q, kernel_size)
    backend = LOCAL_ATTENTION_BACKENDS[impl]
    if backend.blocked:
        return backend.fn(q, k, v, rel_h, rel_w, kernel_size, block_size=block_size)
    return backend.fn(q, k, v, rel_h, rel_w, kernel_size)


def local_attention_probs_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    rel_h: Optional[torch.Tensor],
    rel_w: Optional[torch.Tensor],
    kernel_size: int,
) -> torch.Tensor:
    """Attention probabilities of :func:`local_self_attention_2d`, per window offset.

    Stores ``k^2`` probabilities per pixel (an analysis/test helper; computed in float32, or
    float64 for float64 inputs, with out-of-map neighbours at exactly 0).

    Returns:
        ``[B, Nh, H, W, k, k]``: ``p[..., y, x, a, c]`` is the weight of key ``(y + a - r, x + c - r)``.
    """
    r = check_local_attention(q, k, k, rel_h, rel_w, kernel_size)
    b, nh, h, w, dk = q.shape
    ct = torch.promote_types(q.dtype, torch.float32)
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
