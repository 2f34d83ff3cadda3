"""SASA local self-attention: the functional core (neighborhood and blocked routes) against a
pixel-by-pixel float64 brute force of Eq. 3, its borders/masks/gradients/low precision, and the LocalSelfAttention2d
layer (equivariance, strides, validation, FLOP formula)."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from detectron2.layers import Conv2d

from aadet.layers.functional.local_attention import (
    LOCAL_ATTENTION_BACKENDS,
    local_attention_probs_2d,
    local_self_attention_2d,
)
from aadet.layers.functional.reference import local_self_attention_2d_reference as brute_force
from aadet.layers.functional.reference import local_self_attention_2d_unfold
from aadet.layers.local_attention import LocalSelfAttention2d, merge_heads, split_heads
from aadet.layers.position_encoding import sine_2d

D = torch.float64


def _inputs(b, nh, h, w, dk, dv, ks, dtype=D, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, h, w, dk, generator=g, dtype=dtype) * scale
    k = torch.randn(b, nh, h, w, dk, generator=g, dtype=dtype) * scale
    v = torch.randn(b, nh, h, w, dv, generator=g, dtype=dtype)
    rel_h = torch.randn(ks, dk // 2, generator=g, dtype=dtype)
    rel_w = torch.randn(ks, dk - dk // 2, generator=g, dtype=dtype)
    return q, k, v, rel_h, rel_w


# ----------------------------------------------------------------------------- functional core
CASES = [  # (H, W, kernel_size, block_size)
    (5, 7, 3, 2),
    (5, 7, 5, 8),
    (9, 4, 5, 3),
    (3, 2, 7, 8),  # map smaller than the window
    (7, 7, 7, 4),
    (4, 9, 3, 1),
    (1, 1, 3, 8),
    (6, 5, 1, 4),  # k = 1: each pixel attends to itself only
]


# Every registered route but Triton's (its tests run it under the interpreter, in a subprocess).
IMPLS = [name for name in LOCAL_ATTENTION_BACKENDS if name != "triton"]


@pytest.mark.parametrize("h,w,ks,bs", CASES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("relative", [True, False])
def test_matches_brute_force(h, w, ks, bs, impl, relative):
    q, k, v, rh, rw = _inputs(2, 2, h, w, 5, 3, ks)  # odd dk: halves of 2 and 3 channels
    if not relative:
        rh = rw = None
    out = local_self_attention_2d(q, k, v, rh, rw, ks, block_size=bs, impl=impl)
    assert out.shape == (2, 2, h, w, 3)
    torch.testing.assert_close(out, brute_force(q, k, v, rh, rw, ks), rtol=0, atol=1e-12)


@pytest.mark.parametrize("h,w,ks,bs", CASES)
def test_unfold_reference_matches_brute_force(h, w, ks, bs):
    # the benchmark's vectorized reference (dev/benchmark_layers.py) is Eq. 3 too
    q, k, v, rh, rw = _inputs(2, 2, h, w, 5, 3, ks)
    out = local_self_attention_2d_unfold(q, k, v, rh, rw, ks)
    torch.testing.assert_close(out, brute_force(q, k, v, rh, rw, ks), rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", ["neighborhood", "cpp", "fused", "auto"])
def test_float32_matches_brute_force(impl):
    q, k, v, rh, rw = _inputs(1, 3, 11, 6, 8, 8, 7, dtype=torch.float32)
    out = local_self_attention_2d(q, k, v, rh, rw, 7, block_size=4, impl=impl)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), brute_force(q, k, v, rh, rw, 7), rtol=0, atol=2e-6)


def test_block_size_does_not_change_the_result():
    q, k, v, rh, rw = _inputs(1, 2, 10, 13, 4, 4, 5)
    ref = local_self_attention_2d(q, k, v, rh, rw, 5, impl="neighborhood")
    for bs in (1, 2, 3, 5, 7, 16):
        out = local_self_attention_2d(q, k, v, rh, rw, 5, block_size=bs, impl="fused")
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)


def test_zero_queries_give_the_in_map_window_mean():
    # q = 0 and no positions: uniform weights over the in-map neighbours only, i.e. exactly an
    # average pooling that does not count the padding. Zero-padded keys would pull it to 0.
    _, k, v, _, _ = _inputs(1, 1, 7, 6, 4, 3, 5)
    q = torch.zeros_like(k)
    out = local_self_attention_2d(q, k, v, None, None, 5, block_size=4)
    vmap = v[0, 0].permute(2, 0, 1)  # [dv, H, W]
    ref = F.avg_pool2d(vmap[None], 5, stride=1, padding=2, count_include_pad=False)[0]
    torch.testing.assert_close(out[0, 0].permute(2, 0, 1), ref, rtol=0, atol=1e-13)
    # corner: 3x3 in-map neighbours of the 5x5 window
    torch.testing.assert_close(out[0, 0, 0, 0], v[0, 0, :3, :3].mean((0, 1)), rtol=0, atol=1e-13)


def test_constant_values_stay_constant_at_the_border():
    # If padding got any weight (its values are 0), outputs near the border would drop below 1.
    q, k, _, rh, rw = _inputs(2, 2, 5, 9, 6, 1, 7, scale=3.0)
    v = torch.ones(2, 2, 5, 9, 1, dtype=D)
    out = local_self_attention_2d(q, k, v, rh, rw, 7, block_size=3)
    torch.testing.assert_close(out, torch.ones_like(out), rtol=0, atol=1e-13)


def test_keys_outside_the_window_have_no_influence():
    q, k, v, rh, rw = _inputs(1, 1, 9, 8, 4, 2, 3)
    base = local_self_attention_2d(q, k, v, rh, rw, 3, block_size=4)
    k2, v2 = k.clone(), v.clone()
    k2[0, 0, 6, 6] += 5.0  # a key 3 rows/cols away from (3, 3): outside its 3x3 window
    v2[0, 0, 6, 6] += 5.0
    out = local_self_attention_2d(q, k2, v2, rh, rw, 3, block_size=4)
    changed = (out - base).abs().amax(-1)[0, 0] > 0  # [H, W]
    expected = torch.zeros(9, 8, dtype=torch.bool)
    expected[5:8, 5:8] = True  # exactly the queries whose window contains (6, 6)
    assert torch.equal(changed, expected)


@pytest.mark.parametrize("h,w,ks", [(5, 7, 3), (3, 2, 7), (6, 6, 5)])
def test_probabilities_sum_to_one_over_in_map_keys(h, w, ks):
    q, k, v, rh, rw = _inputs(1, 2, h, w, 4, 3, ks, scale=2.0)
    p = local_attention_probs_2d(q, k, rh, rw, ks)  # [B, Nh, H, W, k, k]
    r = ks // 2
    torch.testing.assert_close(p.sum((-1, -2)), torch.ones(1, 2, h, w, dtype=D), rtol=0, atol=1e-12)
    for y, x in itertools.product(range(h), range(w)):
        for a, c in itertools.product(range(ks), range(ks)):
            yy, xx = y + a - r, x + c - r
            if not (0 <= yy < h and 0 <= xx < w):
                assert torch.all(p[..., y, x, a, c] == 0)
    # the probabilities reproduce the blocked output
    vp = F.pad(v, (0, 0, r, r, r, r)).unfold(2, ks, 1).unfold(3, ks, 1)  # [B, Nh, H, W, dv, k, k]
    out = torch.einsum("bnyxac,bnyxdac->bnyxd", p, vp)
    torch.testing.assert_close(out, local_self_attention_2d(q, k, v, rh, rw, ks, block_size=2),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck(impl):
    q, k, v, rh, rw = _inputs(1, 1, 4, 3, 4, 2, 3)
    args = [t.clone().requires_grad_(True) for t in (q, k, v, rh, rw)]

    def fn(q, k, v, rh, rw):
        return local_self_attention_2d(q, k, v, rh, rw, 3, block_size=2, impl=impl)

    assert torch.autograd.gradcheck(fn, args, atol=1e-7)


@pytest.mark.parametrize("impl", ["neighborhood", "cpp", "fused"])
def test_gradients_match_brute_force(impl):
    q, k, v, rh, rw = _inputs(1, 2, 5, 4, 4, 3, 5)
    a = [t.clone().requires_grad_(True) for t in (q, k, v, rh, rw)]
    b = [t.clone().requires_grad_(True) for t in (q, k, v, rh, rw)]
    g = torch.randn(1, 2, 5, 4, 3, dtype=D)
    (local_self_attention_2d(*a, 5, block_size=3, impl=impl) * g).sum().backward()
    (brute_force(*b, 5) * g).sum().backward()
    for ta, tb in zip(a, b):
        torch.testing.assert_close(ta.grad, tb.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("impl", ["neighborhood", "cpp", "fused"])
def test_large_logits_float32_still_exact(impl):
    # logits of a few hundred: masks (-inf / the finite -1e4) must still exclude out-of-window keys.
    q, k, v, rh, rw = _inputs(1, 2, 6, 7, 8, 4, 3, dtype=torch.float32, scale=6.0)
    out = local_self_attention_2d(q, k, v, rh, rw, 3, block_size=4, impl=impl)
    ref = brute_force(q, k, v, rh, rw, 3)
    assert float((q.double() * k.double()).sum(-1).abs().max()) > 100
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("impl", ["neighborhood", "cpp", "fused"])
def test_bf16_autocast_finite_and_close_to_float32(impl):
    # bf16 q, k, v, as the layer's 1x1 projections produce them under autocast.
    q, k, v, rh, rw = _inputs(2, 2, 9, 10, 16, 16, 7, dtype=torch.float32, scale=2.5)
    q, k, v = (t.bfloat16().requires_grad_(True) for t in (q, k, v))
    ref = brute_force(q.float(), k.float(), v.float(), rh.bfloat16().float(), rw.bfloat16().float(), 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = local_self_attention_2d(q, k, v, rh, rw, 7, block_size=4, impl=impl)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert float((q.detach().float() * k.detach().float()).sum(-1).abs().max()) > 60  # large content logits
    err = (out.double() - ref).abs().detach()
    # bf16 keeps 8 mantissa bits: the fused route rounds the logits (|.| ~ 60) to ~0.25; the
    # neighborhood route computes in float32 and only rounds its output.
    assert float(err.mean()) < 0.01 and float(err.max()) < 0.25, (float(err.mean()), float(err.max()))
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("impl", ["neighborhood", "cpp"])
def test_gradients_for_a_subset_of_inputs(impl):
    # Only some inputs need gradients (e.g. frozen projections): the others get None, and the
    # ones asked for equal the full computation's (the routes with their own backward).
    q, k, v, rh, rw = _inputs(1, 2, 5, 6, 4, 3, 3)
    full = [t.clone().requires_grad_(True) for t in (q, k, v, rh, rw)]
    local_self_attention_2d(*full, 3, impl=impl).sum().backward()
    for i in range(5):
        part = [t.clone().requires_grad_(j == i) for j, t in enumerate((q, k, v, rh, rw))]
        local_self_attention_2d(*part, 3, impl=impl).sum().backward()
        torch.testing.assert_close(part[i].grad, full[i].grad, rtol=0, atol=1e-12)
        assert all(part[j].grad is None for j in range(5) if j != i)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_autocast(dtype):
    q, k, v, rh, rw = (t.cuda() for t in _inputs(2, 4, 19, 23, 32, 32, 7, dtype=torch.float32, scale=2.0))
    ref = local_self_attention_2d(q, k, v, rh, rw, 7, impl="materialized")
    with torch.autocast("cuda", dtype=dtype):
        out = local_self_attention_2d(q, k, v, rh, rw, 7)
    assert torch.isfinite(out).all()
    assert float((out.float() - ref).abs().mean()) < 0.05


@pytest.mark.parametrize("impl", IMPLS + ["auto"])
def test_recompute_is_refused_by_routes_without_it_and_changes_nothing_else(impl):
    # "auto" and the routes with a recompute mode take it (same result); the others refuse it by name
    q, k, v, rh, rw = _inputs(1, 2, 5, 6, 4, 3, 3)
    if impl in LOCAL_ATTENTION_BACKENDS.recomputing():
        out = local_self_attention_2d(q, k, v, rh, rw, 3, impl=impl, recompute=True)
        torch.testing.assert_close(out, brute_force(q, k, v, rh, rw, 3), rtol=0, atol=1e-12)
    else:
        with pytest.raises(ValueError, match=rf"recompute must be False with impl='{impl}'.*'cpp'"):
            local_self_attention_2d(q, k, v, rh, rw, 3, impl=impl, recompute=True)
    assert LOCAL_ATTENTION_BACKENDS.recomputing() == ("auto", "cpp", "triton")


def test_functional_errors():
    q, k, v, rh, rw = _inputs(1, 1, 4, 4, 4, 4, 3)
    with pytest.raises(ValueError, match="kernel_size"):
        local_self_attention_2d(q, k, v, None, None, 4)
    with pytest.raises(ValueError, match="block_size"):
        local_self_attention_2d(q, k, v, rh, rw, 3, block_size=0)
    with pytest.raises(ValueError, match="rel_h"):
        local_self_attention_2d(q, k, v, rh, rw, 5)
    with pytest.raises(ValueError, match="both"):
        local_self_attention_2d(q, k, v, rh, None, 3)
    with pytest.raises(ValueError, match=r"\[B, Nh, H, W, d\]"):
        local_self_attention_2d(q[0], k[0], v[0], rh, rw, 3)
    with pytest.raises(ValueError, match="impl must be one of"):
        local_self_attention_2d(q, k, v, rh, rw, 3, impl="unfold")
    with pytest.raises(ValueError, match="recompute must be True or False; got 1"):
        local_self_attention_2d(q, k, v, rh, rw, 3, recompute=1)


# ----------------------------------------------------------------------------- the layer
def _manual_layer(layer, x):
    """The layer's forward written out with the brute force (stride 1, no bias/norm)."""
    nh, d = layer.num_heads, layer.head_channels
    x_qk = x
    if layer.positional_encoding == "sine2d":
        x_qk = x + sine_2d(x.shape[2], x.shape[3], x.shape[1], dtype=x.dtype)
    q = split_heads(layer.query(x_qk), nh) * d ** -0.5
    k = split_heads(layer.key(x_qk), nh)
    v = split_heads(layer.value(x), nh)
    return merge_heads(brute_force(q, k, v, layer.rel_h, layer.rel_w, layer.kernel_size))


@pytest.mark.parametrize("pe", ["relative", "sine2d", "none"])
def test_layer_matches_brute_force(pe):
    torch.manual_seed(0)
    layer = LocalSelfAttention2d(6, 8, kernel_size=5, num_heads=2, positional_encoding=pe,
                                 block_size=3).double()
    x = torch.randn(2, 6, 7, 5, dtype=D)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _manual_layer(layer, x), rtol=0, atol=1e-12)


def test_layer_translation_equivariance_away_from_borders():
    torch.manual_seed(0)
    layer = LocalSelfAttention2d(8, 16, kernel_size=5, num_heads=4, block_size=4).double()
    x = torch.randn(1, 8, 20, 17, dtype=D)
    dy, dx, r = 3, 2, 2
    with torch.no_grad():
        full = layer(x)
        shifted = layer(x[:, :, dy:, dx:])  # the map moved by (-dy, -dx)
    h2, w2 = shifted.shape[2:]
    inner = (slice(None), slice(None), slice(r, h2 - r), slice(r, w2 - r))
    torch.testing.assert_close(shifted[inner], full[:, :, dy:, dx:][inner], rtol=0, atol=1e-12)
    # ...and not at the border (the window is clipped differently there)
    assert float((shifted[:, :, 0, 0] - full[:, :, dy, dx]).abs().max()) > 1e-3


def test_absolute_encoding_breaks_translation_equivariance():
    torch.manual_seed(0)
    layer = LocalSelfAttention2d(8, 8, kernel_size=3, num_heads=2, positional_encoding="sine2d").double()
    x = torch.randn(1, 8, 12, 12, dtype=D)
    with torch.no_grad():
        diff = (layer(x[:, :, 2:, 2:])[:, :, 2:-2, 2:-2] - layer(x)[:, :, 4:-2, 4:-2]).abs().max()
    assert float(diff) > 1e-3


@pytest.mark.parametrize("hw", [(7, 9), (1, 1), (2, 5), (13, 6), (8, 8)])
def test_stride2_output_size_equals_detectron2_shortcut(hw):
    layer = LocalSelfAttention2d(8, 16, kernel_size=3, num_heads=2, stride=2)
    shortcut = Conv2d(8, 16, kernel_size=1, stride=2, bias=False)
    x = torch.randn(1, 8, *hw)
    assert layer(x).shape == shortcut(x).shape
    assert layer.output_size(hw) == tuple(shortcut(x).shape[2:])


def test_stride2_averages_in_map_pixels_only():
    torch.manual_seed(0)
    s1 = LocalSelfAttention2d(4, 4, kernel_size=3, num_heads=1, stride=1).double()
    s2 = LocalSelfAttention2d(4, 4, kernel_size=3, num_heads=1, stride=2).double()
    s2.load_state_dict(s1.state_dict())
    x = torch.randn(1, 4, 5, 7, dtype=D)
    with torch.no_grad():
        a, b = s1(x), s2(x)
    assert b.shape == (1, 4, 3, 4)
    torch.testing.assert_close(b[..., 0, 0], a[..., 0:2, 0:2].mean((-1, -2)))
    torch.testing.assert_close(b[..., 2, 1], a[..., 4, 2:4].mean(-1))  # last row: 1 x 2 pixels
    torch.testing.assert_close(b[..., 2, 3], a[..., 4, 6])  # corner: a single pixel


def test_layer_bias_norm_activation():
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(2, 8)
    layer = LocalSelfAttention2d(4, 8, kernel_size=3, num_heads=2, bias=True, norm=norm,
                                 activation=F.relu)
    plain = LocalSelfAttention2d(4, 8, kernel_size=3, num_heads=2)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items()
                           if not k.startswith(("norm", "bias"))})
    with torch.no_grad():
        layer.bias.fill_(0.5)
        x = torch.randn(2, 4, 6, 6)
        torch.testing.assert_close(layer(x), F.relu(norm(plain(x) + 0.5)))


def test_layer_parameters_and_init():
    layer = LocalSelfAttention2d(64, 128, kernel_size=7, num_heads=8)
    assert sum(p.numel() for p in layer.parameters()) == 3 * 64 * 128 + 7 * 8 + 7 * 8
    assert layer.rel_h.shape == (7, 8) and layer.rel_w.shape == (7, 8)
    assert abs(float(layer.rel_h.detach().std()) - 16 ** -0.5) < 0.1
    assert abs(float(layer.query.weight.detach().std()) - 64 ** -0.5) < 0.02
    odd = LocalSelfAttention2d(4, 6, kernel_size=3, num_heads=2)  # dkh = 3 -> halves 1 and 2
    assert odd.rel_h.shape == (3, 1) and odd.rel_w.shape == (3, 2)
    assert LocalSelfAttention2d(4, 8, num_heads=2, positional_encoding="none").rel_h is None


def test_flop_count_formula():
    layer = LocalSelfAttention2d(64, 128, kernel_size=7, num_heads=8, stride=2)
    f = layer.flop_count((10, 12))
    n = 120
    assert f["projections"] == 3 * n * 64 * 128
    assert f["content_logits"] == n * 49 * 128 == 8 * n * 49 * 16  # Nh * k^2 dot products of dkh
    assert f["weighted_sum"] == n * 49 * 128
    assert f["relative_logits"] == n * 8 * 2 * 7 * 8  # Nh heads x 2k dot products of dkh/2
    assert f["pooling"] == n * 128
    assert f["total"] == sum(v for key, v in f.items() if key != "total") == 4_577_280
    assert layer.flop_count((10, 12), batch=3) == {key: 3 * v for key, v in f.items()}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kernel_size=4), "kernel_size"),
        (dict(kernel_size=0), "kernel_size"),
        (dict(num_heads=3), "num_heads"),
        (dict(stride=3), "stride"),
        (dict(positional_encoding="sine"), "positional_encoding"),
        (dict(num_heads=16), "2 channels per head"),
        (dict(block_size=0), "block_size"),
        (dict(impl="cuda"), "impl"),
        (dict(recompute_attention="yes"), "recompute_attention must be True or False"),
        (dict(recompute_attention=True, impl="neighborhood"), "recompute_attention must be False with impl"),
    ],
)
def test_layer_validation(kwargs, match):
    args = dict(in_channels=8, out_channels=16, kernel_size=3, num_heads=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        LocalSelfAttention2d(**args)


def test_layer_recompute_attention_reaches_the_kernel_and_keeps_the_state_dict(monkeypatch):
    import aadet.layers.local_attention as layer_module

    calls = []
    unchecked = layer_module.local_self_attention_2d_unchecked
    monkeypatch.setattr(layer_module, "local_self_attention_2d_unchecked",
                        lambda *args: calls.append(args[-1]) or unchecked(*args))
    torch.manual_seed(0)
    plain = LocalSelfAttention2d(8, 16, kernel_size=3, num_heads=2).double()
    recompute = LocalSelfAttention2d(8, 16, kernel_size=3, num_heads=2, recompute_attention=True).double()
    recompute.load_state_dict(plain.state_dict(), strict=True)
    assert list(recompute.state_dict()) == list(plain.state_dict())
    x = torch.randn(1, 8, 6, 5, dtype=D)
    with torch.no_grad():
        torch.testing.assert_close(recompute(x), _manual_layer(recompute, x), rtol=0, atol=1e-12)
        plain(x)
    assert calls == [True, False]
    assert "recompute_attention=True" in repr(recompute)


def test_layer_rejects_wrong_input_channels():
    with pytest.raises(ValueError, match=r"\[B, 8, H, W\]"):
        LocalSelfAttention2d(8, 16, kernel_size=3, num_heads=2)(torch.randn(1, 4, 5, 5))


# ----------------------------------------------------------------------------- export
def _export_layers():
    from aadet.layers import AugmentedConv2d, SpatiallyAwareAttentionStem

    torch.manual_seed(0)
    return {
        "sasa": (LocalSelfAttention2d(8, 16, kernel_size=5, num_heads=2, block_size=4),
                 torch.randn(2, 8, 11, 9)),
        "aa": (AugmentedConv2d(8, 16, dk=8, dv=8, num_heads=2, max_size=16),
               torch.randn(2, 8, 11, 9)),
        "aa_chunked": (AugmentedConv2d(8, 16, dk=8, dv=8, num_heads=2, max_size=16, query_chunk=13),
                       torch.randn(2, 8, 7, 6)),
        "stem": (SpatiallyAwareAttentionStem(3, 16, num_heads=2, norm=""),
                 torch.randn(2, 3, 13, 10)),
        "stem_projected": (SpatiallyAwareAttentionStem(8, 8, num_heads=2, norm=""),
                           torch.randn(2, 8, 9, 9)),
    }


@pytest.mark.parametrize("name", ["sasa", "aa", "aa_chunked", "stem", "stem_projected"])
def test_trace_takes_plain_op_routes_and_matches_eager(name):
    """Under torch.jit.trace ``impl="auto"`` takes the materialized routes: the graph has no
    custom autograd Function (``prim::PythonOp``) and no SDPA (ONNX opset 17 has neither), and
    gives eager's numbers (eager runs the neighborhood / fused routes)."""
    layer, x = _export_layers()[name]
    layer.eval()
    # Traced with autograd on (the parameters require grad), so that a custom Function would be
    # recorded as one opaque PythonOp rather than inlined.
    traced = torch.jit.trace(layer, (x,), check_trace=False)
    kinds = {node.kind() for node in traced.inlined_graph.nodes()}
    assert "prim::PythonOp" not in kinds, sorted(kinds)
    assert not any("scaled_dot_product" in kind for kind in kinds), sorted(kinds)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), layer(x), rtol=1e-5, atol=1e-5)
        x2 = torch.randn_like(x)  # the traced graph is a function of the input, not a constant
        torch.testing.assert_close(traced(x2), layer(x2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h,w,ks,bs", CASES[:4])
def test_traced_route_matches_brute_force(h, w, ks, bs):
    # the export route (materialized halo blocks, windows gathered by index) is exact too
    q, k, v, rh, rw = _inputs(2, 2, h, w, 5, 3, ks)

    def fn(q, k, v, rh, rw):
        return local_self_attention_2d(q, k, v, rh, rw, ks, block_size=bs)

    traced = torch.jit.trace(fn, (q, k, v, rh, rw), check_trace=False)
    torch.testing.assert_close(traced(q, k, v, rh, rw), brute_force(q, k, v, rh, rw, ks),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["sasa", "aa", "stem"])
def test_onnx_export_opset17(name):
    import io

    layer, x = _export_layers()[name]
    f = io.BytesIO()
    torch.onnx.export(layer.eval(), (x,), f, opset_version=17, dynamo=False)  # TorchScript exporter
    assert len(f.getvalue()) > 1000
