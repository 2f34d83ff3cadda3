"""HaloNet's layer, :class:`aadet.layers.HaloSelfAttention2d`: against a float64 brute force of its
own (projections, heads, scaling, relative embeddings and the attention downsampling written out
pixel by pixel from the paper's definition), values and every gradient, on every route; SASA's
layer as its b = 1 case; parameters, init, FLOP formula, argument errors at construction."""
import pytest
import torch
from torch import nn

from aadet.layers import HALO_ATTENTION_BACKENDS, HaloSelfAttention2d, LocalSelfAttention2d
from aadet.layers.functional import halo_attention_probs_2d

D = torch.float64
IMPLS = [name for name in HALO_ATTENTION_BACKENDS if name != "triton"]  # float64: triton has its own tests


def brute_force(layer: HaloSelfAttention2d, x: torch.Tensor) -> torch.Tensor:
    """The layer's output, query by query: query ``(y', x')`` sits at pixel ``(s y', s x')`` of
    ``x``; its keys are the in-map pixels of the window ``[Y b - h, Y b + b + h)`` (rows,
    likewise columns) of the block ``(Y, X)`` holding that pixel; logits ``q . k + q[:d/2] .
    rel_h[a - s y' + b + h - 1] + q[d/2:] . rel_w[c - s x' + b + h - 1]``, ``q`` scaled by
    ``dkh ** -0.5``; heads concatenated, then bias, norm and activation."""
    wq, wk, wv = (p.weight[:, :, 0, 0] for p in (layer.query, layer.key, layer.value))
    bs, hs, s, nh, d = layer.block_size, layer.halo_size, layer.stride, layer.num_heads, layer.head_channels
    batch, _, h, w = x.shape
    ho, wo = -(-h // s), -(-w // s)
    out = x.new_zeros(batch, layer.out_channels, ho, wo)
    for n in range(batch):
        for yo in range(ho):
            for xo in range(wo):
                py, px = s * yo, s * xo
                a0, c0 = (py // bs) * bs - hs, (px // bs) * bs - hs
                rows = [a for a in range(a0, a0 + bs + 2 * hs) if 0 <= a < h]
                cols = [c for c in range(c0, c0 + bs + 2 * hs) if 0 <= c < w]
                keys = [(a, c) for a in rows for c in cols]
                q = wq @ x[n, :, py, px]  # [C]
                pix = torch.stack([x[n, :, a, c] for a, c in keys])  # [L, C_in]
                k, v = pix @ wk.t(), pix @ wv.t()  # [L, C]
                for head in range(nh):
                    sl = slice(head * d, (head + 1) * d)
                    qh = q[sl] * d ** -0.5
                    logits = k[:, sl] @ qh
                    if layer.rel_h is not None:
                        off = bs + hs - 1
                        rh = torch.stack([layer.rel_h[a - py + off] for a, _ in keys])
                        rw = torch.stack([layer.rel_w[c - px + off] for _, c in keys])
                        logits = logits + rh @ qh[: d // 2] + rw @ qh[d // 2:]
                    out[n, sl, yo, xo] = torch.softmax(logits, 0) @ v[:, sl]
    if layer.bias is not None:
        out = out + layer.bias.view(1, -1, 1, 1)
    if layer.norm is not None:
        out = layer.norm(out)
    if layer.activation is not None:
        out = layer.activation(out)
    return out


def _layer(*args, seed=0, **kwargs):
    torch.manual_seed(seed)
    return HaloSelfAttention2d(*args, **kwargs).double()


CASES = [  # (H, W, block_size, halo_size, stride)
    (7, 9, 4, 1, 1),  # partial blocks
    (3, 2, 4, 2, 1),  # map smaller than a block
    (8, 8, 4, 2, 2),  # attention downsampling, whole blocks
    (9, 7, 4, 1, 2),  # downsampling, partial blocks, odd sizes
    (5, 6, 4, 1, 4),  # stride = block: one query per block
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("pe", ["relative", "none"])
def test_layer_matches_its_brute_force(case, pe):
    h, w, bs, hs, s = case
    layer = _layer(6, 8, block_size=bs, halo_size=hs, num_heads=2, stride=s, positional_encoding=pe)
    x = torch.randn(2, 6, h, w, dtype=D)
    out = layer(x)
    assert out.shape == (2, 8, -(-h // s), -(-w // s)) == (2, 8) + layer.output_size((h, w))
    torch.testing.assert_close(out, brute_force(layer, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stride", [1, 2])
def test_every_route_and_every_gradient_match_the_brute_force(impl, stride):
    layer = _layer(4, 6, block_size=4, halo_size=1, num_heads=2, stride=stride, impl=impl, bias=True,
                   norm=nn.GroupNorm(2, 6), activation=torch.relu, seed=1)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(1, 4, 7, 6, dtype=D, requires_grad=True)
    params = [p for p in layer.parameters()]
    cot = torch.randn(layer(x).shape, dtype=D)
    got = torch.autograd.grad((layer(x) * cot).sum(), [x] + params)
    ref = torch.autograd.grad((brute_force(layer, x) * cot).sum(), [x] + params)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    assert {"rel_h", "rel_w", "query.weight", "bias"} <= set(names)
    for name, a, b in zip(names, got, ref):
        assert float(b.abs().max()) > 0 or name in ("rel_h", "rel_w"), name
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("halo", [1, 2])
def test_block_one_is_sasa_with_kernel_2h_plus_1(halo):
    torch.manual_seed(2)
    # SASA's plain-ops route (exact, as every route): no C++ build in this file's runtime
    sasa = LocalSelfAttention2d(6, 8, kernel_size=2 * halo + 1, num_heads=2, impl="materialized").double()
    halo_layer = HaloSelfAttention2d(6, 8, block_size=1, halo_size=halo, num_heads=2).double()
    halo_layer.load_state_dict(sasa.state_dict())  # same names and shapes: k = 2(1 + h) - 1
    x = torch.randn(2, 6, 5, 7, dtype=D)
    torch.testing.assert_close(halo_layer(x), sasa(x), rtol=0, atol=1e-12)


def test_queries_keys_are_what_forward_attends_with():
    layer = _layer(4, 8, block_size=4, halo_size=1, num_heads=2, stride=2)
    x = torch.randn(1, 4, 9, 7, dtype=D)
    q, k = layer.queries_keys(x)
    assert q.shape == (1, 2, 5, 4, 4) and k.shape == (1, 2, 9, 7, 4)
    probs = halo_attention_probs_2d(q, k, layer.rel_h, layer.rel_w, 4, 1, query_stride=2)
    v = layer.value(x).view(1, 2, 4, 9, 7)  # [B, Nh, dkh, H, W]
    # The window of query (1, 1): pixel (2, 2) in block (0, 0), keys rows/cols -1..4 clipped.
    win = v[0, :, :, 0:5, 0:5]  # [Nh, dkh, 5, 5]
    out = layer(x)
    got = torch.einsum("nuv,nduv->nd", probs[0, :, 1, 1, 1:, 1:], win)
    torch.testing.assert_close(out[0, :, 1, 1].view(2, 4), got, rtol=0, atol=1e-12)


def test_parameters_and_init():
    torch.manual_seed(0)
    layer = HaloSelfAttention2d(64, 128)  # the paper's b 8, h 3, 8 heads
    assert (layer.block_size, layer.halo_size, layer.num_heads, layer.head_channels) == (8, 3, 8, 16)
    rows = 2 * (8 + 3) - 1
    assert layer.rel_h.shape == (rows, 8) and layer.rel_w.shape == (rows, 8)
    n = sum(p.numel() for p in layer.parameters())
    assert n == 3 * 64 * 128 + 2 * rows * 8
    assert layer.query.stride == (1, 1) and layer.query.bias is None
    assert abs(float(layer.query.weight.detach().std()) - 64 ** -0.5) < 0.01
    assert abs(float(layer.rel_h.detach().std()) - 16 ** -0.5) < 0.05
    strided = HaloSelfAttention2d(64, 128, stride=2, positional_encoding="none", bias=True)
    assert strided.query.stride == (2, 2) and strided.rel_h is None
    assert sum(p.numel() for p in strided.parameters()) == 3 * 64 * 128 + 128


def test_flop_count_formula():
    layer = HaloSelfAttention2d(16, 32, block_size=4, halo_size=2, num_heads=4, stride=2)
    f = layer.flop_count((10, 7), batch=2)
    nq, n, u = 5 * 4, 10 * 7, 8
    assert f == {
        "projections": 2 * (nq + 2 * n) * 16 * 32,
        "content_logits": 2 * nq * u * u * 32,
        "relative_logits": 2 * nq * u * 32,
        "weighted_sum": 2 * nq * u * u * 32,
        "total": 2 * ((nq + 2 * n) * 16 * 32 + nq * 32 * (2 * u * u + u)),
    }
    assert layer.implementation_flop_count((10, 7), batch=2) == 2 * nq * 32 * (2 * u * u + 11)


@pytest.mark.parametrize("kwargs,match", [
    (dict(in_channels=0), r"in_channels must be an integer >= 1; got 0"),
    (dict(block_size=0), r"block_size must be an integer >= 1; got 0"),
    (dict(halo_size=-1), r"halo_size must be an integer >= 0; got -1"),
    (dict(stride=3), r"stride must be a divisor of block_size=8 .*; got 3"),
    (dict(stride=0), r"stride must be an integer >= 1; got 0"),
    (dict(num_heads=3), r"num_heads must be a divisor of out_channels=16; got 3"),
    (dict(num_heads=16), r"num_heads must be at most 8 .*for positional_encoding='relative'.*; got 16"),
    (dict(positional_encoding="sine2d"), r"positional_encoding must be one of \('relative', 'none'\); got 'sine2d'"),
    (dict(impl="nope"), r"impl must be one of \('auto', 'cpp', 'bmm', 'materialized', 'fused', 'triton'\); got 'nope'"),
])
def test_bad_arguments_fail_at_construction_naming_the_argument(kwargs, match):
    args = dict(in_channels=8, out_channels=16, num_heads=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        HaloSelfAttention2d(**args)


def test_wrong_input_channels_are_named():
    with pytest.raises(ValueError, match=r"expects \[B, 8, H, W\]; got \(1, 4, 5, 5\)"):
        HaloSelfAttention2d(8, 16, num_heads=2)(torch.zeros(1, 4, 5, 5))
