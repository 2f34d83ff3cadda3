"""CCNet's criss-cross attention: the functional core (every registered route) against a
pixel-by-pixel float64 brute force, the pixel counted once, the blocks' reach (one pass: the
row and column; two: the whole map), the modules (identity at init, parameter counts, errors),
the MODEL.CCNET keys and export (TorchScript, ONNX opset 17)."""
import io
import itertools
import re

import pytest
import torch

from aadet.layers.criss_cross import CrissCrossAttention2d, RecurrentCrissCrossAttention
from aadet.layers.functional.criss_cross import (
    CRISS_CROSS_BACKENDS,
    auto_criss_cross_attention_impl,
    criss_cross_attention_2d,
)
from aadet.layers.functional.reference import criss_cross_attention_2d_reference as brute_force
from aadet.layers.local_attention import merge_heads, split_heads

D = torch.float64
IMPLS = list(CRISS_CROSS_BACKENDS)
SIZES = [(1, 1), (1, 6), (5, 1), (5, 7), (4, 4)]  # (H, W): a pixel, a row, a column, maps


def _inputs(b, nh, h, w, d, dv, dtype=D, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, h, w, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, nh, h, w, d, generator=g, dtype=dtype) * scale
    v = torch.randn(b, nh, h, w, dv, generator=g, dtype=dtype)
    return q, k, v


def cross_brute_force(q, k, v, self_weight=1):
    """The criss-cross attention with the pixel itself counted ``self_weight`` times (1: CCNet's;
    2: a column and a row that both keep it), pixel by pixel in float64."""
    b, nh, h, w, _ = q.shape
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(b, nh, h, w, v.shape[-1], dtype=D)
    for bi, n, y, x in itertools.product(range(b), range(nh), range(h), range(w)):
        keys = [(a, x) for a in range(h)] + [(y, c) for c in range(w) if c != x]
        keys += [(y, x)] * (self_weight - 1)
        p = torch.softmax(torch.stack([q[bi, n, y, x] @ k[bi, n, a, c] for a, c in keys]), 0)
        out[bi, n, y, x] = sum(pi * v[bi, n, a, c] for pi, (a, c) in zip(p, keys))
    return out


# ----------------------------------------------------------------------------- functional core
@pytest.mark.parametrize("h,w", SIZES)
@pytest.mark.parametrize("impl", IMPLS + ["auto"])
def test_matches_brute_force(h, w, impl):
    q, k, v = _inputs(2, 2, h, w, 3, 4)
    out = criss_cross_attention_2d(q, k, v, impl=impl)
    assert out.shape == (2, 2, h, w, 4) and out.dtype == D
    torch.testing.assert_close(out, brute_force(q, k, v), rtol=0, atol=1e-12)


@pytest.mark.parametrize("h,w", SIZES)
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_brute_force(h, w, impl):
    q, k, v = _inputs(1, 2, h, w, 3, 2, seed=1)
    a = [t.clone().requires_grad_(True) for t in (q, k, v)]
    b = [t.clone().requires_grad_(True) for t in (q, k, v)]
    g = torch.randn(1, 2, h, w, 2, dtype=D)
    (criss_cross_attention_2d(*a, impl=impl) * g).sum().backward()
    (brute_force(*b) * g).sum().backward()
    for ta, tb in zip(a, b):
        torch.testing.assert_close(ta.grad, tb.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("h,w", [(1, 1), (1, 3), (3, 1), (3, 4)])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck(h, w, impl):
    args = [t.requires_grad_(True) for t in _inputs(1, 1, h, w, 2, 2, seed=2)]
    assert torch.autograd.gradcheck(lambda q, k, v: criss_cross_attention_2d(q, k, v, impl=impl), args)


def test_reference_queries_are_the_full_references_pixels():
    q, k, v = _inputs(2, 2, 4, 5, 3, 2)
    queries = [(0, 0), (3, 4), (2, 1)]
    full = brute_force(q, k, v)
    assert torch.equal(brute_force(q, k, v, queries), torch.stack([full[:, :, y, x] for y, x in queries], 2))


def test_the_pixel_is_counted_once():
    q, k, v = _inputs(1, 2, 4, 5, 3, 2, scale=1.5)
    out = criss_cross_attention_2d(q, k, v)
    once, twice = cross_brute_force(q, k, v, 1), cross_brute_force(q, k, v, 2)
    torch.testing.assert_close(out, once, rtol=0, atol=1e-12)
    assert float((out - twice).abs().max()) > 1e-2  # counting it twice is visibly another function
    # q = 0: uniform weights, the plain mean of the H + W - 1 values of the cross
    zero = criss_cross_attention_2d(torch.zeros_like(q), k, v)
    for y, x in itertools.product(range(4), range(5)):
        cross = v[:, :, :, x].sum(2) + v[:, :, y].sum(2) - v[:, :, y, x]
        torch.testing.assert_close(zero[:, :, y, x], cross / (4 + 5 - 1), rtol=0, atol=1e-13)


def test_keys_off_the_cross_have_no_influence():
    q, k, v = _inputs(1, 1, 6, 7, 3, 2)
    base = criss_cross_attention_2d(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[0, 0, 2, 5] += 3.0
    v2[0, 0, 2, 5] += 3.0
    changed = (criss_cross_attention_2d(q, k2, v2) - base).abs().amax(-1)[0, 0] > 0  # [H, W]
    expected = torch.zeros(6, 7, dtype=torch.bool)
    expected[2, :] = expected[:, 5] = True  # exactly the queries whose cross holds (2, 5)
    assert torch.equal(changed, expected)


def test_float32_and_bf16():
    q, k, v = _inputs(2, 2, 6, 5, 8, 4, dtype=torch.float32, scale=2.0)
    out = criss_cross_attention_2d(q, k, v)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), brute_force(q, k, v), rtol=0, atol=2e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = criss_cross_attention_2d(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert float((low.double() - brute_force(q.bfloat16(), k.bfloat16(), v.bfloat16())).abs().max()) < 0.02


def test_auto_and_the_registry():
    q, _, _ = _inputs(1, 1, 2, 2, 1, 1)
    assert auto_criss_cross_attention_impl(q) == "materialized"
    assert CRISS_CROSS_BACKENDS.impls() == ("auto", "materialized")
    assert CRISS_CROSS_BACKENDS.exportable() == ("auto", "materialized")
    import aadet.layers.functional.criss_cross as cc

    assert CRISS_CROSS_BACKENDS.describe() in cc.__doc__


def test_functional_errors():
    q, k, v = _inputs(1, 1, 3, 4, 2, 2)
    with pytest.raises(ValueError, match=r"q, k, v must be \[B, Nh, H, W, d\]"):
        criss_cross_attention_2d(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="k must have the shape of q"):
        criss_cross_attention_2d(q, k[..., :1], v)
    with pytest.raises(ValueError, match=r"v must be \[B, Nh, H, W, dv\] with q's first four dims"):
        criss_cross_attention_2d(q, k, v[:, :, :2])
    with pytest.raises(ValueError, match="H, W, d, dv >= 1"):
        criss_cross_attention_2d(q[:, :, :0], k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match="q, k, v must share one dtype"):
        criss_cross_attention_2d(q, k.float(), v)
    with pytest.raises(ValueError, match="floating point; got torch.int64"):
        criss_cross_attention_2d(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'materialized'\); got 'fused'"):
        criss_cross_attention_2d(q, k, v, impl="fused")


# ----------------------------------------------------------------------------- the modules
def reference_forward(module, x):
    """A :class:`CrissCrossAttention2d` or :class:`RecurrentCrissCrossAttention` forward written
    out with the brute force (the mutation harness's reference too)."""
    if isinstance(module, RecurrentCrissCrossAttention):
        y = module.conva(x)
        for _ in range(module.recurrence):
            y = reference_forward(module.cca, y)
        return module.bottleneck(torch.cat([x, module.convb(y)], dim=1))
    nh = module.num_heads
    q, k, v = (split_heads(proj(x), nh) for proj in (module.query, module.key, module.value))
    return x + module.gamma * merge_heads(brute_force(q, k, v))


def _block(channels=8, gamma=0.5, **kwargs):
    torch.manual_seed(0)
    block = CrissCrossAttention2d(channels, **kwargs).double()
    with torch.no_grad():
        block.gamma.fill_(gamma)
    return block


def _rcca(gamma=0.5, **kwargs):
    torch.manual_seed(0)
    kwargs = {"inter_channels": 8, "reduction": 2, **kwargs}
    module = RecurrentCrissCrossAttention(8, 6, **kwargs).double()
    with torch.no_grad():
        module.cca.gamma.fill_(gamma)
    return module


@pytest.mark.parametrize("num_heads,reduction", [(1, 8), (2, 2), (4, 4)])
def test_block_matches_brute_force(num_heads, reduction):
    block = _block(16, num_heads=num_heads, reduction=reduction)
    x = torch.randn(2, 16, 5, 6, dtype=D)
    with torch.no_grad():
        torch.testing.assert_close(block(x), reference_forward(block, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("recurrence", [1, 2, 3])
def test_rcca_matches_brute_force(recurrence):
    module = _rcca(recurrence=recurrence, num_heads=2)
    x = torch.randn(2, 8, 4, 7, dtype=D)
    with torch.no_grad():
        out = module(x)
        torch.testing.assert_close(out, reference_forward(module, x), rtol=0, atol=1e-12)
    assert out.shape == (2, 6, 4, 7)


def test_gamma_zero_is_the_identity_at_init():
    block = CrissCrossAttention2d(16)
    assert block.gamma.item() == 0.0 and block.gamma.requires_grad
    x = torch.randn(2, 16, 5, 3)
    assert torch.equal(block(x), x)
    module = RecurrentCrissCrossAttention(16, 8, reduction=2)
    y = torch.randn(2, 4, 5, 3)
    assert torch.equal(module.recurrent_attention(y), y)
    x.requires_grad_(True)
    block(x).sum().backward()  # gamma learns from the first step
    assert block.gamma.grad is not None and block.gamma.grad.abs().item() > 0


def _reach(fn, x, y, xx):
    """``[H, W]``: the largest |d out[0, :, y, xx] / d x[0, c, :, :]| over channels ``c``."""
    x = x.clone().requires_grad_(True)
    out = fn(x)
    (g,) = torch.autograd.grad(out[0, :, y, xx].sum(), x)
    return g[0].abs().amax(0)


def test_reach_one_pass_is_the_cross_two_passes_the_whole_map():
    """The RCCA's shared block in float64 with random weights and gamma = 0.5: after R = 1 an
    output pixel depends on its row and column only (exactly 0 elsewhere), after R = 2 on every
    input pixel."""
    h, w, (y, xx) = 7, 9, (2, 6)
    x = torch.randn(1, 8, h, w, dtype=D)
    cross = torch.zeros(h, w, dtype=torch.bool)
    cross[y, :] = cross[:, xx] = True
    one = _reach(_rcca(recurrence=1).recurrent_attention, x, y, xx)
    two = _reach(_rcca(recurrence=2).recurrent_attention, x, y, xx)
    print(f"R=1: {int((one > 0).sum())} of {h * w} pixels reached (the cross: {h + w - 1}), "
          f"min on the cross {float(one[cross].min()):.3g}, max off it {float(one[~cross].max()):.3g}; "
          f"R=2: {int((two > 0).sum())} of {h * w}, min {float(two.min()):.3g}")
    assert torch.equal(one > 0, cross)
    assert float(one[cross].min()) > 1e-6
    assert bool((two > 1e-8).all())


def test_reach_of_the_whole_module():
    """With its 3x3 convs the RCCA (R = 1) reaches the band of +-3 rows and columns around the
    pixel's cross, not the far corner; with R = 2 the corner too (in eval mode: a training BN's
    batch statistics would join every pixel)."""
    x = torch.randn(1, 8, 11, 11, dtype=D)
    one, two = (_reach(_rcca(recurrence=r).eval(), x, 5, 5) for r in (1, 2))
    band = torch.zeros(11, 11, dtype=torch.bool)
    band[2:9, :] = band[:, 2:9] = True
    assert torch.equal(one > 0, band)
    assert bool((two > 0).all())


def test_parameter_counts():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # q, k: 64 * 8 + 8 each; v: 64 * 64 + 64; gamma: 1
    assert count(CrissCrossAttention2d(64)) == 2 * (64 * 8 + 8) + 64 * 64 + 64 + 1 == 5201
    # RCCA(64 -> 32), inter 16, q/k 2: conva 9 * 64 * 16 + BN 32; the block 2 * (16 * 2 + 2) +
    # 16 * 16 + 16 + 1; convb 9 * 16 * 16 + 32; bottleneck 9 * 80 * 32 + 64
    assert count(RecurrentCrissCrossAttention(64, 32)) == 35029
    # the paper's head on a 2048-channel res5: inter 512, 512 out (the recurrence adds none)
    assert count(RecurrentCrissCrossAttention(2048, 512)) == 23924353
    assert count(RecurrentCrissCrossAttention(2048, 512, recurrence=5)) == 23924353
    # no norm: each conv gets a bias instead of the BN's weight and bias
    assert count(RecurrentCrissCrossAttention(64, 32, norm="")) == 35029 - (32 + 32 + 64) + (16 + 16 + 32)
    # a 1x1 bottleneck: 80 * 32 weights instead of 9 * 80 * 32
    assert count(RecurrentCrissCrossAttention(64, 32, bottleneck_kernel_size=1)) == 35029 - 8 * 80 * 32


def test_bottleneck_kernel_size():
    x = torch.randn(2, 16, 5, 7, dtype=D)
    for k in (1, 3, 5):
        module = RecurrentCrissCrossAttention(16, 8, reduction=2, bottleneck_kernel_size=k).to(D)
        assert module.bottleneck.conv.kernel_size == (k, k) and module(x).shape == (2, 8, 5, 7)
        assert f"bottleneck_kernel_size={k}" in repr(module)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: CrissCrossAttention2d(0), "channels must be an integer >= 1; got 0"),
        (lambda: CrissCrossAttention2d(16, reduction=0), "reduction must be an integer in [1, channels=16]"),
        (lambda: CrissCrossAttention2d(16, reduction=32), "reduction must be an integer in [1, channels=16]"),
        (lambda: CrissCrossAttention2d(16, reduction=2.0), "reduction must be an integer in [1, channels=16]"),
        (lambda: CrissCrossAttention2d(16, num_heads=3, reduction=2),
         "num_heads must be a divisor of channels // reduction = 8 (the q/k width); got 3"),
        (lambda: CrissCrossAttention2d(16, num_heads=0), "num_heads must be an integer >= 1; got 0"),
        (lambda: CrissCrossAttention2d(16, num_heads=4), "num_heads must be a divisor of channels // reduction = 2"),
        (lambda: CrissCrossAttention2d(16, impl="fused"), "impl must be one of ('auto', 'materialized'); got 'fused'"),
        (lambda: RecurrentCrissCrossAttention(0, 8), "in_channels must be an integer >= 1; got 0"),
        (lambda: RecurrentCrissCrossAttention(8, 0), "out_channels must be an integer >= 1; got 0"),
        (lambda: RecurrentCrissCrossAttention(3, 8),
         "inter_channels must be an integer >= 1 (None means in_channels // 4, which is 0 for in_channels=3)"),
        (lambda: RecurrentCrissCrossAttention(8, 8, inter_channels=0), "inter_channels must be an integer >= 1"),
        (lambda: RecurrentCrissCrossAttention(8, 8, recurrence=0), "recurrence must be an integer >= 1; got 0"),
        (lambda: RecurrentCrissCrossAttention(32, 8, reduction=16),
         "reduction must be an integer in [1, inter_channels=8]"),
        (lambda: RecurrentCrissCrossAttention(32, 8, num_heads=3, reduction=1),
         "num_heads must be a divisor of inter_channels // reduction = 8"),
        (lambda: RecurrentCrissCrossAttention(32, 8, norm="batch"), "norm must be ''"),
        (lambda: RecurrentCrissCrossAttention(32, 8, impl="cuda"), "impl must be one of"),
        (lambda: RecurrentCrissCrossAttention(32, 8, bottleneck_kernel_size=2),
         "bottleneck_kernel_size must be an odd integer >= 1; got 2"),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_wrong_input_channels():
    with pytest.raises(ValueError, match=re.escape("CrissCrossAttention2d expects [B, 8, H, W]; got (1, 4, 3, 3)")):
        CrissCrossAttention2d(8)(torch.randn(1, 4, 3, 3))
    with pytest.raises(ValueError, match=re.escape("RecurrentCrissCrossAttention expects [B, 8, H, W]")):
        _rcca()(torch.randn(1, 6, 3, 3, dtype=D))


def test_a_registered_route_is_an_impl_of_the_modules_and_the_config():
    from aadet.config import ConfigValueError, validate_aadet_config
    from aadet.engine import get_aadet_cfg

    name = "test_dummy_route"
    CRISS_CROSS_BACKENDS[name] = CRISS_CROSS_BACKENDS["materialized"]._replace(summary="a test route")
    try:
        block, dummy = _block(), _block(impl=name)
        x = torch.randn(1, 8, 3, 5, dtype=D)
        assert torch.equal(block(x), dummy(x))
        cfg = get_aadet_cfg()
        cfg.MODEL.CCNET.IMPL = name
        validate_aadet_config(cfg)
    finally:
        del CRISS_CROSS_BACKENDS[name]
    with pytest.raises(ConfigValueError, match=name):
        validate_aadet_config(cfg)


# ----------------------------------------------------------------------------- MODEL.CCNET
def test_config_defaults_are_the_papers():
    from aadet.config import CCNET_STAGES
    from aadet.engine import get_aadet_cfg
    from aadet.modeling.backbone.resnet_stages import STAGE_NAMES

    cc = get_aadet_cfg().MODEL.CCNET
    assert (cc.STAGE, cc.RECURRENCE, cc.NUM_HEADS, cc.REDUCTION, cc.INTER_CHANNELS, cc.BOTTLENECK_KERNEL_SIZE,
            cc.IMPL) == ("res4", 2, 1, 8, 0, 3, "auto")
    assert CCNET_STAGES == STAGE_NAMES


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("STAGE", "res6", "Config key MODEL.CCNET.STAGE must be one of ('res2', 'res3', 'res4', 'res5'); got 'res6'"),
        ("RECURRENCE", 0, "Config key MODEL.CCNET.RECURRENCE must be an integer >= 1; got 0"),
        ("NUM_HEADS", 0, "Config key MODEL.CCNET.NUM_HEADS must be an integer >= 1; got 0"),
        ("REDUCTION", 0, "Config key MODEL.CCNET.REDUCTION must be an integer >= 1; got 0"),
        ("INTER_CHANNELS", -1,
         "Config key MODEL.CCNET.INTER_CHANNELS must be an integer >= 0 (0 = the stage's channels // 4); got -1"),
        ("BOTTLENECK_KERNEL_SIZE", 0,
         "Config key MODEL.CCNET.BOTTLENECK_KERNEL_SIZE must be an odd integer >= 1; got 0"),
        ("IMPL", "fused", "Config key MODEL.CCNET.IMPL must be one of ('auto', 'materialized'); got 'fused'"),
    ],
)
def test_bad_config_values_name_the_key(key, value, message):
    from aadet.config import ConfigValueError, validate_aadet_config
    from aadet.engine import get_aadet_cfg

    cfg = get_aadet_cfg()
    cfg.MODEL.CCNET[key] = value
    with pytest.raises(ConfigValueError, match=re.escape(message)):
        validate_aadet_config(cfg)


# ----------------------------------------------------------------------------- export
@pytest.mark.parametrize("h,w", [(1, 6), (5, 1), (5, 7)])
def test_traced_route_matches_brute_force(h, w):
    q, k, v = _inputs(2, 2, h, w, 3, 4)
    traced = torch.jit.trace(lambda q, k, v: criss_cross_attention_2d(q, k, v), (q, k, v), check_trace=False)
    torch.testing.assert_close(traced(q, k, v), brute_force(q, k, v), rtol=0, atol=1e-12)


def _export_modules():
    torch.manual_seed(0)
    block = CrissCrossAttention2d(16, num_heads=2, reduction=4)
    rcca = RecurrentCrissCrossAttention(16, 8, reduction=2)
    for m in (block, rcca.cca):
        with torch.no_grad():
            m.gamma.fill_(0.5)
    return {"block": (block, torch.randn(2, 16, 7, 6)), "rcca": (rcca.eval(), torch.randn(2, 16, 5, 9))}


@pytest.mark.parametrize("name", ["block", "rcca"])
def test_trace_is_plain_ops_and_matches_eager(name):
    module, x = _export_modules()[name]
    traced = torch.jit.trace(module, (x,), check_trace=False)
    kinds = {node.kind() for node in traced.inlined_graph.nodes()}
    assert "prim::PythonOp" not in kinds and not any("scaled_dot_product" in k for k in kinds), sorted(kinds)
    with torch.no_grad():
        x2 = torch.randn_like(x)
        torch.testing.assert_close(traced(x2), module(x2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["block", "rcca"])
def test_onnx_opset17_matches_eager(name):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    module, x = _export_modules()[name]
    f = io.BytesIO()
    torch.onnx.export(module.eval(), (x,), f, opset_version=17, dynamo=False, input_names=["x"])
    session = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"x": x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), module(x), rtol=1e-4, atol=1e-5)
