"""SASA's spatially-aware attention stem: block attention vs a float64 brute force, the value
mixture, output size/stride equal to Detectron2's BasicStem, freezing and validation."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from detectron2.layers import FrozenBatchNorm2d
from detectron2.modeling.backbone.resnet import BasicStem

from aadet.layers.attention_stem import SpatiallyAwareAttentionStem
from aadet.layers.functional.local_attention import block_self_attention_2d
from aadet.layers.local_attention import merge_heads, split_heads

D = torch.float64


def brute_block_attention(q, k, v, rel_h, rel_w, b):
    """Every pixel attends to the in-map pixels of its own b x b block (float64, pixel loop)."""
    bsz, nh, h, w, dk = q.shape
    out = torch.zeros(bsz, nh, h, w, v.shape[-1], dtype=D)
    for bi, n, y, x in itertools.product(range(bsz), range(nh), range(h), range(w)):
        y0, x0 = y // b * b, x // b * b
        logits, values = [], []
        for yy in range(y0, min(h, y0 + b)):
            for xx in range(x0, min(w, x0 + b)):
                logit = q[bi, n, y, x].double() @ k[bi, n, yy, xx].double()
                if rel_h is not None:
                    logit = logit + q[bi, n, y, x, : dk // 2].double() @ rel_h[yy - y + b - 1].double()
                    logit = logit + q[bi, n, y, x, dk // 2:].double() @ rel_w[xx - x + b - 1].double()
                logits.append(logit)
                values.append(v[bi, n, yy, xx].double())
        p = torch.softmax(torch.stack(logits), 0)
        out[bi, n, y, x] = (p[:, None] * torch.stack(values)).sum(0)
    return out


@pytest.mark.parametrize("h,w,b", [(5, 7, 4), (9, 4, 3), (3, 2, 4), (8, 8, 4), (4, 6, 1)])
@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("impl", ["materialized", "fused"])
def test_block_attention_matches_brute_force(h, w, b, relative, impl):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, h, w, 5, generator=g, dtype=D)
    k = torch.randn(2, 2, h, w, 5, generator=g, dtype=D)
    v = torch.randn(2, 2, h, w, 3, generator=g, dtype=D)
    rh = torch.randn(2 * b - 1, 2, generator=g, dtype=D) if relative else None
    rw = torch.randn(2 * b - 1, 3, generator=g, dtype=D) if relative else None
    out = block_self_attention_2d(q, k, v, rh, rw, b, impl=impl)
    torch.testing.assert_close(out, brute_block_attention(q, k, v, rh, rw, b), rtol=0, atol=1e-12)


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


def test_stem_forward_matches_brute_force():
    torch.manual_seed(0)
    stem = SpatiallyAwareAttentionStem(3, 8, block_size=4, num_heads=2, norm="").double()
    x = torch.randn(1, 3, 9, 6, dtype=D)
    with torch.no_grad():
        q = split_heads(stem.query(x), 2) * 4 ** -0.5
        k = split_heads(stem.key(x), 2)
        v = split_heads(stem._values(x), 2)
        att = F.relu(merge_heads(brute_block_attention(q, k, v, stem.rel_h, stem.rel_w, 4)))
        out = stem(x)
    assert out.shape == (1, 8, 3, 2)
    for by, bx in itertools.product(range(3), range(2)):  # max over the in-map part of each block
        ref = att[:, :, 4 * by: 4 * by + 4, 4 * bx: 4 * bx + 4].amax((-1, -2))
        torch.testing.assert_close(out[:, :, by, bx], ref, rtol=0, atol=1e-12)


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
    with pytest.raises(ValueError, match="norm"):
        SpatiallyAwareAttentionStem(norm="GN")


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
    assert f["relative_logits"] == n * 7 * 64
    assert f["total"] == 55_296 + 12_288 + 2 * 98_304 + 43_008
