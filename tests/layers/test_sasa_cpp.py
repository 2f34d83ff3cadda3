"""The SASA C++ CPU kernel (``impl="cpp"``, :mod:`aadet.layers.functional.backends.sasa_cpp`):
it builds here, ``auto`` takes it on CPU, it is exact on maps wider than one SIMD vector (the
float64 cases of test_local_attention.py cover the rest), and without a compiler everything
falls back to the neighborhood route with a clear message (test_cpu_kernels.py). Its recompute
mode (``recompute=True``) is exact too, in values and every gradient, on any map and thread
split, keeps nothing of size ``k^2`` per pixel for backward, and a wrong log-sum-exp is caught."""
import time

import pytest
import torch

from aadet.layers import LocalSelfAttention2d
from aadet.layers.functional.backends import sasa_cpp
from aadet.layers.functional.local_attention import (
    AUTO_RECOMPUTE_MAX_HEAD_CHANNELS,
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
    assert sasa_cpp.KERNEL.available(), sasa_cpp.KERNEL.build_error()


def test_auto_takes_the_kernel_on_cpu_for_supported_windows():
    q = torch.zeros(1, 1, 4, 4, 2)
    assert auto_local_attention_impl(q, 7) == "cpp"
    assert auto_local_attention_impl(q, sasa_cpp.MAX_KERNEL_SIZE + 2) == "neighborhood"
    with pytest.raises(ValueError, match="kernel_size up to 15; got 17"):
        local_self_attention_2d(q, q, q, None, None, 17, impl="cpp")


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("h,w,ks", [(11, 19, 7), (4, 17, 5), (3, 33, 3), (9, 8, 7), (2, 1, 7)])
def test_float32_rows_wider_than_a_vector_match_brute_force(h, w, ks, recompute):
    # float32 runs 8 lanes a vector: whole vectors, a partial last one, and rows narrower than one.
    ins = _inputs(h, w, ks)
    g = torch.randn(1, 2, h, w, 12)
    out = local_self_attention_2d(*ins, ks, impl="cpp", recompute=recompute)
    grads = torch.autograd.grad(out, ins, g)
    ref_ins = [t.detach().double().requires_grad_(True) for t in ins]
    ref = brute_force(*ref_ins, ks)
    ref_grads = torch.autograd.grad(ref, ref_ins, g.double())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=5e-5)


# ----------------------------------------------------------------------------- recompute mode
def _float64(b, nh, h, w, dk, dv, ks, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, nh, h, w, dk), (b, nh, h, w, dk), (b, nh, h, w, dv), (ks, dk // 2), (ks, dk - dk // 2)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _errors(ins, ks, g, impl="cpp", **kwargs):
    """Max abs differences to the float64 brute force: the output, then the gradient of each
    input given (q, k, v, rel_h, rel_w; None inputs skipped)."""
    a = [None if t is None else t.clone().requires_grad_(True) for t in ins]
    b = [None if t is None else t.clone().requires_grad_(True) for t in ins]
    out = local_self_attention_2d(*a, ks, impl=impl, **kwargs)
    ref = brute_force(*b, ks)
    given = [i for i, t in enumerate(a) if t is not None]
    ga = torch.autograd.grad(out, [a[i] for i in given], g)
    gb = torch.autograd.grad(ref, [b[i] for i in given], g)
    return [float((out - ref).detach().abs().max())] + [float((x - y).abs().max()) for x, y in zip(ga, gb)]


RECOMPUTE_CASES = [  # (H, W, kernel_size)
    (5, 7, 3),
    (9, 4, 5),
    (3, 2, 7),  # map smaller than the window
    (2, 1, 7),
    (1, 1, 3),
    (7, 7, 7),
    (6, 5, 1),  # k = 1: each pixel attends to itself only
    (13, 11, 7),
    (4, 19, 5),  # rows wider than a float64 vector
]


@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("h,w,ks", RECOMPUTE_CASES)
def test_recompute_float64_values_and_every_gradient_match_brute_force(h, w, ks, relative):
    ins = _float64(2, 2, h, w, 5, 3, ks)  # odd dk: halves of 2 and 3 channels
    if not relative:
        ins[3] = ins[4] = None
    g = torch.randn(2, 2, h, w, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    errors = _errors(ins, ks, g, recompute=True)
    assert len(errors) == (6 if relative else 4)
    assert max(errors) <= 1e-12, errors


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_recompute_is_exact_whatever_rows_each_thread_takes(threads):
    # Each thread takes a run of rows and recomputes the r query rows on either side of it (its
    # neighbours' rows): runs that start and end inside a slice, and several slices per thread.
    ins = _float64(2, 2, 13, 9, 4, 3, 7, seed=threads)
    g = torch.randn(2, 2, 13, 9, 3, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        errors = _errors(ins, 7, g, recompute=True)
    finally:
        torch.set_num_threads(before)
    assert max(errors) <= 1e-12, errors


@pytest.mark.parametrize("layout", ["broadcast", "channels_first", "channels_last"])
def test_recompute_reads_the_output_gradient_in_any_layout(layout):
    # The backward reads the output gradient through its strides (no contiguous copy): the
    # broadcast one of a sum, and dense ones laid out either way.
    ins = _float64(1, 2, 7, 10, 4, 3, 5)
    if layout == "broadcast":
        g = torch.ones(()).expand(1, 2, 7, 10, 3)
    elif layout == "channels_first":
        g = torch.randn(1, 2, 3, 7, 10, dtype=torch.float64).permute(0, 1, 3, 4, 2)
    else:
        g = torch.randn(1, 2, 7, 10, 3, dtype=torch.float64)
    errors = _errors(ins, 5, g.to(torch.float64), recompute=True)
    assert max(errors) <= 1e-12, errors


def test_recompute_gradcheck():
    ins = [t.requires_grad_(True) for t in _float64(1, 2, 4, 3, 4, 2, 3)]

    def fn(q, k, v, rh, rw):
        return local_self_attention_2d(q, k, v, rh, rw, 3, impl="cpp", recompute=True)

    assert torch.autograd.gradcheck(fn, ins, atol=1e-7)


def test_recompute_keeps_nothing_of_size_k2_per_pixel():
    """What backward keeps: the default mode the probabilities ``[N, k^2, H, Wp]`` and padded
    copies of q, k, v; the recompute mode q, k, v as given, one log-sum-exp per query and head,
    and the embeddings."""
    q, k, v, rh, rw = (t.requires_grad_(True) for t in _inputs(24, 40, 7))  # N = 2, dk 8, dv 12
    saved = {}
    for recompute in (False, True):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            local_self_attention_2d(q, k, v, rh, rw, 7, impl="cpp", recompute=recompute)
        saved[recompute] = sizes
    pixels = 2 * 24 * 40
    assert max(saved[False]) >= 49 * pixels  # the probabilities
    assert sum(saved[True]) == pixels * (8 + 8 + 12 + 1) + rh.numel() + rw.numel()


def _saved_numels(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize("dk", [2, 3, 4, 16, 17, 32])
def test_auto_recomputes_at_narrow_heads_and_keeps_the_weights_at_wide_ones(dk):
    """``impl="auto"`` on CPU runs the kernel's recompute mode at heads of up to
    AUTO_RECOMPUTE_MAX_HEAD_CHANNELS channels (faster there), asked or not; wider heads keep the
    attention weights unless asked; ``impl="cpp"`` does what ``recompute`` says at any width."""
    q, k, v, rh, rw = (t.requires_grad_(True) for t in _inputs(9, 11, 5, dk=dk, dv=dk))
    pixels, k2 = 2 * 9 * 11, 25
    narrow = dk <= AUTO_RECOMPUTE_MAX_HEAD_CHANNELS
    auto = _saved_numels(lambda: local_self_attention_2d(q, k, v, rh, rw, 5))
    stored = _saved_numels(lambda: local_self_attention_2d(q, k, v, rh, rw, 5, impl="cpp"))
    recomputed = _saved_numels(lambda: local_self_attention_2d(q, k, v, rh, rw, 5, impl="cpp", recompute=True))
    assert max(stored) >= k2 * pixels  # the probabilities
    assert sum(recomputed) == pixels * (3 * dk + 1) + rh.numel() + rw.numel()  # q, k, v, lse
    assert auto == (recomputed if narrow else stored)
    assert _saved_numels(lambda: local_self_attention_2d(q, k, v, rh, rw, 5, recompute=True)) == recomputed


NARROW_CASES = [  # (H, W, kernel_size): odd sizes, maps smaller than the window, rows over a vector
    (5, 7, 3),
    (3, 2, 7),
    (9, 13, 7),
    (4, 19, 5),
    (1, 1, 3),
]


@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("dk,dv", [(2, 2), (4, 4), (3, 5)])
@pytest.mark.parametrize("h,w,ks", NARROW_CASES)
def test_auto_at_narrow_heads_float64_values_and_every_gradient_match_brute_force(h, w, ks, dk, dv, relative):
    ins = _float64(2, 3, h, w, dk, dv, ks)
    if not relative:
        ins[3] = ins[4] = None
    g = torch.randn(2, 3, h, w, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    errors = _errors(ins, ks, g, impl="auto")
    assert len(errors) == (6 if relative else 4)
    assert max(errors) <= 1e-12, errors


@pytest.mark.parametrize("channels,heads", [(8, 4), (8, 2), (12, 3)])  # 2, 4 and 4 channels a head
@pytest.mark.parametrize("pe", ["relative", "sine2d", "none"])
def test_narrow_layer_float64_values_and_every_gradient_match_brute_force(channels, heads, pe):
    """The layer with narrow heads on ``impl="auto"`` (the recompute mode): output, input gradient
    and every parameter's gradient against the float64 brute-force composition, odd map sizes."""
    from tests.layers.test_local_attention import _manual_layer

    torch.manual_seed(0)
    layer = LocalSelfAttention2d(5, channels, kernel_size=5, num_heads=heads, positional_encoding=pe).double()
    assert layer.head_channels <= AUTO_RECOMPUTE_MAX_HEAD_CHANNELS
    x = torch.randn(2, 5, 9, 7, dtype=torch.float64, requires_grad=True)
    out, ref = layer(x), _manual_layer(layer, x)
    g = torch.randn_like(out)
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad(out, params, g)
    ref_grads = torch.autograd.grad(ref, params, g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_a_wrong_log_sum_exp_is_caught(monkeypatch):
    """The recompute tests catch a backward that recomputes wrong probabilities: a log-sum-exp off
    by 1e-3 (every recomputed weight 0.1% off) moves the gradients far beyond their tolerance,
    while the output (computed before) stays exact."""
    ext = sasa_cpp.KERNEL.extension()
    forward_lse = ext.forward_lse
    monkeypatch.setattr(ext, "forward_lse", lambda *args: (lambda o, lse: (o, lse + 1e-3))(*forward_lse(*args)))
    ins = _float64(1, 2, 6, 5, 4, 3, 5)
    g = torch.randn(1, 2, 6, 5, 3, dtype=torch.float64)
    errors = _errors(ins, 5, g, recompute=True)
    assert errors[0] <= 1e-12 and min(errors[1:]) > 1e-6, errors


def test_recompute_layer_equals_the_default_mode():
    torch.manual_seed(0)
    layer = LocalSelfAttention2d(32, 32, kernel_size=7, num_heads=4, impl="cpp")
    x = torch.randn(2, 32, 13, 21, requires_grad=True)
    ref = layer(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    layer.recompute_attention = True
    out = layer(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


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
