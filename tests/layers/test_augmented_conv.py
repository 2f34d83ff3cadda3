"""Tests of AugmentedConv2d (AA paper, Section 3 and Figure 3 / Appendix A.3 Figure 8)."""
import math

import pytest
import torch
import torch.nn.functional as F

from aadet.layers.augmented_conv import POSITIONAL_ENCODINGS, AugmentedConv2d, attention_depth
from aadet.layers.functional import relative_table_for_length
from aadet.layers.position_encoding import coord_channels, sine_2d


def _layer(**kw):
    args = dict(in_channels=6, out_channels=16, dk=8, dv=8, num_heads=2, max_size=16)
    args.update(kw)
    torch.manual_seed(args.pop("seed", 0))
    return AugmentedConv2d(**args).double()


def reference_forward(m: AugmentedConv2d, x: torch.Tensor) -> torch.Tensor:
    """The paper's ``augmented_conv2d`` written out with full ``[HW, HW]`` logits (float64).

    kqv = 1x1 conv; split k, q, v; q *= dkh^-0.5; logits = q.k + q.r^H_{y'-y} + q.r^W_{x'-x};
    softmax; combine heads; 1x1 conv; concat after the kxk conv. (stride 1, no downsampling)
    """
    b, _, h, w = x.shape
    nh, dkh, dvh = m.num_heads, m.dkh, m.dvh
    conv = F.conv2d(x, m.conv.weight, m.conv.bias, padding=m.padding, dilation=m.dilation)
    xa = x
    if m.positional_encoding == "sine2d":
        xa = x + sine_2d(h, w, x.shape[1], dtype=x.dtype)
    elif m.positional_encoding == "coordconv":
        xa = torch.cat([x, coord_channels(h, w, dtype=x.dtype).expand(b, 3, h, w)], 1)
    kqv = F.conv2d(xa, m.qkv.weight, m.qkv.bias)
    k, q, v = kqv.split([m.dk, m.dk, m.dv], 1)
    q = q * dkh ** -0.5
    heads = lambda t, d: t.reshape(b, nh, d, h * w).transpose(2, 3)  # noqa: E731  [B, Nh, HW, d]
    q, k, v = heads(q, dkh), heads(k, dkh), heads(v, dvh)
    logits = q @ k.transpose(-1, -2)  # [B, Nh, HW, HW]
    if m.positional_encoding == "relative":
        ys, xs = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
        lmax = m.max_size
        row = lambda d: d.clamp(-lmax + 1, lmax - 1) + lmax - 1  # noqa: E731  offset -> row
        r_h = m.rel_h[row(ys[None, :] - ys[:, None])]  # [HW, HW, d]: the paper's naive way
        r_w = m.rel_w[row(xs[None, :] - xs[:, None])]
        logits = logits + torch.einsum("bnid,ijd->bnij", q, r_h + r_w)
    out = torch.softmax(logits, -1) @ v  # [B, Nh, HW, dvh]
    out = out.transpose(2, 3).reshape(b, m.dv, h, w)
    out = F.conv2d(out, m.proj.weight, m.proj.bias)
    return torch.cat([conv, out], 1)


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("pe", POSITIONAL_ENCODINGS)
def test_forward_matches_paper_formula(pe):
    m = _layer(positional_encoding=pe)
    x = torch.randn(2, 6, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(m(x), reference_forward(m, x), rtol=1e-10, atol=1e-10)


def test_clip_distances_equals_a_larger_clipped_table():
    m = _layer(max_size=3, clip_distances=True)
    big = _layer(max_size=7)
    big.load_state_dict({**m.state_dict(),
                         "rel_h": relative_table_for_length(m.rel_h, 7).detach(),
                         "rel_w": relative_table_for_length(m.rel_w, 7).detach()})
    x = torch.randn(1, 6, 6, 7, dtype=torch.float64)
    torch.testing.assert_close(m(x), big(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m(x), reference_forward(m, x), rtol=1e-10, atol=1e-10)


def test_max_size_error_names_sizes_and_config_keys():
    m = _layer(max_size=4)
    m(torch.randn(1, 6, 4, 3, dtype=torch.float64))  # fits
    with pytest.raises(ValueError) as e:
        m(torch.randn(1, 6, 3, 5, dtype=torch.float64))
    msg = str(e.value)
    assert "3x5" in msg and "max_size=4" in msg
    assert (
        "raise MODEL.AA.MAX_INPUT_SIZE (or the layer's max_size) or set MODEL.AA.CLIP_DISTANCES"
        in msg
    )
    # Downsampled attention counts its own (halved) size: 9x7 -> 5x4 fits max_size 5.
    _layer(max_size=5, attention_downsample=True)(torch.randn(1, 6, 9, 7, dtype=torch.float64))
    # Non-relative encodings have no tables, hence no limit.
    _layer(max_size=1, positional_encoding="none")(torch.randn(1, 6, 5, 6, dtype=torch.float64))


def test_relative_translation_equivariance():
    """Shifting the input content shifts the output (conv and relative attention branches).

    Global attention sees the whole map, so border effects reach every query unless the
    background is inert. Construction: zero background and no qkv bias (background q = k = v =
    0), content at least R pixels from every border, and relative tables with ``max_size =
    R + 1`` and clipped distances whose two end rows are equal (every offset beyond R-1 shares
    one embedding). Then for a content query the background keys contribute a shift-invariant
    ``sum_y' exp(q.r_h) * sum_x' exp(q.r_w)`` and background queries attend uniformly, so the
    equality is exact. Absolute encodings (sine2d, coordconv) break it; "none" keeps it.
    """
    r = 4
    h, w, dy, dx = 20, 23, 3, 5
    g = torch.Generator().manual_seed(1)
    x1 = torch.zeros(1, 6, h, w, dtype=torch.float64)
    x1[0, :, 6:11, 5:11] = 2 * torch.randn(6, 5, 6, generator=g, dtype=torch.float64)
    x2 = torch.roll(x1, (dy, dx), (2, 3))  # content now at rows 9..13, cols 10..15
    diffs = {}
    for pe in POSITIONAL_ENCODINGS:
        m = _layer(positional_encoding=pe, max_size=r + 1, clip_distances=True, seed=2)
        with torch.no_grad():
            m.qkv.bias.zero_()
            if pe == "relative":
                m.rel_h.mul_(3)[-1] = m.rel_h[0]
                m.rel_w.mul_(3)[-1] = m.rel_w[0]
            y1, y2 = m(x1), m(x2)
        # Compare the overlap, with a 1-pixel margin for the 3x3 conv branch.
        shifted = y2[..., dy + 1:h - 1, dx + 1:w - 1]
        original = y1[..., 1:h - dy - 1, 1:w - dx - 1]
        diffs[pe] = (shifted - original).abs().max().item()
        if pe == "relative":
            assert y1[:, 8:].std() > 0.1  # the attention channels are not trivial
            # ... and depend on the relative term:
            with torch.no_grad():
                m.rel_h.zero_()
                assert (m(x1) - y1).abs().max() > 1e-2
    assert diffs["relative"] < 1e-12 and diffs["none"] < 1e-12, diffs
    assert diffs["sine2d"] > 1e-2 and diffs["coordconv"] > 1e-2, diffs


# ----------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("pe", POSITIONAL_ENCODINGS)
@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("downsample", [False, True])
@pytest.mark.parametrize("hw", [(9, 7), (1, 5), (6, 11)])
def test_output_size_matches_conv_branch(pe, stride, downsample, hw):
    m = _layer(positional_encoding=pe, stride=stride, attention_downsample=downsample,
               kernel_size=3 if stride < 3 else 5, dilation=1 if stride != 2 else 2)
    x = torch.randn(2, 6, *hw, dtype=torch.float64)
    y = m(x)
    ho, wo = m.conv(x).shape[-2:]
    k, s, d = m.kernel_size, stride, m.dilation
    p = d * (k - 1) // 2
    assert (ho, wo) == tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n in hw)
    assert y.shape == (2, 16, ho, wo) and m.output_size(*hw) == (ho, wo)
    gh, gw = m.attention_grid_size(*hw)
    maps = m.attention_maps(x, [(0, 0), (gh - 1, gw - 1)])
    assert maps.shape == (2, 2, 2, gh, gw)
    torch.testing.assert_close(maps.sum((-1, -2)), torch.ones(2, 2, 2, dtype=torch.float64))
    assert (gh, gw) == (((ho - 1) // 2 + 1, (wo - 1) // 2 + 1) if downsample else (ho, wo))


def test_attention_maps_reproduce_the_attention_channels():
    m = _layer()
    x = torch.randn(1, 6, 4, 5, dtype=torch.float64)
    grid = [(y, x_) for y in range(4) for x_ in range(5)]
    maps = m.attention_maps(x, grid)  # [1, Nh, 20, 4, 5]
    v = m.qkv(x)[:, 2 * m.dk:].reshape(1, 2, m.dvh, 20)  # [1, Nh, dvh, HW]
    attn = torch.einsum("bnpj,bndj->bndp", maps.reshape(1, 2, 20, 20), v).reshape(1, 8, 4, 5)
    torch.testing.assert_close(m.proj(attn), m(x)[:, 8:], rtol=1e-10, atol=1e-10)


def test_impls_agree_and_backward_reaches_every_parameter():
    torch.manual_seed(0)
    fused = AugmentedConv2d(8, 32, kappa=0.5, nu=0.25, num_heads=4, impl="fused", max_size=12)
    mat = AugmentedConv2d(8, 32, kappa=0.5, nu=0.25, num_heads=4, impl="materialized",
                          query_chunk=13, max_size=12)
    mat.load_state_dict(fused.state_dict())
    x = torch.randn(2, 8, 9, 12)
    torch.testing.assert_close(fused(x), mat(x), rtol=1e-4, atol=1e-5)
    mat(x).square().sum().backward()
    for name, p in mat.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_autocast_large_inputs_are_finite():
    torch.manual_seed(0)
    m = AugmentedConv2d(8, 32, kappa=0.5, nu=0.25, num_heads=4, max_size=12)
    x = 30 * torch.randn(2, 8, 9, 12)
    ref = m(x)
    for impl in ("fused", "materialized"):
        m.impl = impl
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        assert torch.isfinite(y).all()
        # Logits here reach |z| ~ 1e3, so bf16 input rounding may flip near-ties of the
        # softmax: compare in the mean (relative to the output scale), not per element.
        err = (y.float() - ref).abs().mean() / ref.abs().mean()
        assert err < 0.02, (impl, err)


# ----------------------------------------------------------------------------- parameters
def test_depth_rounding_rule():
    assert attention_depth(0.2, 128, 8) == 24 and attention_depth(0.1, 128, 8) == 16
    assert attention_depth(0.2, 256, 8) == 48 and attention_depth(0.1, 256, 8) == 24
    assert attention_depth(0.2, 512, 8) == 104 and attention_depth(0.1, 512, 8) == 48
    assert attention_depth(0.01, 64, 8) == 8  # at least one channel per head
    assert attention_depth(0.25, 80, 8) == 24  # 2.5 per head rounds half up
    assert attention_depth(0.2, 128, 8, min_per_head=20) == 160
    m = AugmentedConv2d(64, 128, kappa=0.2, nu=0.1)
    assert (m.dk, m.dv, m.dkh, m.dvh) == (24, 16, 3, 2)


@pytest.mark.parametrize(
    "kw",
    [
        dict(in_channels=64, out_channels=128, kappa=0.2, nu=0.1, max_size=28),
        dict(in_channels=64, out_channels=128, kappa=0.2, nu=0.1, max_size=28,
             positional_encoding="coordconv"),
        dict(in_channels=32, out_channels=48, dk=16, dv=8, num_heads=4, kernel_size=5, bias=True,
             positional_encoding="none"),
        dict(in_channels=32, out_channels=64, dk=16, dv=16, num_heads=8, groups=4,
             positional_encoding="sine2d"),
        dict(in_channels=16, out_channels=16, dk=160, dv=8, max_size=7),
    ],
)
def test_parameter_count_formula(kw):
    m = AugmentedConv2d(**kw)
    fin, fout, nh = kw["in_channels"], kw["out_channels"], m.num_heads
    k, g = m.kernel_size, kw.get("groups", 1)
    dk, dv = m.dk, m.dv
    c = 3 if m.positional_encoding == "coordconv" else 0
    expected = (
        fin // g * (fout - dv) * k * k + (fout - dv if kw.get("bias") else 0)
        + (fin + c) * (2 * dk + dv) + (2 * dk + dv)
        + dv * dv + dv
        + (2 * (2 * m.max_size - 1) * dk // nh if m.positional_encoding == "relative" else 0)
    )
    assert sum(p.numel() for p in m.parameters()) == expected
    # Minus the plain conv, biases and tables, this is exactly the paper's Eq. (4):
    # Delta = Fin Fout (2 kappa + (1 - k^2) nu + Fout / Fin nu^2) for g = 1 and no coordconv.
    if g == 1 and c == 0:
        tables = 2 * (2 * m.max_size - 1) * dk // nh if m.positional_encoding == "relative" else 0
        biases = (2 * dk + dv) + dv + (fout - dv if kw.get("bias") else 0)
        delta = expected - biases - tables - fin * fout * k * k
        kappa, nu = dk / fout, dv / fout
        eq4 = fin * fout * (2 * kappa + (1 - k * k) * nu + fout / fin * nu * nu)
        assert math.isclose(delta, eq4)


def test_relative_table_init():
    torch.manual_seed(0)
    m = AugmentedConv2d(16, 64, dk=32, dv=16, num_heads=8, max_size=300)  # dkh = 4
    assert m.rel_h.shape == m.rel_w.shape == (599, 4)
    for t in (m.rel_h, m.rel_w):
        assert abs(t.std().item() - 0.5) < 0.02 and abs(t.mean().item()) < 0.03


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kw,pattern",
    [
        (dict(in_channels=0), "in_channels"),
        (dict(out_channels=1), "out_channels"),
        (dict(kernel_size=0), "kernel_size"),
        (dict(kernel_size=2), "kernel_size must be an odd integer"),
        (dict(stride=0), "stride"),
        (dict(dilation=0), "dilation"),
        (dict(groups=0), "groups"),
        (dict(groups=4), "groups=4 must divide in_channels=6"),
        (dict(num_heads=0), "num_heads"),
        (dict(dk=0), "dk must be an integer >= 1"),
        (dict(dk=6, num_heads=4), "num_heads=4 must divide dk=6"),
        (dict(dv=6, num_heads=4), "num_heads=4 must divide dv=6"),
        (dict(dv=16), r"dv must satisfy 0 < dv < out_channels=16"),
        (dict(dv=0), "dv must be an integer >= 1"),
        (dict(dk=None, kappa=0.0), r"kappa must be > 0"),
        (dict(dv=None, nu=1.0), r"nu must be in \(0, 1\)"),
        (dict(dv=None, nu=-0.1), r"nu must be in \(0, 1\)"),
        (dict(dv=None, nu=0.9, num_heads=8),
         r"dv must satisfy 0 < dv < out_channels=16 .*; got 16 from nu=0.9"),
        (dict(positional_encoding="learned"), "positional_encoding must be one of"),
        (dict(max_size=0), "max_size"),
        (dict(min_dk_per_head=0), "min_dk_per_head"),
        (dict(impl="flash"), "impl must be one of"),
        (dict(query_chunk=-1), "query_chunk"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        _layer(**kw)


def test_bad_input_shape():
    with pytest.raises(ValueError, match=r"expects input \[B, 6, H, W\]"):
        _layer()(torch.randn(1, 5, 4, 4, dtype=torch.float64))


def test_position_encodings():
    s = sine_2d(5, 7, 10)
    assert s.shape == (10, 5, 7)
    # 10 channels: 2 timescales; rows: sin(y), sin(y/1e4), cos(y), cos(y/1e4); then columns.
    ys, xs = torch.arange(5.0)[:, None], torch.arange(7.0)[None, :]
    torch.testing.assert_close(s[0], torch.sin(ys).expand(5, 7))
    torch.testing.assert_close(s[1], torch.sin(ys / 1e4).expand(5, 7))
    torch.testing.assert_close(s[2], torch.cos(ys).expand(5, 7))
    torch.testing.assert_close(s[4], torch.sin(xs).expand(5, 7))
    torch.testing.assert_close(s[7], torch.cos(xs / 1e4).expand(5, 7))
    assert s[8:].abs().max() == 0  # 10 % 4 channels left at zero
    assert sine_2d(2, 3, 8, dtype=torch.float64).dtype == torch.float64
    c = coord_channels(3, 5)
    assert c.shape == (3, 3, 5) and c.abs().max() <= 1
    torch.testing.assert_close(c[0, 0], torch.linspace(-1, 1, 5))
    torch.testing.assert_close(c[1, :, 0], torch.tensor([-1.0, 0.0, 1.0]))
    torch.testing.assert_close(c[2, 2, 4], torch.tensor(1.0))
    torch.testing.assert_close(c[2, 1, 2], torch.tensor(0.0))
    assert coord_channels(1, 1).abs().max() == 0
    with pytest.raises(ValueError, match="channels must be >= 1"):
        sine_2d(2, 2, 0)
    with pytest.raises(ValueError, match="h and w must be >= 1"):
        coord_channels(0, 2)


# ----------------------------------------------------------------------------- FLOPs
def test_flop_count_formula():
    m = AugmentedConv2d(8, 32, 3, stride=2, dk=16, dv=8, num_heads=4, groups=2, max_size=16,
                        positional_encoding="coordconv")
    f = m.flop_count((11, 9), batch=2)
    ho, wo, n = 6, 5, 30  # "same" conv of stride 2; attention on the output grid
    assert f["conv"] == 2 * ho * wo * (8 // 2) * 24 * 9
    assert f["projections"] == 2 * (n * (8 + 3) * (2 * 16 + 8) + n * 8 * 8)  # qkv, output 1x1
    assert f["content_logits"] == 2 * n * n * 16
    assert f["relative_logits"] == 0  # coordconv: no relative logits
    assert f["weighted_sum"] == 2 * n * n * 8
    assert f["total"] == sum(v for key, v in f.items() if key != "total") == 125_280
    rel = AugmentedConv2d(8, 32, 3, dk=16, dv=8, num_heads=4, max_size=16,
                          attention_downsample=True)
    g = rel.flop_count((11, 9))
    h, w = 6, 5  # the conv's 11x9 output average pooled 3x3/2
    assert g["relative_logits"] == h * w * (h + w) * 16
    assert rel.implementation_flop_count((11, 9)) == (
        4 * 900 * (4 + 2 + 11) + 4 * 30 * (11 + 9) * 4)  # logits with h + w extra dims, tables


def test_flop_count_agrees_with_fvcore_on_the_convolutions():
    from aadet.analysis import count_flops

    m = AugmentedConv2d(8, 32, 3, stride=2, dk=16, dv=8, num_heads=4, groups=2, max_size=16,
                        positional_encoding="coordconv").eval()
    report = count_flops(m, torch.randn(2, 8, 11, 9))  # convs traced, attention by formula
    assert report.total == m.flop_count((11, 9), batch=2)["total"]


# ----------------------------------------------------------------------------- pooling
@pytest.mark.parametrize("stride", [2, 4])
@pytest.mark.parametrize("hw", [(1, 1), (2, 3), (9, 8), (16, 13)])
def test_pooling_to_the_stride_is_same_average_pooling(stride, hw):
    """The CPU route (a depthwise ones convolution over each window's in-map count) equals
    ``avg_pool2d`` with the padding excluded, in values and input gradients."""
    from aadet.layers.augmented_conv import _pool_to_stride

    torch.manual_seed(0)
    x = torch.randn(2, 3, *hw, dtype=torch.float64, requires_grad=True)
    p = stride // 2
    ref = F.avg_pool2d(x, 2 * p + 1, stride, p, count_include_pad=False)
    out = _pool_to_stride(x, stride)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0],
                               rtol=1e-12, atol=1e-12)
    assert _pool_to_stride(x, 1) is x
