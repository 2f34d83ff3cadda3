"""Criss-cross attention: the attention of CCNet (public API).

Paper: Huang, Wang, Huang, Huang, Wei, Liu, "CCNet: Criss-Cross Attention for Semantic
Segmentation", ICCV 2019 / TPAMI 2020, Section 3.2. Each pixel attends to the pixels of its own
column and its own row, ``H + W - 1`` keys (itself counted once). For one head at pixel ``(i, j)``
of an ``[H, W]`` map::

    out[i, j] = sum_{(a, b) in C(i, j)} softmax_{(a, b)}( q[i, j] . k[a, b] ) v[a, b]

    C(i, j) = {(a, j) : 0 <= a < H}  U  {(i, c) : 0 <= c < W, c != j}

Any ``H, W >= 1`` works (``1 x W`` and ``H x 1`` maps included). No scaling happens here: the
caller scales ``q``. Two passes of it reach every pixel of the map (the paper's recurrent RCCA:
the second pass reads the first's outputs along the cross, each of which has read its own cross).

:func:`criss_cross_attention_2d` checks its arguments once (:mod:`.checks`) and dispatches on
``impl`` through :data:`CRISS_CROSS_BACKENDS`, one implementation per file under ``backends/``
(``ccnet_<route>.py``), all exact (tested against
:func:`~aadet.layers.functional.reference.criss_cross_attention_2d_reference`); ``"auto"`` is
:func:`auto_criss_cross_attention_impl`. A layer that checked its constant arguments when it was
built calls :func:`criss_cross_attention_2d_unchecked` in its forward.
"""
import torch

from .backends.ccnet_materialized import materialized_criss_cross_attention
from .checks import check_criss_cross_attention
from .dispatch import AUTO, Route, RouteRegistry, is_exporting
from .route_table import CUDA_DEFAULT_ROUTES, measured_route

__all__ = [
    "CRISS_CROSS_BACKENDS",
    "auto_criss_cross_attention_impl",
    "criss_cross_attention_2d",
    "criss_cross_attention_2d_unchecked",
]

#: ``impl`` name -> :class:`~.dispatch.Route` whose ``fn(q, k, v) -> out`` runs on checked
#: arguments (shapes as in :func:`criss_cross_attention_2d`; ``q`` already scaled): the one list
#: of CCNet's routes (``impl`` of the layers, ``MODEL.CCNET.IMPL``). Adding a route is one file
#: and one entry here.
CRISS_CROSS_BACKENDS = RouteRegistry("CCNet criss-cross attention", {
    "materialized": Route(
        materialized_criss_cross_attention,
        "the column and row logits as two 1D products, one explicit float32 softmax over the "
        "``H + W`` entries (the pixel's own row entry masked out), left to autograd; plain tensor "
        "ops, so it exports (:mod:`.backends.ccnet_materialized`)",
        exports=True,
    ),
})
__doc__ = CRISS_CROSS_BACKENDS.document(__doc__, "CRISS_CROSS_BACKENDS")


def auto_criss_cross_attention_impl(q: torch.Tensor) -> str:
    """What ``impl="auto"`` runs for queries ``q``: on CUDA the route measured fastest for the GPU,
    precision and map size (:func:`~.route_table.measured_route`), else ``"materialized"``
    (CPU, tracing and exporting: the one route registered yet)."""
    measured = None if is_exporting() else measured_route("ccnet", CRISS_CROSS_BACKENDS, q, q.shape[2] * q.shape[3])
    if measured is not None:
        return measured
    return CUDA_DEFAULT_ROUTES["ccnet"] if q.device.type == "cuda" else "materialized"


def criss_cross_attention_2d(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str = AUTO
) -> torch.Tensor:
    """CCNet's criss-cross attention: every pixel over its column and its row (module docstring).

    Args:
        q: ``[B, Nh, H, W, d]`` queries (already scaled).
        k: ``[B, Nh, H, W, d]`` keys.
        v: ``[B, Nh, H, W, dv]`` values (``q``'s dtype and device).
        impl: ``"auto"`` (:func:`auto_criss_cross_attention_impl`) or a route of
            :data:`CRISS_CROSS_BACKENDS` (the module docstring lists them).

    Returns:
        ``[B, Nh, H, W, dv]``.
    """
    check_criss_cross_attention(q, k, v)
    CRISS_CROSS_BACKENDS.check(impl)
    return criss_cross_attention_2d_unchecked(q, k, v, impl)


def criss_cross_attention_2d_unchecked(q, k, v, impl: str) -> torch.Tensor:
    """:func:`criss_cross_attention_2d` on arguments its caller has checked: what a layer calls in
    its forward, having checked ``impl`` when it was built and made ``q, k, v`` itself."""
    if impl == AUTO:
        impl = auto_criss_cross_attention_impl(q)
    return CRISS_CROSS_BACKENDS[impl].fn(q, k, v)
