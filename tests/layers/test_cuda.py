"""Every attention route on CUDA, in float64, float32 and under bf16 / fp16 autocast, against the
float64 brute force run on the GPU: values and gradients (``pytest -m cuda``; ``make gpu-check``
runs them and puts the result in its report). Skipped on a machine without CUDA.

* functional routes: AA ``relative_self_attention_2d`` (every ``attention_with_logit_tables``
  route of ``LOGIT_TABLE_BACKENDS`` that runs on CUDA, the materialized one chunked too, and
  auto), SASA ``local_self_attention_2d`` (every CUDA route of ``LOCAL_ATTENTION_BACKENDS``, and
  auto), the stem's ``block_self_attention_2d``; each against the
  pixel-by-pixel float64 brute force of ``aadet/layers/functional/reference.py``, run on the GPU
  (``torch.device("cuda")`` as the default device), with the same output cotangent for the
  gradients of ``q``, ``k``, ``v`` and the relative tables.
  HaloNet's ``halo_attention_2d`` has its CUDA rows in ``test_halo_attention.py`` (same marker).
* layers: ``AugmentedConv2d``, ``LocalSelfAttention2d`` and ``HaloSelfAttention2d`` (every
  route) and ``SpatiallyAwareAttentionStem`` (factorized and projected routes) on CUDA against a float64
  copy of the same layer on the GPU (whose routes the float64 rows above and the CPU tests tie
  to the brute force): output, input gradient and every parameter gradient.

Errors are ``||x - ref|| / ||ref||``. Limits: float64 1e-10 (same arithmetic up to the order of
sums); float32 1e-4 (functional) and 2e-3 for layers (cuDNN may run float32 convolutions as
TF32, 10 mantissa bits); fp16 (10 bits) 5e-3 values / 1e-2 gradients; bf16 (7 bits) 2e-2 /
4e-2, the inputs themselves being rounded to bf16 (2^-8 = 4e-3 per element). A route that is
wrong anywhere (a border, a block, a head) is off by O(1). The Triton and flex routes compute
in float32 and reject float64 by design: they get every precision but fp64.
"""
import copy
import functools

import pytest
import torch

from aadet.layers.attention_stem import SpatiallyAwareAttentionStem
from aadet.layers.augmented_conv import AugmentedConv2d
from aadet.layers.functional import (
    HALO_ATTENTION_BACKENDS,
    LOCAL_ATTENTION_BACKENDS,
    LOGIT_TABLE_BACKENDS,
    block_self_attention_2d,
    local_self_attention_2d,
    relative_self_attention_2d,
)
from aadet.layers.functional.reference import (
    block_self_attention_2d_reference,
    local_self_attention_2d_reference,
    relative_self_attention_2d_reference,
)
from aadet.layers.halo_attention import HaloSelfAttention2d
from aadet.layers.local_attention import LocalSelfAttention2d

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

D = torch.float64
#: precision -> (compute dtype, autocast dtype or None, value limit, gradient limit)
PRECISIONS = {
    "fp64": (torch.float64, None, 1e-10, 1e-10),
    "fp32": (torch.float32, None, 1e-4, 1e-4),
    "bf16": (torch.float32, torch.bfloat16, 2e-2, 4e-2),
    "fp16": (torch.float32, torch.float16, 5e-3, 1e-2),
}
LAYER_FP32_LIMIT = 2e-3  # TF32 convolutions
#: Routes that compute in float32 and reject float64 inputs by design (their float64 stand-in is
#: ``materialized``): every other (route, precision) pair is tested.
NO_FLOAT64 = ("triton", "flex")


def route_cases(impls, precisions):
    """``(impl, precision)`` for every registered route that runs on CUDA and every precision,
    less float64 on the float32 kernels."""
    cpu_only = {i for routes in (LOCAL_ATTENTION_BACKENDS, LOGIT_TABLE_BACKENDS, HALO_ATTENTION_BACKENDS)
                for i, route in routes.items() if not route.cuda}
    return [pytest.param(i, p, id=f"{i}-{p}") for i in impls for p in precisions
            if not (p == "fp64" and i in NO_FLOAT64) and i not in cpu_only]


def rel_err(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


def _leaves(shapes, seed, scale):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(s, generator=g, device="cuda", dtype=D) * sc).requires_grad_(True)
            for s, sc in zip(shapes, scale)]


def _reference(fn, leaves, seed):
    """Brute-force output and gradients (for a fixed random cotangent) in float64 on the GPU."""
    with torch.device("cuda"):
        out = fn(*leaves)
    cot = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(seed + 1),
                      device="cuda", dtype=D)
    grads = torch.autograd.grad((out * cot).sum(), leaves)
    return out.detach(), cot, [g.detach() for g in grads]


def _check_route(run, leaves, ref, precision):
    """Run ``run(*inputs)`` in ``precision`` from the float64 leaves; compare with ``ref``."""
    out_ref, cot, grads_ref = ref
    dtype, amp, lim, glim = PRECISIONS[precision]
    inputs = [t.to(amp or dtype) if i < 3 else t.to(dtype) for i, t in enumerate(leaves)]  # q, k, v
    with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
        out = run(*inputs)
    assert out.shape == out_ref.shape and torch.isfinite(out).all()
    err = rel_err(out, out_ref)
    grads = torch.autograd.grad((out.double() * cot).sum(), leaves)
    gerr = {name: rel_err(g, gr) for name, g, gr in zip(("q", "k", "v", "rel_h", "rel_w"), grads, grads_ref)}
    assert err < lim, f"{precision}: output error {err:.2e} >= {lim:.0e}"
    assert max(gerr.values()) < glim, f"{precision}: gradient errors {gerr} (limit {glim:.0e})"
    return err, gerr


# ----------------------------------------------------------------------------- AA: global attention
AA_SHAPE = dict(b=2, nh=2, h=6, w=7, dk=8, dv=8)


@functools.lru_cache(maxsize=None)
def aa_problem():
    b, nh, h, w, dk, dv = AA_SHAPE.values()
    leaves = _leaves([(b, nh, h, w, dk), (b, nh, h, w, dk), (b, nh, h, w, dv), (2 * h - 1, dk), (2 * w - 1, dk)],
                     seed=0, scale=[0.7, 0.7, 1.0, 0.7, 0.7])
    return leaves, _reference(relative_self_attention_2d_reference, leaves, seed=0)


@pytest.mark.parametrize("impl,precision", route_cases(LOGIT_TABLE_BACKENDS.impls(), PRECISIONS))
@pytest.mark.parametrize("chunk", [0, 11])  # queries per chunk (the materialized route's memory bound)
def test_aa_relative_attention_routes(impl, chunk, precision):
    leaves, ref = aa_problem()
    _check_route(lambda q, k, v, rh, rw: relative_self_attention_2d(q, k, v, rh, rw, impl=impl, query_chunk=chunk),
                 leaves, ref, precision)


# ----------------------------------------------------------------------------- SASA: local attention
SASA_SHAPE = dict(b=1, nh=2, h=9, w=10, dk=8, dv=8, kernel=7)


@functools.lru_cache(maxsize=None)
def sasa_problem():
    b, nh, h, w, dk, dv, ks = SASA_SHAPE.values()
    leaves = _leaves([(b, nh, h, w, dk), (b, nh, h, w, dk), (b, nh, h, w, dv), (ks, dk // 2), (ks, dk - dk // 2)],
                     seed=1, scale=[0.8, 0.8, 1.0, 0.8, 0.8])
    return leaves, _reference(lambda *t: local_self_attention_2d_reference(*t, ks), leaves, seed=1)


@pytest.mark.parametrize("impl,precision", route_cases(LOCAL_ATTENTION_BACKENDS.impls(), PRECISIONS))
@pytest.mark.parametrize("block", [4, 16])  # query tile of the blocked routes (16: one tile, map padded)
def test_sasa_local_attention_routes(impl, block, precision):
    leaves, ref = sasa_problem()
    ks = SASA_SHAPE["kernel"]
    _check_route(lambda q, k, v, rh, rw: local_self_attention_2d(q, k, v, rh, rw, ks, block_size=block, impl=impl),
                 leaves, ref, precision)


# ----------------------------------------------------------------------------- stem: block attention
STEM_BLOCK = 4


@functools.lru_cache(maxsize=None)
def stem_problem():
    b, nh, h, w, d = 2, 2, 9, 6, 8  # 9 x 6: the last row and column of blocks are cut by the border
    r = 2 * STEM_BLOCK - 1
    leaves = _leaves([(b, nh, h, w, d), (b, nh, h, w, d), (b, nh, h, w, d), (r, d // 2), (r, d - d // 2)],
                     seed=2, scale=[0.8, 0.8, 1.0, 0.8, 0.8])
    return leaves, _reference(lambda *t: block_self_attention_2d_reference(*t, STEM_BLOCK), leaves, seed=2)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_stem_block_attention(precision):
    leaves, ref = stem_problem()
    _check_route(lambda q, k, v, rh, rw: block_self_attention_2d(q, k, v, rh, rw, STEM_BLOCK), leaves, ref, precision)


# ----------------------------------------------------------------------------- layers
def _check_layer(layer, x_shape, precision, seed=0):
    """``layer`` on CUDA in ``precision`` vs its float64 copy on CUDA: output, dL/dx, dL/dparams."""
    dtype, amp, lim, glim = PRECISIONS[precision]
    if precision == "fp32":
        lim = glim = LAYER_FP32_LIMIT
    torch.manual_seed(seed)
    ref_layer = copy.deepcopy(layer).cuda().double()
    if hasattr(ref_layer, "impl"):
        ref_layer.impl = "materialized"
    layer = layer.cuda().to(dtype)
    x = torch.randn(x_shape, device="cuda", dtype=D, requires_grad=True)
    ref = ref_layer(x)
    cot = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * cot).sum(), [x, *ref_layer.parameters()])
    with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
        out = layer(x.to(dtype))
    assert torch.isfinite(out).all()
    grads = torch.autograd.grad((out.double() * cot).sum(), [x, *layer.parameters()], allow_unused=True)
    names = ["input"] + [n for n, _ in layer.named_parameters()]
    assert all(g is not None for g in grads), [n for n, g in zip(names, grads) if g is None]
    err = rel_err(out, ref)
    gerr = {n: rel_err(g, gr) for n, g, gr in zip(names, grads, ref_grads) if gr.norm() > 0}
    assert err < lim, f"{precision}: output error {err:.2e} >= {lim:.0e}"
    worst = max(gerr, key=gerr.get)
    assert gerr[worst] < glim, f"{precision}: gradient error of {worst} {gerr[worst]:.2e} >= {glim:.0e} ({gerr})"


LAYER_PRECISIONS = ["fp64", "fp32", "bf16", "fp16"]


@pytest.mark.parametrize("impl,precision", route_cases(LOGIT_TABLE_BACKENDS.impls()[1:], LAYER_PRECISIONS))
@pytest.mark.parametrize("stride,downsample", [(1, False), (2, True)])
def test_augmented_conv2d(impl, stride, downsample, precision):
    torch.manual_seed(0)
    layer = AugmentedConv2d(16, 32, 3, stride=stride, kappa=0.25, nu=0.25, num_heads=4, max_size=16,
                            attention_downsample=downsample, impl=impl)
    _check_layer(layer, (2, 16, 13, 11), precision)


@pytest.mark.parametrize("impl,precision", route_cases(LOCAL_ATTENTION_BACKENDS.impls()[1:], LAYER_PRECISIONS))
@pytest.mark.parametrize("stride", [1, 2])
def test_local_self_attention2d(impl, stride, precision):
    torch.manual_seed(0)
    layer = LocalSelfAttention2d(16, 32, kernel_size=7, num_heads=4, stride=stride, block_size=4, impl=impl)
    _check_layer(layer, (2, 16, 13, 11), precision)


@pytest.mark.parametrize("impl,precision", route_cases(HALO_ATTENTION_BACKENDS.impls()[1:], LAYER_PRECISIONS))
@pytest.mark.parametrize("stride", [1, 2])
def test_halo_self_attention2d(impl, stride, precision):
    torch.manual_seed(0)
    layer = HaloSelfAttention2d(16, 32, block_size=4, halo_size=2, num_heads=4, stride=stride, impl=impl)
    _check_layer(layer, (2, 16, 13, 11), precision)


@pytest.mark.parametrize("precision", LAYER_PRECISIONS)
@pytest.mark.parametrize("out_channels,num_heads", [(64, 1), (8, 2)])  # factorized, projected route
def test_attention_stem(out_channels, num_heads, precision):
    torch.manual_seed(0)
    stem = SpatiallyAwareAttentionStem(3, out_channels, block_size=4, num_heads=num_heads, norm="")
    _check_layer(stem, (2, 3, 18, 23), precision)
