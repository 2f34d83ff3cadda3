"""The attention stem's fused C++ kernel (``impl="cpp"``,
:mod:`aadet.layers.functional.backends.stem_cpp`): it builds here, and its route equals the
float64 brute force and the stem's PyTorch routes in values and in the gradients of the input and
of every parameter -- maps cut by the border and maps smaller than a block, 3 or 6 input
channels, 1 or 2 heads, relative logits or none, blocks of 4 and 2, both of its weight forms --
on any split of the blocks between threads; ``gradcheck`` on the kernel's own inputs; float32
within a tolerance; clear errors off CPU, under export and without the kernel; ``auto`` takes it
on CPU. With a GroupNorm or no norm, the route fuses the norm, pooling and ReLU into the kernel
(``cpp_stem_attention_norm_relu_pool``): values and gradients equal the PyTorch route's GroupNorm
-> max_pool2d -> ReLU, negative ``gamma`` and norms without affine parameters included.
The exactness tests skip where the kernel cannot be built (the build test says
why); without a compiler: test_cpu_kernels.py."""
import os

import pytest
import torch

from aadet.layers.attention_stem import SpatiallyAwareAttentionStem
from aadet.layers.functional.backends import stem_cpp
from aadet.layers.functional.backends.cpu_kernels import ENV_SWITCH
from aadet.layers.functional.blocks import block_padding_mask, blocks_to_map, map_to_blocks

from tests.layers.test_attention_stem import reference_attention

D = torch.float64


@pytest.fixture
def kernel():
    if not stem_cpp.KERNEL.available():
        pytest.skip(f"the stem's C++ kernel is unavailable: {stem_cpp.KERNEL.build_error()}")


def test_the_kernel_builds_on_this_machine():
    # CI machines have g++ and ninja: a kernel that stops compiling must fail here, not skip.
    if os.environ.get(ENV_SWITCH) == "0":
        pytest.skip(f"{ENV_SWITCH}=0")
    assert stem_cpp.KERNEL.available(), stem_cpp.KERNEL.build_error()


def _stem(cin, out, nh, b=4, pe="relative", seed=0, **kwargs):
    torch.manual_seed(seed)
    return SpatiallyAwareAttentionStem(
        cin, out, block_size=b, num_heads=nh, positional_encoding=pe, norm="", **kwargs
    ).double()


def _attention(stem, x, route, factorized=None):
    """The stem's attention ``[B, out, H, W]`` by ``route``: "cpp" (the kernel, in the weight form
    ``factorized``), "factorized" or "projected" (the PyTorch routes) or "brute" (float64 pixel loop)."""
    if route == "cpp":
        return stem._attend_cpp(x, factorized)
    if route == "brute":
        return reference_attention(stem, x)
    bsz, _, h, w = x.shape
    b = stem.block_size
    mask = block_padding_mask((h, w), b)
    mask = None if mask is None else mask.repeat(bsz, 1, 1, 1)
    attend = stem._attend_factorized if route == "factorized" else stem._attend_projected
    return blocks_to_map(attend(map_to_blocks(x, b), mask), bsz, (h, w), b)


def _values_and_gradients(stem, x, route, factorized=None):
    """The attention and the gradients of ``x`` and of every parameter for a fixed output weighting."""
    stem.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = _attention(stem, x, route, factorized)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad.clone() for n, p in stem.named_parameters() if p.grad is not None})
    return out.detach(), grads


def _assert_same(a, b, atol):
    out_a, grads_a = a
    out_b, grads_b = b
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=atol, msg=name)


# (in, out, heads): the kernel's weight form picks itself, factorized where in <= out / heads
SHAPES = [(3, 16, 1), (3, 8, 2), (6, 8, 2), (6, 12, 1)]


@pytest.mark.parametrize("b,hw", [(4, (9, 6)), (4, (3, 2)), (2, (5, 4))])
@pytest.mark.parametrize("pe", ["relative", "none"])
@pytest.mark.parametrize("cin,out,nh", SHAPES)
def test_matches_brute_force_values_and_gradients(kernel, cin, out, nh, pe, b, hw):
    stem = _stem(cin, out, nh, b, pe)
    x = torch.randn(1, cin, *hw, dtype=D)
    cpp = _values_and_gradients(stem, x, "cpp")
    expected = 8 if pe == "relative" else 6  # x, query, key, value_weight, emb_row, emb_col, nu (+ rel_h, rel_w)
    assert len(cpp[1]) == expected + 1
    _assert_same(cpp, _values_and_gradients(stem, x, "brute"), atol=1e-12)


@pytest.mark.parametrize("factorized", [True, False], ids=["factorized_form", "projected_form"])
@pytest.mark.parametrize("hw", [(9, 7), (8, 8), (3, 2), (1, 5)])
@pytest.mark.parametrize("b", [4, 2])
@pytest.mark.parametrize("pe", ["relative", "none"])
@pytest.mark.parametrize("cin,out,nh", SHAPES)
def test_both_weight_forms_match_the_pytorch_routes(kernel, cin, out, nh, pe, b, hw, factorized):
    stem = _stem(cin, out, nh, b, pe, seed=1)
    x = torch.randn(2, cin, *hw, dtype=D)
    cpp = _values_and_gradients(stem, x, "cpp", factorized)
    for route in ("factorized", "projected"):
        _assert_same(cpp, _values_and_gradients(stem, x, route), atol=1e-11)


@pytest.mark.parametrize("threads", [2, 3])
def test_exact_whatever_blocks_each_thread_takes(kernel, threads):
    # The weights' gradients are summed per chunk of blocks, one chunk per thread.
    stem = _stem(3, 8, 2, seed=threads)
    x = torch.randn(3, 3, 13, 10, dtype=D)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpp = _values_and_gradients(stem, x, "cpp")
    finally:
        torch.set_num_threads(before)
    _assert_same(cpp, _values_and_gradients(stem, x, "projected"), atol=1e-11)


@pytest.mark.parametrize("relative", [True, False])
def test_gradcheck_of_the_kernel(kernel, relative):
    # The kernel's own inputs, a general (not factorized) query feature, tables narrower than it.
    g = torch.Generator().manual_seed(2)
    b, nh, e, cin, out = 2, 2, 3, 2, 4
    shapes = [(2, cin, 3, 5), (nh, e, cin), (nh, e, cin), (nh, 2 * b - 1, 2), (nh, 2 * b - 1, 1), (b * b, cin, out)]
    x, wq, wk, tr, tc, wv = (torch.randn(*s, generator=g, dtype=D).requires_grad_(True) for s in shapes)
    if relative:
        args = (x, wq, wk, tr, tc, wv)
        assert torch.autograd.gradcheck(lambda *t: stem_cpp.cpp_stem_attention(*t, b), args)
    else:
        args = (x, wq, wk, wv)
        assert torch.autograd.gradcheck(
            lambda x, wq, wk, wv: stem_cpp.cpp_stem_attention(x, wq, wk, None, None, wv, b), args
        )


def test_module_forward_equals_auto_in_values_and_gradients(kernel):
    # The whole stem (BN in training mode, ReLU, pooling) with impl="cpp" and impl="auto".
    x = torch.randn(2, 3, 11, 14, dtype=D)
    results = []
    for impl in ("cpp", "auto"):
        torch.manual_seed(0)
        stem = SpatiallyAwareAttentionStem(3, 16, num_heads=2, impl=impl).double()
        xi = x.clone().requires_grad_(True)
        out = stem(xi)
        out.square().sum().backward()
        grads = {n: p.grad for n, p in stem.named_parameters()}
        results.append((out.detach(), {"x": xi.grad, **grads}))
    _assert_same(*results, atol=1e-10)


def test_float32_within_tolerance(kernel):
    stem = _stem(3, 16, 2)
    x = torch.randn(2, 3, 13, 18, dtype=D)
    ref = _values_and_gradients(stem, x, "projected")
    stem.float()
    out, grads = _values_and_gradients(stem, x.float(), "cpp")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref[0], rtol=0, atol=1e-5)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        scale = max(1.0, float(ref[1][name].abs().max()))
        torch.testing.assert_close(grad.double(), ref[1][name], rtol=0, atol=5e-5 * scale, msg=name)


def test_auto_takes_the_kernel_on_cpu_and_the_pytorch_routes_elsewhere(kernel, monkeypatch):
    wide, narrow = SpatiallyAwareAttentionStem(3, 64), SpatiallyAwareAttentionStem(3, 8, num_heads=2)
    assert wide.route() == narrow.route("cpu") == "cpp"
    assert wide.route("meta") == "factorized" and narrow.route("meta") == "projected"  # not CPU
    assert SpatiallyAwareAttentionStem(3, 64, impl="projected").route() == "projected"
    assert SpatiallyAwareAttentionStem(3, 8, num_heads=2, impl="cpp").route("meta") == "cpp"
    monkeypatch.setattr("aadet.layers.attention_stem.is_exporting", lambda: True)
    assert wide.route() == "factorized"
    monkeypatch.undo()
    monkeypatch.setattr(stem_cpp.KERNEL, "available", lambda: False)
    assert wide.route() == "factorized" and narrow.route() == "projected"


def test_errors_off_cpu_under_export_and_without_the_kernel(monkeypatch):
    stem = SpatiallyAwareAttentionStem(3, 16, norm="", impl="cpp")
    with pytest.raises(ValueError, match="impl='cpp' runs on CPU tensors; got meta"):
        stem._attend_cpp(torch.zeros(1, 3, 8, 8, device="meta"))  # (forward: autocast knows no meta)
    monkeypatch.setattr("aadet.layers.attention_stem.is_exporting", lambda: True)
    with pytest.raises(ValueError, match="impl='cpp' .* does not trace or export"):
        stem(torch.zeros(1, 3, 8, 8))
    monkeypatch.undo()
    monkeypatch.setattr(stem_cpp.KERNEL, "build", lambda verbose=False: None)
    monkeypatch.setattr(stem_cpp.KERNEL, "_error", "test: no compiler")
    with pytest.raises(RuntimeError, match="impl='cpp' needs the SASA attention stem C\\+\\+ kernel, "
                                           "which did not build: test: no compiler"):
        stem(torch.zeros(1, 3, 8, 8))


def test_export_check_names_the_stem_key():
    from aadet.config import ConfigValueError
    from aadet.engine import get_aadet_cfg
    from aadet.export.tracing import check_exportable

    cfg = get_aadet_cfg()
    cfg.MODEL.SASA.STEM_IMPL = "factorized"
    check_exportable(cfg, "onnx")
    cfg.MODEL.SASA.STEM_IMPL = "cpp"
    with pytest.raises(ConfigValueError, match="Config key MODEL.SASA.STEM_IMPL must be one of "
                                               r"\('auto', 'factorized', 'projected'\) to export"):
        check_exportable(cfg, "onnx")



def _stem_with_norm(norm_kind, cin=3, out=16, nh=2, b=4, pe="relative", impl="cpp"):
    torch.manual_seed(0)
    norm = {"gn": "GN", "gn_no_affine": lambda c: torch.nn.GroupNorm(4, c, affine=False), "none": ""}[norm_kind]
    if norm_kind == "gn":
        norm = lambda c: torch.nn.GroupNorm(4, c)  # noqa: E731
    stem = SpatiallyAwareAttentionStem(cin, out, block_size=b, num_heads=nh, positional_encoding=pe,
                                       norm=norm, impl=impl).double()
    if norm_kind == "gn":
        with torch.no_grad():  # gamma of both signs: blocks take the minimum where it is negative
            stem.norm.weight.copy_(torch.linspace(-1.5, 1.5, out))
            stem.norm.bias.uniform_(-0.5, 0.5)
    return stem


def _stem_values_and_gradients(stem, x, g):
    x = x.clone().requires_grad_(True)
    out = stem(x)
    grads = torch.autograd.grad(out, [x, *stem.parameters()], g)
    return out.detach(), grads


@pytest.mark.parametrize("hw,b", [((9, 7), 4), ((8, 8), 4), ((5, 6), 2), ((3, 2), 4)])
@pytest.mark.parametrize("norm_kind", ["gn", "gn_no_affine", "none"])
@pytest.mark.parametrize("cin,nh,pe", [(3, 2, "relative"), (6, 1, "none"), (6, 4, "relative")])
def test_fused_norm_pool_relu_equals_the_pytorch_route(kernel, hw, b, norm_kind, cin, nh, pe):
    """On the C++ route a GroupNorm (or no norm), the pooling and the ReLU are fused into the kernel
    (the full-resolution map is never written): values and the gradients of the input and every
    parameter (the norm's too) equal the projected route's GroupNorm -> max_pool2d -> ReLU."""
    stem = _stem_with_norm(norm_kind, cin=cin, nh=nh, b=b, pe=pe)
    ref_stem = _stem_with_norm(norm_kind, cin=cin, nh=nh, b=b, pe=pe, impl="projected")
    ref_stem.load_state_dict(stem.state_dict())
    assert stem.route() == "cpp" and stem.fuses_norm
    assert stem.cpp_factorized == (cin * nh <= 16)  # both weight forms
    x = torch.randn(2, cin, *hw, dtype=D)
    g = torch.randn(2, 16, -(-hw[0] // b), -(-hw[1] // b), dtype=D)
    out, grads = _stem_values_and_gradients(stem, x, g)
    ref, ref_grads = _stem_values_and_gradients(ref_stem, x, g)
    if norm_kind == "gn":
        assert 0 < (ref > 0).double().mean() < 1  # outputs cut off by the ReLU, and others
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("threads", [2, 3])
def test_fused_norm_exact_whatever_blocks_each_thread_takes(kernel, threads):
    # The moments are summed per chunk of blocks, one chunk per thread.
    stem, ref_stem = _stem_with_norm("gn"), _stem_with_norm("gn", impl="projected")
    ref_stem.load_state_dict(stem.state_dict())
    x = torch.randn(3, 3, 13, 10, dtype=D)
    g = torch.randn(3, 16, 4, 3, dtype=D)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, grads = _stem_values_and_gradients(stem, x, g)
    finally:
        torch.set_num_threads(before)
    ref, ref_grads = _stem_values_and_gradients(ref_stem, x, g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_other_norms_are_not_fused(kernel):
    stem = SpatiallyAwareAttentionStem(3, 16, norm=lambda c: torch.nn.BatchNorm2d(c))
    assert stem.route() == "cpp" and not stem.fuses_norm
    ref = SpatiallyAwareAttentionStem(3, 16, norm=lambda c: torch.nn.BatchNorm2d(c), impl="projected")
    ref.load_state_dict(stem.state_dict())
    x = torch.randn(2, 3, 12, 8)
    torch.testing.assert_close(stem(x), ref(x), rtol=0, atol=1e-5)


def test_fused_norm_pool_relu_in_float32(kernel):
    stem = _stem_with_norm("gn", out=32)
    x = torch.randn(2, 3, 40, 36, dtype=D) * 3 + 5
    ref = _stem_with_norm("gn", out=32, impl="projected")
    ref.load_state_dict(stem.state_dict())
    want = ref(x)
    with torch.no_grad():
        got = stem.float()(x.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * max(1.0, float(want.abs().max())))
