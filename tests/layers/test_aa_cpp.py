"""AA's C++ CPU kernel (``impl="cpp"``, :mod:`aadet.layers.functional.backends.aa_cpp`):
it builds here, ``auto`` takes it on CPU, it is exact on key rows wider than one SIMD vector and
on query counts that are not a whole number of blocks (float64 brute force and gradcheck of
every input are in test_relative_attention.py, which lists ``cpp`` among its routes), and
without a compiler ``auto`` falls back to the SDPA route with a clear message (test_cpu_kernels.py)."""

import pytest
import torch

from aadet.layers import AugmentedConv2d
from aadet.layers.functional import attention_with_logit_tables, relative_self_attention_2d
from aadet.layers.functional.backends import aa_cpp
from aadet.layers.functional.logit_tables import auto_logit_table_impl
from aadet.layers.functional.reference import relative_self_attention_2d_reference as brute_force


def _inputs(h, w, dk=5, dv=3, dtype=torch.float32, seed=0, rel=(True, True)):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 3, h, w, dk), (2, 3, h, w, dk), (2, 3, h, w, dv)]
    ts = [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]
    ts.append(torch.randn(2 * h - 1, dk, generator=g, dtype=dtype) if rel[0] else None)
    ts.append(torch.randn(2 * w - 1, dk, generator=g, dtype=dtype) if rel[1] else None)
    return [None if t is None else t.requires_grad_(True) for t in ts]


def _grads(fn, ins, cot):
    live = [t for t in ins if t is not None]
    out = fn(*ins)
    return out, torch.autograd.grad(out, live, cot)


def test_the_kernel_builds_on_this_machine():
    # CI machines have g++ and ninja: a kernel that stops compiling must fail here, not fall back.
    assert aa_cpp.KERNEL.available(), aa_cpp.KERNEL.build_error()


def test_auto_takes_the_kernel_on_cpu_and_materialized_for_float64():
    assert auto_logit_table_impl(torch.zeros(1, 1, 4, 2)) == "cpp"
    assert auto_logit_table_impl(torch.zeros(1, 1, 4, 2, dtype=torch.bfloat16)) == "cpp"
    assert auto_logit_table_impl(torch.zeros(1, 1, 4, 2, dtype=torch.float64)) == "materialized"


@pytest.fixture(params=["kept", "recomputed"])
def probabilities(request, monkeypatch):
    """Both ways backward gets the probabilities: kept from forward (the default at these sizes)
    or recomputed from the log-sum-exp (a cap of 0 bytes)."""
    if request.param == "recomputed":
        monkeypatch.setattr(aa_cpp, "KEEP_PROBABILITIES_MAX_BYTES", 0)
    return request.param


def _kept_bytes(out):
    """Bytes of the probabilities the kernel kept for ``out``'s backward (saved last; 0: none)."""
    node = out.grad_fn
    while type(node).__name__ != "_CppRowColAttentionBackward":
        node = node.next_functions[0][0]
    p = node.saved_tensors[-1]
    return p.numel() * p.element_size()


# float32 runs 8 lanes a vector, queries 4 a block: whole and partial vectors, rows narrower than
# one vector, a single column and a single row, query counts L % 4 = 0..3.
@pytest.mark.parametrize("h,w", [(3, 19), (5, 8), (7, 9), (13, 1), (1, 17), (2, 3), (1, 1)])
@pytest.mark.parametrize("rel", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["both", "h_only", "w_only", "none"])
def test_float32_matches_brute_force(h, w, rel, probabilities):
    ins = _inputs(h, w, rel=rel)
    cot = torch.randn(2, 3, h, w, 3)
    out, grads = _grads(lambda *a: relative_self_attention_2d(*a, impl="cpp"), ins, cot)
    ref_ins = [None if t is None else t.detach().double().requires_grad_(True) for t in ins]
    ref, ref_grads = _grads(brute_force, ref_ins, cot.double())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4)


def test_float64_gradcheck(probabilities):
    q, k, v, rh, rw = (t.detach().double().requires_grad_(True) for t in _inputs(3, 5, dk=3, dv=2, seed=3))
    fn = lambda *a: relative_self_attention_2d(*a, impl="cpp")  # noqa: E731
    assert (_kept_bytes(fn(q, k, v, rh, rw)) > 0) == (probabilities == "kept")
    assert torch.autograd.gradcheck(fn, (q, k, v, rh, rw))


def test_probabilities_are_kept_only_for_a_backward_and_where_they_fit(monkeypatch):
    q, k, v, rh, rw = _inputs(5, 7)  # N = 2 x 3 slices, L = 35 queries, keys padded to 5 x 8
    size = 6 * 35 * 40 * 4
    assert _kept_bytes(relative_self_attention_2d(q, k, v, rh, rw, impl="cpp")) == size
    monkeypatch.setattr(aa_cpp, "KEEP_PROBABILITIES_MAX_BYTES", size - 1)
    assert _kept_bytes(relative_self_attention_2d(q, k, v, rh, rw, impl="cpp")) == 0
    monkeypatch.setattr(aa_cpp, "KEEP_PROBABILITIES_MAX_BYTES", size)
    # no backward follows: inference, or inputs that need no gradient
    ext, keeps = aa_cpp.KERNEL.extension("cpp"), []

    class Spy:
        def __getattr__(self, name):
            return getattr(ext, name)

        def forward(self, *args):
            keeps.append(args[-1])
            return ext.forward(*args)

    monkeypatch.setattr(aa_cpp.KERNEL, "extension", lambda impl: Spy())
    with torch.no_grad():
        relative_self_attention_2d(q, k, v, rh, rw, impl="cpp")
    relative_self_attention_2d(*(t.detach() for t in (q, k, v, rh, rw)), impl="cpp")
    relative_self_attention_2d(q, k, v, rh, rw, impl="cpp")
    assert keeps == [False, False, True]


def test_large_logits_keep_the_softmax_exact():
    # logits of ~1e3 (q, k scaled x30): the max is subtracted before exp, nothing overflows
    q, k, v, rh, rw = (t.detach() for t in _inputs(6, 11, dk=8, dv=4, seed=2))
    q, k = q * 30, k * 30
    out = relative_self_attention_2d(q, k, v, rh, rw, impl="cpp")
    ref = brute_force(q.double(), k.double(), v.double(), rh.double(), rw.double())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-4)


def test_only_the_requested_gradients_and_their_dtypes():
    q, k, v, rh, rw = (t.detach() for t in _inputs(4, 9))
    v.requires_grad_(True)
    (gv,) = torch.autograd.grad(relative_self_attention_2d(q, k, v, rh, rw, impl="cpp").sum(), [v])
    ref = torch.autograd.grad(relative_self_attention_2d(q, k, v, rh, rw, impl="fused").sum(), [v])[0]
    torch.testing.assert_close(gv, ref, rtol=0, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q16, k16, v16 = (t.bfloat16().requires_grad_(True) for t in (q, k, v))
        out = relative_self_attention_2d(q16, k16, v16, rh, rw, impl="cpp")
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), [q16, k16, v16])
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3


def test_other_table_layouts_are_refused():
    q = torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match="row-major H x W key grid"):
        attention_with_logit_tables(q, q, q, [torch.randn(1, 6, 3)], [torch.tensor([0, 2, 1, 0, 2, 1])],
                                    impl="cpp")


def test_layer_on_the_kernel_equals_the_sdpa_route():
    torch.manual_seed(0)
    layer = AugmentedConv2d(32, 40, 3, kappa=0.4, nu=0.2, num_heads=4, max_size=16, impl="fused")
    x = torch.randn(2, 32, 13, 11, requires_grad=True)
    ref = layer(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    layer.impl = "cpp"
    out = layer(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-4)
