"""Tests of the 2D relative self-attention core (AA paper, Sec. 3.2 and Appendix A.3).

References used here (``aadet.layers.functional.reference``):
  * a float64 pixel-by-pixel brute force written from the formula
    ``logit[(y,x),(y',x')] = q.k + q.rel_h[y'-y+H-1] + q.rel_w[x'-x+W-1]``;
  * a line-by-line PyTorch port of the paper's TensorFlow ``rel_to_abs`` /
    ``relative_logits_1d`` / ``relative_logits`` (Appendix A.3, Figures 7-8), which builds the
    full ``[B, Nh, HW, HW]`` logits by tiling.
"""
import pytest
import torch

from aadet.layers.functional import (
    relative_attention_weights_2d,
    relative_windows,
    relative_self_attention_2d,
    relative_table_for_length,
)
from aadet.layers.functional import relative_attention
from aadet.layers.functional.relative_attention import relative_logit_tables_2d
from aadet.layers.functional.reference import paper_rel_to_abs as tf_rel_to_abs
from aadet.layers.functional.reference import paper_relative_self_attention_2d as tf_self_attention
from aadet.layers.functional.reference import relative_logits_2d_reference as brute_force_logits
from aadet.layers.functional.reference import relative_self_attention_2d_reference as brute_force

SIZES = [(5, 7), (9, 4), (1, 6), (6, 1), (1, 1)]
PATHS = [("fused", 0), ("materialized", 0), ("materialized", 7), ("cpp", 0)]


def _inputs(b, nh, h, w, dk, dv, dtype=torch.float64, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, h, w, dk, generator=g, dtype=dtype) * scale
    k = torch.randn(b, nh, h, w, dk, generator=g, dtype=dtype) * scale
    v = torch.randn(b, nh, h, w, dv, generator=g, dtype=dtype)
    rel_h = torch.randn(2 * h - 1, dk, generator=g, dtype=dtype)
    rel_w = torch.randn(2 * w - 1, dk, generator=g, dtype=dtype)
    return q, k, v, rel_h, rel_w


# ----------------------------------------------------------------------------- helpers
def test_relative_windows_gather_the_offsets_and_their_gradients():
    rel = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    out = relative_windows(rel, 6)
    assert out.shape == (6, 6, 4)
    for i in range(6):
        for j in range(6):
            assert torch.equal(out[i, j], rel[j - i + 5])
    q = torch.randn(2, 3, 6, 4, dtype=torch.float64)  # the products equal the paper's rel_to_abs way
    torch.testing.assert_close(torch.einsum("bnid,ijd->bnij", q, out), tf_rel_to_abs(q @ rel.T),
                               rtol=1e-12, atol=1e-12)
    out.backward(torch.ones_like(out))
    uses = torch.tensor([6 - abs(m - 5) for m in range(11)], dtype=torch.float64)  # offsets' counts
    torch.testing.assert_close(rel.grad, uses[:, None].expand(11, 4))
    with pytest.raises(ValueError, match=r"rel must have shape \[2L-1, d\] with 2L-1 = 11"):
        relative_windows(rel[:10], 6)


@pytest.mark.parametrize("h,w", SIZES)
@pytest.mark.parametrize("which", ["both", "h_only", "w_only"])
@pytest.mark.parametrize("exporting", [False, True])
def test_logit_tables_are_each_querys_windows_with_their_gradients(h, w, which, exporting, monkeypatch):
    """``relative_logit_tables_2d`` (one matmul with both axes' embeddings, each query's window a
    strided view of it; exporting, gathered windows) against the windows' definition
    (:func:`relative_windows`): values and the gradients of ``q``, ``rel_h``, ``rel_w`` in float64,
    keys indexed by row / column."""
    monkeypatch.setattr(relative_attention, "is_exporting", lambda: exporting)
    q, _, _, rel_h, rel_w = _inputs(2, 3, h, w, 4, 4)
    rel_h, rel_w = (None if which == "w_only" else rel_h), (None if which == "h_only" else rel_w)
    leaves = [t.requires_grad_() for t in (q, rel_h, rel_w) if t is not None]
    tables, key_index = relative_logit_tables_2d(q, rel_h, rel_w)
    pos = torch.arange(h * w)
    expected, expected_index = [], []
    if rel_h is not None:
        expected.append(torch.einsum("bnyxd,yjd->bnyxj", q, relative_windows(rel_h, h)).reshape(2, 3, h * w, h))
        expected_index.append(pos // w)
    if rel_w is not None:
        expected.append(torch.einsum("bnyxd,xjd->bnyxj", q, relative_windows(rel_w, w)).reshape(2, 3, h * w, w))
        expected_index.append(pos % w)
    assert len(tables) == len(expected) and len(key_index) == len(expected)
    for t, e, idx, e_idx in zip(tables, expected, key_index, expected_index):
        torch.testing.assert_close(t, e, rtol=1e-12, atol=1e-12)
        assert torch.equal(idx, e_idx)
    up = [torch.randn_like(e) for e in expected]
    got = torch.autograd.grad(tables, leaves, up)
    want = torch.autograd.grad(expected, leaves, up)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_relative_table_for_length_centre_slice_and_clipping():
    table = torch.arange(9.0)[:, None].expand(9, 2)  # Lmax = 5, row m <-> offset m - 4
    torch.testing.assert_close(relative_table_for_length(table, 5), table)
    centre = relative_table_for_length(table, 2)[:, 0]
    torch.testing.assert_close(centre, torch.tensor([3.0, 4.0, 5.0]))
    clipped = relative_table_for_length(table, 7)[:, 0]  # offsets -6..6 clipped to -4..4
    torch.testing.assert_close(clipped, torch.tensor([0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8.0]))


# ----------------------------------------------------------------------------- core values
@pytest.mark.parametrize("h,w", SIZES)
@pytest.mark.parametrize("impl,chunk", PATHS)
def test_matches_brute_force(h, w, impl, chunk):
    q, k, v, rel_h, rel_w = _inputs(2, 3, h, w, 4, 5)
    out = relative_self_attention_2d(q, k, v, rel_h, rel_w, impl=impl, query_chunk=chunk)
    assert out.shape == (2, 3, h, w, 5) and out.dtype == torch.float64
    torch.testing.assert_close(out, brute_force(q, k, v, rel_h, rel_w), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("h,w", [(5, 7), (9, 4), (1, 6), (6, 1)])
def test_matches_paper_tensorflow_port(h, w):
    q, k, v, rel_h, rel_w = _inputs(2, 4, h, w, 3, 2, seed=1)
    ref = tf_self_attention(q, k, v, rel_h, rel_w)
    torch.testing.assert_close(brute_force(q, k, v, rel_h, rel_w), ref, rtol=1e-10, atol=1e-10)
    for impl, chunk in PATHS:
        out = relative_self_attention_2d(q, k, v, rel_h, rel_w, impl=impl, query_chunk=chunk)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("which", ["both", "h_only", "w_only"])
def test_missing_embeddings_drop_their_term(which):
    q, k, v, rel_h, rel_w = _inputs(1, 2, 5, 7, 4, 3)
    rh = None if which == "w_only" else rel_h
    rw = None if which == "h_only" else rel_w
    if which == "both":
        rh = rw = None
    for impl, chunk in PATHS:
        out = relative_self_attention_2d(q, k, v, rh, rw, impl=impl, query_chunk=chunk)
        torch.testing.assert_close(out, brute_force(q, k, v, rh, rw), rtol=1e-10, atol=1e-10)
    # Position-unaware attention equals plain softmax(q k^T) v.
    if which == "both":
        flat = lambda t: t.reshape(1, 2, 35, -1)  # noqa: E731
        plain = torch.softmax(flat(q) @ flat(k).transpose(-1, -2), -1) @ flat(v)
        torch.testing.assert_close(out, plain.reshape(1, 2, 5, 7, 3), rtol=1e-10, atol=1e-10)


def test_float32_paths_agree():
    q, k, v, rel_h, rel_w = _inputs(2, 4, 9, 11, 8, 8, dtype=torch.float32, seed=3)
    fused = relative_self_attention_2d(q, k, v, rel_h, rel_w, impl="fused")
    mat = relative_self_attention_2d(q, k, v, rel_h, rel_w, impl="materialized")
    chunked = relative_self_attention_2d(q, k, v, rel_h, rel_w, impl="materialized", query_chunk=10)
    cpp = relative_self_attention_2d(q, k, v, rel_h, rel_w, impl="cpp")
    ref = brute_force(q, k, v, rel_h, rel_w).float()
    for out in (fused, mat, chunked, cpp):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunked, mat, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl,chunk", [("fused", 0), ("materialized", 0), ("materialized", 4), ("cpp", 0)])
def test_gradcheck(impl, chunk):
    q, k, v, rel_h, rel_w = _inputs(1, 2, 3, 2, 3, 2, seed=4)
    args = tuple(t.requires_grad_() for t in (q, k, v, rel_h, rel_w))

    def fn(*a):
        return relative_self_attention_2d(*a, impl=impl, query_chunk=chunk)

    assert torch.autograd.gradcheck(fn, args)


def test_gradients_match_brute_force_float32_chunked():
    q, k, v, rel_h, rel_w = _inputs(1, 2, 4, 5, 4, 3, dtype=torch.float32, seed=5)
    g = torch.randn(1, 2, 4, 5, 3)
    grads = {}
    for name, fn in {
        "fused": lambda *a: relative_self_attention_2d(*a, impl="fused"),
        "chunked": lambda *a: relative_self_attention_2d(*a, impl="materialized", query_chunk=3),
        "cpp": lambda *a: relative_self_attention_2d(*a, impl="cpp"),
        "brute": lambda *a: brute_force(*a).float(),
    }.items():
        args = [t.clone().requires_grad_() for t in (q, k, v, rel_h, rel_w)]
        (fn(*args) * g).sum().backward()
        grads[name] = [a.grad for a in args]
    for name in ("fused", "chunked", "cpp"):
        for got, ref in zip(grads[name], grads["brute"]):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["fused", "materialized", "cpp"])
def test_bf16_autocast_large_logits(impl):
    """q, k scaled x30: content logits of magnitude ~1e3 (exp overflows without max-subtraction).

    The reference is the float64 attention of the *bf16-rounded* q, k, v (the layer's situation
    under autocast: q, k, v come out of a bf16 conv), with float32 relative tables of the
    layer's init scale (std dk ** -0.5). Tolerances, for v ~ N(0, 1):

    * fused: max abs error 0.1 and mean abs error 1e-3. SDPA runs in bf16, so every relative
      logit (|q.r| ~ 30) is rounded to bf16 (error <= 30 * 2^-9 ~ 0.06) before the float32
      accumulation; content products of bf16 inputs are exact.
    * materialized and cpp: only the output is rounded to bf16: rtol 2^-8 (atol 1e-4). With
      float32 inputs they run entirely in float32 and must match float32 to 1e-5 (materialized)
      or 1e-4 (cpp: its float32 logits of ~1e3 round by up to 6e-5, a float32 ulp there, in
      another summation order than the matmul's; measured max 3.4e-5).
    """
    q, k, v, rel_h, rel_w = _inputs(2, 4, 6, 9, 8, 8, dtype=torch.float32, scale=30.0, seed=6)
    rel_h, rel_w = rel_h * 8 ** -0.5, rel_w * 8 ** -0.5
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref16 = brute_force(q16, k16, v16, rel_h, rel_w).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = relative_self_attention_2d(q16, k16, v16, rel_h, rel_w, impl=impl)
        out32 = relative_self_attention_2d(q, k, v, rel_h, rel_w, impl=impl)  # float32 inputs
    assert out16.dtype == torch.bfloat16
    assert torch.isfinite(out16).all() and torch.isfinite(out32).all()
    err = (out16.float() - ref16).abs()
    if impl == "fused":
        assert err.max() <= 0.1 and err.mean() <= 1e-3, (err.max(), err.mean())
        # float32 inputs are cast to bf16 by autocast inside SDPA: the same rounding as q16.
        err32 = (out32.float() - ref16).abs()
        assert err32.max() <= 0.1 and err32.mean() <= 1e-3, (err32.max(), err32.mean())
    else:
        torch.testing.assert_close(out16.float(), ref16, rtol=2 ** -8, atol=1e-4)
        ref32 = brute_force(q, k, v, rel_h, rel_w).float()
        tol = 1e-4 if impl == "cpp" else 1e-5
        torch.testing.assert_close(out32.float(), ref32, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- weights
@pytest.mark.parametrize("h,w", [(5, 7), (1, 4)])
def test_attention_weights_match_brute_force(h, w):
    q, k, v, rel_h, rel_w = _inputs(2, 3, h, w, 4, 5, seed=7)
    yx = [(0, 0), (h - 1, w - 1), (h // 2, 1)]
    weights = relative_attention_weights_2d(q, k, rel_h, rel_w, yx)
    assert weights.shape == (2, 3, 3, h, w)
    logits = brute_force_logits(q, k, rel_h, rel_w)
    for p, (y, x) in enumerate(yx):
        ref = torch.softmax(logits[:, :, y, x].reshape(2, 3, -1), -1).reshape(2, 3, h, w)
        torch.testing.assert_close(weights[:, :, p], ref, rtol=1e-10, atol=1e-12)
    # Consistent with the attention output at those queries.
    out = relative_self_attention_2d(q, k, v, rel_h, rel_w)
    for p, (y, x) in enumerate(yx):
        mixed = torch.einsum("bnyx,bnyxd->bnd", weights[:, :, p], v)
        torch.testing.assert_close(mixed, out[:, :, y, x], rtol=1e-10, atol=1e-10)
    none = relative_attention_weights_2d(q, k, None, None, torch.tensor([[0, 0]]))
    torch.testing.assert_close(none.sum((-1, -2)), torch.ones(2, 3, 1, dtype=torch.float64))


def test_attention_weights_rejects_bad_positions():
    q, k, _, rel_h, rel_w = _inputs(1, 1, 3, 4, 2, 2)
    with pytest.raises(ValueError, match=r"query_yx must lie in \[0, 3\) x \[0, 4\)"):
        relative_attention_weights_2d(q, k, rel_h, rel_w, [(3, 0)])
    with pytest.raises(ValueError, match=r"query_yx must be P \(y, x\) pairs"):
        relative_attention_weights_2d(q, k, rel_h, rel_w, [(1, 2, 3)])


# ----------------------------------------------------------------------------- validation
def test_shape_errors_name_the_argument():
    q, k, v, rel_h, rel_w = _inputs(1, 2, 5, 7, 4, 3)
    with pytest.raises(ValueError, match=r"q must have shape \[B, Nh, H, W, dk\]"):
        relative_self_attention_2d(q[0], k[0], v[0], rel_h, rel_w)
    with pytest.raises(ValueError, match=r"k must have the shape of q"):
        relative_self_attention_2d(q, k[..., :3], v, rel_h, rel_w)
    with pytest.raises(ValueError, match=r"v must have shape \[B, Nh, H, W, dv\]"):
        relative_self_attention_2d(q, k, v[:, :, :4], rel_h, rel_w)
    with pytest.raises(ValueError, match=r"rel_h must have shape \[2\*H-1, dk\] = \[9, 4\]"):
        relative_self_attention_2d(q, k, v, rel_w, rel_w)
    with pytest.raises(ValueError, match=r"rel_w must have shape \[2\*W-1, dk\] = \[13, 4\]"):
        relative_self_attention_2d(q, k, v, rel_h, rel_w[:, :3])
    with pytest.raises(ValueError, match=r"query_chunk must be an integer >= 0"):
        relative_self_attention_2d(q, k, v, rel_h, rel_w, query_chunk=-1)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        relative_self_attention_2d(q, k, v, rel_h, rel_w, impl="flash")
