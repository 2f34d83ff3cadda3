"""The SASA C++ CPU kernel (``impl="cpp"``, :mod:`aadet.layers.functional.backends.sasa_cpp`):
it builds here, ``auto`` takes it on CPU, it is exact on maps wider than one SIMD vector (the
float64 cases of test_local_attention.py cover the rest), and without a compiler everything
falls back to the neighborhood route with a clear message (test_cpu_kernels.py)."""
import time

import pytest
import torch

from aadet.layers import LocalSelfAttention2d
from aadet.layers.functional.backends import sasa_cpp
from aadet.layers.functional.local_attention import (
    auto_local_attention_impl,
    local_self_attention_2d,
)
from aadet.layers.functional.reference import local_self_attention_2d_reference as brute_force


def _inputs(h, w, ks, dk=8, dv=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, 2, h, w, dk), (1, 2, h, w, dk), (1, 2, h, w, dv), (ks, dk // 2), (ks, dk - dk // 2)]
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_(True) for s in shapes]


def test_the_kernel_builds_on_this_machine():
    # CI machines have g++ and ninja: a kernel that stops compiling must fail here, not fall back.
    assert sasa_cpp.available(), sasa_cpp.build_error()


def test_auto_takes_the_kernel_on_cpu_for_supported_windows():
    q = torch.zeros(1, 1, 4, 4, 2)
    assert auto_local_attention_impl(q, 7) == "cpp"
    assert auto_local_attention_impl(q, sasa_cpp.MAX_KERNEL_SIZE + 2) == "neighborhood"
    with pytest.raises(ValueError, match="kernel_size up to 15; got 17"):
        local_self_attention_2d(q, q, q, None, None, 17, impl="cpp")


@pytest.mark.parametrize("h,w,ks", [(11, 19, 7), (4, 17, 5), (3, 33, 3), (9, 8, 7), (2, 1, 7)])
def test_float32_rows_wider_than_a_vector_match_brute_force(h, w, ks):
    # float32 runs 8 lanes a vector: whole vectors, a partial last one, and rows narrower than one.
    ins = _inputs(h, w, ks)
    g = torch.randn(1, 2, h, w, 12)
    out = local_self_attention_2d(*ins, ks, impl="cpp")
    grads = torch.autograd.grad(out, ins, g)
    ref_ins = [t.detach().double().requires_grad_(True) for t in ins]
    ref = brute_force(*ref_ins, ks)
    ref_grads = torch.autograd.grad(ref, ref_ins, g.double())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=5e-5)


def test_layer_on_the_kernel_equals_the_neighborhood_route():
    torch.manual_seed(0)
    layer = LocalSelfAttention2d(32, 32, kernel_size=7, num_heads=4, impl="neighborhood")
    x = torch.randn(2, 32, 13, 21, requires_grad=True)
    ref = layer(x)
    (gx_ref,) = torch.autograd.grad(ref.square().sum(), x)
    layer.impl = "cpp"
    out = layer(x)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=2e-4)


def _backward_ms(scale):
    # median of 5 backward passes with output gradients of the given scale
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 48, 48, 8, requires_grad=True) for _ in range(3))
    out = local_self_attention_2d(q, k, v, None, None, 7, impl="cpp")
    g = torch.randn_like(out) * scale
    times = []
    for _ in range(5):
        t = time.perf_counter()
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        times.append(time.perf_counter() - t)
    return sorted(times)[2] * 1e3


def test_denormal_gradients_are_not_slow_and_the_process_keeps_denormals():
    # Zero-initialized residual branches send gradients below 1.2e-38 into the first blocks; x86
    # computes on such denormals ~100x slower. Without the kernel's flush-to-zero this backward
    # took 45x the normal one (160 vs 3.6 ms on an Intel Xeon); with it 0.85x.
    assert _backward_ms(1e-39) < 4 * _backward_ms(1.0)
    # the flush is the kernel's alone: the rest of the process still computes denormals
    assert (torch.tensor([1e-39]) * 1.0).item() > 0
