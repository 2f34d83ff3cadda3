"""SASA's spatially-aware attention stem: block attention vs a float64 brute force, the value
mixture, output size/stride equal to Detectron2's BasicStem, freezing and validation."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from detectron2.layers import FrozenBatchNorm2d
from detectron2.modeling.backbone.resnet import BasicStem

from aadet.layers.attention_stem import SpatiallyAwareAttentionStem
from aadet.layers.functional.blocks import (
    block_attention,
    block_padding_mask,
    block_self_attention_2d,
    blocks_to_map,
    map_to_blocks,
)
from aadet.layers.functional.reference import block_self_attention_2d_reference as brute_block_attention
from aadet.layers.local_attention import merge_heads, split_heads

D = torch.float64


@pytest.mark.parametrize("h,w,b", [(5, 7, 4), (9, 4, 3), (3, 2, 4), (8, 8, 4), (4, 6, 1)])
@pytest.mark.parametrize("relative", [True, False])
def test_block_attention_matches_brute_force(h, w, b, relative):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, h, w, 5, generator=g, dtype=D)
    k = torch.randn(2, 2, h, w, 5, generator=g, dtype=D)
    v = torch.randn(2, 2, h, w, 3, generator=g, dtype=D)
    rh = torch.randn(2 * b - 1, 2, generator=g, dtype=D) if relative else None
    rw = torch.randn(2 * b - 1, 3, generator=g, dtype=D) if relative else None
    out = block_self_attention_2d(q, k, v, rh, rw, b)
    torch.testing.assert_close(out, brute_block_attention(q, k, v, rh, rw, b), rtol=0, atol=1e-12)


def test_block_layout_helpers():
    x = torch.randn(2, 5, 7, 6, dtype=D)
    blocks = map_to_blocks(x, 4)  # per image 2 x 2 blocks of 16 pixels, zero-padded
    assert blocks.shape == (2 * 4, 16, 5)
    # image 1, block (1, 0) (index 4 + 2), pixel (a, c) = (2, 3) -> map pixel (6, 3)
    torch.testing.assert_close(blocks[4 + 2, 2 * 4 + 3], x[1, :, 6, 3], rtol=0, atol=0)
    assert float(blocks[4 + 2, 3 * 4 + 0].abs().sum()) == 0  # map row 7: padding
    torch.testing.assert_close(blocks_to_map(blocks, 2, (7, 6), 4), x, rtol=0, atol=0)
    mask = block_padding_mask((7, 6), 4)
    assert mask.shape == (4, 1, 1, 16)
    assert int(mask.sum()) == 16 * 4 - 7 * 6  # exactly the padded pixels
    assert block_padding_mask((8, 4), 4) is None


def test_block_attention_gradcheck_with_padding_mask():
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(3, 2, 9, 4, generator=g, dtype=D) for _ in range(2))
    v = torch.randn(3, 2, 9, 3, generator=g, dtype=D)
    rh, rw = (torch.randn(5, 2, generator=g, dtype=D) for _ in range(2))
    mask = torch.zeros(3, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = True  # block 1: its last row is outside the map
    args = [t.requires_grad_(True) for t in (q, k, v, rh, rw)]
    out = block_attention(*args, 3, mask)
    # masked keys get no weight: changing them does not change the output
    v2 = v.detach().clone()
    v2[1, :, 6:] += 10.0
    torch.testing.assert_close(block_attention(q, k, v2, rh, rw, 3, mask), out, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: block_attention(*t, 3, mask), args)


def test_mixture_weights_are_a_softmax_per_position():
    torch.manual_seed(0)
    stem = SpatiallyAwareAttentionStem(3, 16, block_size=4, num_mixtures=5, embedding_dim=8)
    with torch.no_grad():
        p = stem.mixture_weights()
    assert p.shape == (4, 4, 5)
    assert torch.all(p > 0)
    torch.testing.assert_close(p.sum(-1), torch.ones(4, 4))
    # p(a, b, m) = softmax_m((emb_row(a) + emb_col(b)) . nu_m), element by element
    a, b = 2, 3
    with torch.no_grad():
        logits = (stem.emb_row[a] + stem.emb_col[b]) @ stem.nu.t()
    torch.testing.assert_close(p[a, b], torch.softmax(logits, 0))
    # position dependent from initialisation on
    assert float((p - p.mean((0, 1))).abs().max()) > 0.05


def test_values_are_position_dependent_mixtures():
    torch.manual_seed(0)
    stem = SpatiallyAwareAttentionStem(3, 8, block_size=4, num_mixtures=3).double()
    x = torch.randn(2, 3, 7, 6, dtype=D)
    with torch.no_grad():
        v = stem._values(x)  # [B, 8, H, W]
        p = stem.mixture_weights()
        for y, xx in itertools.product(range(7), range(6)):
            w_eff = (p[y % 4, xx % 4][:, None, None] * stem.value_weight).sum(0)  # [out, in]
            torch.testing.assert_close(v[:, :, y, xx], x[:, :, y, xx] @ w_eff.t(), rtol=0, atol=1e-12)


def reference_attention(stem: SpatiallyAwareAttentionStem, x: torch.Tensor) -> torch.Tensor:
    """The stem's attention ``[B, out, H, W]`` (before norm, ReLU and pooling) written out with
    the float64 brute force of block attention (differentiable in ``x`` and every parameter)."""
    c, nh, b = stem.out_channels, stem.num_heads, stem.block_size
    q = split_heads(stem.query(x), nh) * (c // nh) ** -0.5
    k = split_heads(stem.key(x), nh)
    v = split_heads(stem._values(x), nh)
    return merge_heads(brute_block_attention(q, k, v, stem.rel_h, stem.rel_w, b))


def reference_stem(stem: SpatiallyAwareAttentionStem, x: torch.Tensor) -> torch.Tensor:
    """The stem (without norm) written out with the float64 brute force of block attention, then
    ReLU and a max over the in-map part of each ``b x b`` block."""
    b = stem.block_size
    att = F.relu(reference_attention(stem, x))
    return F.max_pool2d(att, kernel_size=b, stride=b, ceil_mode=True)


@pytest.mark.parametrize(
    "out_channels,num_heads,impl", [(8, 2, "projected"), (32, 1, "factorized"), (32, 2, "factorized")]
)
def test_stem_forward_matches_brute_force(out_channels, num_heads, impl):
    # The PyTorch routes (what auto takes off CPU); the C++ route: test_stem_cpp.py.
    torch.manual_seed(0)
    c, nh = out_channels, num_heads
    stem = SpatiallyAwareAttentionStem(3, c, block_size=4, num_heads=nh, norm="", impl=impl).double()
    x = torch.randn(1, 3, 9, 6, dtype=D)
    with torch.no_grad():
        q = split_heads(stem.query(x), nh) * (c // nh) ** -0.5
        k = split_heads(stem.key(x), nh)
        v = split_heads(stem._values(x), nh)
        att = F.relu(merge_heads(brute_block_attention(q, k, v, stem.rel_h, stem.rel_w, 4)))
        out = stem(x)
        torch.testing.assert_close(out, reference_stem(stem, x), rtol=0, atol=1e-12)
    assert out.shape == (1, c, 3, 2)
    for by, bx in itertools.product(range(3), range(2)):  # max over the in-map part of each block
        ref = att[:, :, 4 * by: 4 * by + 4, 4 * bx: 4 * bx + 4].amax((-1, -2))
        torch.testing.assert_close(out[:, :, by, bx], ref, rtol=0, atol=1e-12)


def test_relu_after_pooling_keeps_values_and_gradients():
    """The stem pools before its ReLU: the same values and gradients as norm -> ReLU -> pool,
    here with a negative norm bias, so that whole windows are negative (and get no gradient)."""
    torch.manual_seed(0)
    stem = SpatiallyAwareAttentionStem(3, 32, block_size=4, num_heads=2, norm="GN", impl="projected").double()
    with torch.no_grad():
        stem.norm.bias.fill_(-0.8)
        stem.norm.weight.uniform_(-1.5, 1.5)
    x = torch.randn(2, 3, 10, 7, dtype=D, requires_grad=True)
    g = torch.randn(2, 32, 3, 2, dtype=D)

    def grads(fn):
        stem.zero_grad()
        x.grad = None
        out = fn()
        (out * g).sum().backward()
        return out.detach(), [x.grad.clone()] + [p.grad.clone() for p in stem.parameters()]

    out, got = grads(lambda: stem(x))
    ref, want = grads(lambda: F.max_pool2d(F.relu(stem.norm(reference_attention(stem, x))), 4, 4, ceil_mode=True))
    assert 0.1 < (ref == 0).double().mean() < 0.9  # windows with no positive value, and others
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("pe", ["relative", "none"])
def test_stem_routes_agree_values_and_gradients(pe):
    # The factorized and projected routes are the same function of the parameters.
    torch.manual_seed(0)
    stem = SpatiallyAwareAttentionStem(3, 12, block_size=3, num_heads=3, positional_encoding=pe,
                                       norm="").double()
    xb = map_to_blocks(torch.randn(2, 3, 7, 5, dtype=D), 3)
    mask = block_padding_mask((7, 5), 3).repeat(2, 1, 1, 1)
    outs, grads = [], []
    for route in (stem._attend_factorized, stem._attend_projected):
        stem.zero_grad()
        out = route(xb, mask)
        (out * torch.linspace(-1, 1, out.numel(), dtype=D).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in stem.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) >= 6
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-11, msg=name)


@pytest.mark.parametrize("hw", [(37, 50), (33, 33), (3, 2), (64, 64), (1, 9), (30, 31)])
def test_output_size_equals_basic_stem(hw):
    stem = SpatiallyAwareAttentionStem()
    basic = BasicStem(3, 64, norm="BN")
    x = torch.randn(2, 3, *hw)
    assert stem(x).shape == basic(x).shape
    assert stem.stride == basic.stride == 4
    assert stem.out_channels == basic.out_channels == 64


def test_stem_trains_every_parameter():
    torch.manual_seed(0)
    stem = SpatiallyAwareAttentionStem(3, 16, num_heads=2)
    stem(torch.randn(2, 3, 21, 18)).square().mean().backward()
    for name, p in stem.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name


def test_norm_options():
    assert isinstance(SpatiallyAwareAttentionStem(norm="BN").norm, torch.nn.BatchNorm2d)
    assert SpatiallyAwareAttentionStem(norm="").norm is None
    assert isinstance(SpatiallyAwareAttentionStem(norm=lambda c: torch.nn.GroupNorm(4, c)).norm,
                      torch.nn.GroupNorm)
    gn = torch.nn.GroupNorm(8, 64)
    assert SpatiallyAwareAttentionStem(norm=gn).norm is gn
    # Detectron2's names, as plain values (a LazyConfig writes norm="GN")
    assert isinstance(SpatiallyAwareAttentionStem(norm="GN").norm, torch.nn.GroupNorm)
    with pytest.raises(ValueError, match="norm"):
        SpatiallyAwareAttentionStem(norm="XN")


def test_freeze():
    stem = SpatiallyAwareAttentionStem().freeze()
    assert not any(p.requires_grad for p in stem.parameters())
    assert isinstance(stem.norm, FrozenBatchNorm2d)
    assert stem(torch.randn(1, 3, 10, 10)).shape == (1, 64, 3, 3)


def test_parameter_count():
    stem = SpatiallyAwareAttentionStem(3, 64, block_size=4, num_heads=1, num_mixtures=4, embedding_dim=64)
    expected = 2 * 64 * 3 + 4 * 64 * 3 + 2 * 4 * 64 + 4 * 64 + 7 * 32 * 2 + 2 * 64  # q,k,W_V^m,emb,nu,rel,BN
    assert sum(p.numel() for p in stem.parameters()) == expected


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_heads=3), "num_heads"),
        (dict(block_size=0), "block_size"),
        (dict(num_mixtures=0), "num_mixtures"),
        (dict(positional_encoding="absolute"), "positional_encoding"),
        (dict(out_channels=4, num_heads=4), "2 channels per head"),
        (dict(embedding_dim=0), "embedding_dim"),
        (dict(impl="fused"), r"impl must be one of \('auto', 'factorized', 'projected', 'cpp'\); got 'fused'"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpatiallyAwareAttentionStem(**kwargs)


def test_rejects_wrong_input_channels():
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        SpatiallyAwareAttentionStem()(torch.randn(1, 4, 8, 8))


def test_flop_count_formula():
    stem = SpatiallyAwareAttentionStem(3, 64, block_size=4, num_mixtures=4)
    f = stem.flop_count((8, 12))
    n = 96
    assert f["projections"] == 3 * n * 3 * 64
    assert f["value_mixing"] == 16 * 4 * 64 * 3
    assert f["content_logits"] == f["weighted_sum"] == n * 16 * 64
    assert f["relative_logits"] == n * 4 * 64  # b row + b column offsets of dkh / 2
    assert f["total"] == 55_296 + 12_288 + 2 * 98_304 + 24_576
    f2 = stem.flop_count((8, 12), batch=2)  # the b^2 mixed value matrices: once per call
    assert f2["value_mixing"] == f["value_mixing"]
    assert f2["total"] == 2 * f["total"] - f["value_mixing"]


def test_implementation_flop_count_never_builds_the_kernel(monkeypatch):
    """Counting (analysis, the generated model table) must not depend on a compiler: ``"auto"``
    counts its CPU route, the C++ kernel's, without asking whether the kernel builds."""
    from aadet.layers.functional.backends import stem_cpp

    def refuse():
        raise AssertionError("FLOP counting asked for the kernel")

    monkeypatch.setattr(stem_cpp.KERNEL, "available", refuse)
    stem = SpatiallyAwareAttentionStem(3, 64, block_size=4, num_mixtures=4)
    counts = {route: stem.implementation_flop_count((8, 12), route=route)
              for route in ("cpp", "factorized", "projected")}
    assert stem.implementation_flop_count((8, 12)) == counts["cpp"]
    assert len(set(counts.values())) == 3  # each route counts its own work
    fixed = SpatiallyAwareAttentionStem(3, 64, block_size=4, num_mixtures=4, impl="projected")
    assert fixed.implementation_flop_count((8, 12)) == counts["projected"]
    with pytest.raises(ValueError, match="route"):
        stem.implementation_flop_count((8, 12), route="auto")
