"""HaloNet's blocked local attention, the functional core: every route against the pixel-by-pixel
float64 brute force (values and the gradients of q, k, v, rel_h, rel_w), SASA as its b = 1 case,
the border masks, the strided queries, low precision, export, argument errors, and the routes on
CUDA (``-m cuda``)."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from aadet.layers.functional import (
    HALO_ATTENTION_BACKENDS,
    halo_attention_2d,
    halo_attention_probs_2d,
    local_self_attention_2d,
)
from aadet.layers.functional.backends import halonet_cpp
from aadet.layers.functional.halo_attention import auto_halo_attention_impl
from aadet.layers.functional.reference import halo_attention_2d_reference as brute_force

D = torch.float64
IMPLS = [name for name in HALO_ATTENTION_BACKENDS if name != "triton"]  # triton: test_triton_halo_attention.py


def _inputs(b, nh, h, w, d, dv, block, halo, stride=1, dtype=D, seed=0, scale=1.0, relative=True):
    g = torch.Generator().manual_seed(seed)
    ho, wo = -(-h // stride), -(-w // stride)
    q = torch.randn(b, nh, ho, wo, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, nh, h, w, d, generator=g, dtype=dtype) * scale
    v = torch.randn(b, nh, h, w, dv, generator=g, dtype=dtype)
    rows = 2 * (block + halo) - 1
    rel_h = torch.randn(rows, d // 2, generator=g, dtype=dtype)
    rel_w = torch.randn(rows, d - d // 2, generator=g, dtype=dtype)
    if not relative:
        rel_h = rel_w = None
    return q, k, v, rel_h, rel_w


CASES = [  # (H, W, block_size, halo_size, query_stride)
    (5, 7, 2, 1, 1),  # partial last blocks on both axes
    (9, 4, 3, 2, 1),
    (8, 8, 4, 2, 1),  # whole blocks
    (3, 2, 4, 1, 1),  # map smaller than a block
    (2, 3, 2, 3, 1),  # map smaller than the window (8 x 8)
    (1, 1, 2, 3, 1),  # one pixel
    (10, 9, 3, 7, 1),  # halo larger than the block
    (6, 5, 2, 0, 1),  # no halo, partial blocks
    (8, 4, 4, 0, 1),  # no halo, whole blocks: nothing masked
    (7, 6, 1, 2, 1),  # b = 1: SASA's 5 x 5 windows
    (8, 8, 4, 2, 2),  # strided queries
    (9, 7, 4, 1, 2),  # strided, partial blocks
    (5, 11, 6, 2, 3),  # strided by 3
    (3, 3, 4, 2, 4),  # stride = block > map
]


def _ids(case):
    return "x".join(map(str, case[:2])) + f"-b{case[2]}h{case[3]}s{case[4]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("relative", [True, False])
def test_matches_brute_force(case, impl, relative):
    h, w, bs, hs, s = case
    q, k, v, rh, rw = _inputs(2, 2, h, w, 5, 3, bs, hs, s, relative=relative)  # odd d: 2 + 3
    out = halo_attention_2d(q, k, v, rh, rw, bs, hs, query_stride=s, impl=impl)
    assert out.shape == (2, 2, -(-h // s), -(-w // s), 3) and out.dtype == D
    torch.testing.assert_close(out, brute_force(q, k, v, rh, rw, bs, hs, s), rtol=0, atol=1e-12)


def _grads(fn, leaves, cot):
    out = fn(*leaves)
    return [out.detach()] + list(torch.autograd.grad((out * cot).sum(), leaves))


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_brute_force(case, impl):
    h, w, bs, hs, s = case
    leaves = [t.requires_grad_(True) for t in _inputs(1, 2, h, w, 4, 3, bs, hs, s, seed=1)]
    cot = torch.randn(1, 2, -(-h // s), -(-w // s), 3, generator=torch.Generator().manual_seed(2), dtype=D)
    ref = _grads(lambda *t: brute_force(*t, bs, hs, s), leaves, cot)
    got = _grads(lambda *t: halo_attention_2d(*t, bs, hs, query_stride=s, impl=impl), leaves, cot)
    for name, a, b in zip(("out", "q", "k", "v", "rel_h", "rel_w"), got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [(4, 3, 2, 1, 1), (5, 4, 2, 1, 2)], ids=_ids)
def test_gradcheck(impl, case):
    h, w, bs, hs, s = case
    args = [t.requires_grad_(True) for t in _inputs(1, 1, h, w, 4, 2, bs, hs, s)]

    def fn(q, k, v, rh, rw):
        return halo_attention_2d(q, k, v, rh, rw, bs, hs, query_stride=s, impl=impl)

    assert torch.autograd.gradcheck(fn, args, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_without_positions(impl):
    leaves = [t.requires_grad_(True) for t in _inputs(1, 2, 7, 5, 4, 3, 3, 2, relative=False)[:3]]
    cot = torch.randn(1, 2, 7, 5, 3, generator=torch.Generator().manual_seed(3), dtype=D)
    ref = _grads(lambda *t: brute_force(*t, None, None, 3, 2), leaves, cot)
    got = _grads(lambda *t: halo_attention_2d(*t, None, None, 3, 2, impl=impl), leaves, cot)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


# ----------------------------------------------------------------------------- SASA as b = 1
@pytest.mark.parametrize("h,w,ks", [(7, 6, 3), (5, 9, 5), (3, 2, 7), (6, 6, 1)])
@pytest.mark.parametrize("impl", IMPLS)
def test_block_one_is_sasa(h, w, ks, impl):
    # b = 1, h = k // 2: every pixel is a block, its window the centred k x k window clipped to
    # the map, offsets a - y + 1 + r - 1 = a - y + r: SASA's Eq. 3, its rows and its gradients.
    leaves = [t.requires_grad_(True) for t in _inputs(2, 2, h, w, 5, 3, 1, ks // 2)]
    assert leaves[3].shape[0] == ks  # 2 (b + h) - 1 = k embedding rows
    cot = torch.randn(2, 2, h, w, 3, generator=torch.Generator().manual_seed(4), dtype=D)
    sasa = _grads(lambda *t: local_self_attention_2d(*t, ks, impl="neighborhood"), leaves, cot)
    halo = _grads(lambda *t: halo_attention_2d(*t, 1, ks // 2, impl=impl), leaves, cot)
    for a, b in zip(halo, sasa):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- strided queries
@pytest.mark.parametrize("h,w,bs,hs,s", [(8, 8, 4, 2, 2), (9, 7, 4, 1, 2), (5, 11, 6, 2, 3), (7, 9, 4, 3, 4)])
@pytest.mark.parametrize("impl", IMPLS)
def test_strided_queries_are_the_full_output_subsampled(h, w, bs, hs, s, impl):
    # Query (y', x') sits at pixel (s y', s x') and keeps its block, window and offsets: the
    # strided output is the stride-1 output at every s-th pixel when q is sampled there too.
    q, k, v, rh, rw = _inputs(1, 2, h, w, 4, 3, bs, hs)
    full = halo_attention_2d(q, k, v, rh, rw, bs, hs, impl=impl)
    qs = q[:, :, ::s, ::s]
    strided = halo_attention_2d(qs, k, v, rh, rw, bs, hs, query_stride=s, impl=impl)
    torch.testing.assert_close(strided, full[:, :, ::s, ::s], rtol=0, atol=1e-12)


def test_strided_queries_leave_the_first_embedding_rows_unused():
    leaves = [t.requires_grad_(True) for t in _inputs(1, 1, 8, 8, 4, 2, 4, 1, 2)]
    for impl in IMPLS:
        grads = torch.autograd.grad(halo_attention_2d(*leaves, 4, 1, query_stride=2, impl=impl).sum(),
                                    leaves[3:])
        for g in grads:  # offsets a - 2y' >= -(b - s) - h: row s - 1 = 1 onwards
            assert torch.all(g[:1] == 0) and torch.all(g[1:].abs().sum(-1) > 0)


# ----------------------------------------------------------------------------- masks and windows
@pytest.mark.parametrize("case", [(5, 7, 2, 1, 1), (3, 2, 4, 1, 1), (9, 7, 4, 1, 2), (2, 3, 2, 3, 1)], ids=_ids)
def test_probabilities_cover_the_in_map_window_exactly(case):
    h, w, bs, hs, s = case
    q, k, v, rh, rw = _inputs(1, 2, h, w, 4, 3, bs, hs, s, scale=2.0)
    p = halo_attention_probs_2d(q, k, rh, rw, bs, hs, query_stride=s)  # [B, Nh, Ho, Wo, U, U]
    u = bs + 2 * hs
    ho, wo = -(-h // s), -(-w // s)
    assert p.shape == (1, 2, ho, wo, u, u)
    torch.testing.assert_close(p.sum((-1, -2)), torch.ones(1, 2, ho, wo, dtype=D), rtol=0, atol=1e-12)
    vp = F.pad(v, (0, 0, hs, u, hs, u))  # v's window of block (Y, X): vp[Y b + u, X b + u']
    out = torch.zeros(1, 2, ho, wo, 3, dtype=D)
    for yo, xo in itertools.product(range(ho), range(wo)):
        y0, x0 = s * yo // bs * bs, s * xo // bs * bs
        for a, c in itertools.product(range(u), range(u)):
            inside = 0 <= y0 - hs + a < h and 0 <= x0 - hs + c < w
            if not inside:  # outside the map: weight exactly 0, not a padded key's share
                assert torch.all(p[..., yo, xo, a, c] == 0)
            else:
                assert torch.all(p[..., yo, xo, a, c] > 0)
        out[:, :, yo, xo] = torch.einsum("nac,nacd->nd", p[0, :, yo, xo], vp[0, :, y0:y0 + u, x0:x0 + u])
    torch.testing.assert_close(out, brute_force(q, k, v, rh, rw, bs, hs, s), rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_queries_give_the_in_map_window_mean(impl):
    # q = 0, no positions: uniform weights over the in-map keys of the block's window. Zero-padded
    # keys (timm's HaloAttn) would take a share and pull border outputs towards 0.
    _, k, v, _, _ = _inputs(1, 1, 7, 6, 4, 3, 3, 2)
    q = torch.zeros_like(k)
    out = halo_attention_2d(q, k, v, None, None, 3, 2, impl=impl)
    for y, x in itertools.product(range(7), range(6)):
        y0, x0 = y // 3 * 3, x // 3 * 3
        win = v[0, 0, max(0, y0 - 2):y0 + 5, max(0, x0 - 2):x0 + 5]
        torch.testing.assert_close(out[0, 0, y, x], win.mean((0, 1)), rtol=0, atol=1e-13)


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_outside_the_window_have_no_influence(impl):
    q, k, v, rh, rw = _inputs(1, 1, 12, 11, 4, 2, 4, 1)
    base = halo_attention_2d(q, k, v, rh, rw, 4, 1, impl=impl)
    k2, v2 = k.clone(), v.clone()
    k2[0, 0, 8, 3] += 5.0  # block row 2; it is in the halo of block row 1 (rows 3..8) only
    v2[0, 0, 8, 3] += 5.0
    changed = (halo_attention_2d(q, k2, v2, rh, rw, 4, 1, impl=impl) - base).abs().amax(-1)[0, 0] > 0
    expected = torch.zeros(12, 11, dtype=torch.bool)
    expected[4:12, 0:8] = True  # the queries of blocks (1..2, 0..1): windows holding (8, 3)
    assert torch.equal(changed, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_constant_values_stay_constant_at_the_border(impl):
    q, k, _, rh, rw = _inputs(2, 2, 9, 10, 6, 1, 4, 3, scale=3.0)
    v = torch.ones(2, 2, 9, 10, 1, dtype=D)
    out = halo_attention_2d(q, k, v, rh, rw, 4, 3, impl=impl)
    torch.testing.assert_close(out, torch.ones_like(out), rtol=0, atol=1e-13)


# ----------------------------------------------------------------------------- layouts, dtypes
@pytest.mark.parametrize("impl", IMPLS)
def test_channels_first_views_and_partial_gradients(impl):
    # The layer hands q, k, v as views of channels-first projections; any subset may need grads.
    g = torch.Generator().manual_seed(5)
    maps = [torch.randn(2, 3 * 8, 9, 11, generator=g, dtype=D) for _ in range(3)]
    q, k, v = (m.view(2, 3, 8, 9, 11).permute(0, 1, 3, 4, 2) for m in maps)
    _, _, _, rh, rw = _inputs(1, 1, 1, 1, 8, 8, 4, 2)
    ref = brute_force(q, k, v, rh, rw, 4, 2)
    torch.testing.assert_close(halo_attention_2d(q, k, v, rh, rw, 4, 2, impl=impl), ref, rtol=0, atol=1e-12)
    full = [t.clone().requires_grad_(True) for t in (q, k, v, rh, rw)]
    halo_attention_2d(*full, 4, 2, impl=impl).square().sum().backward()
    for i in range(5):
        part = [t.clone().requires_grad_(j == i) for j, t in enumerate((q, k, v, rh, rw))]
        halo_attention_2d(*part, 4, 2, impl=impl).square().sum().backward()
        torch.testing.assert_close(part[i].grad, full[i].grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS + ["auto"])
def test_float32_matches_brute_force(impl):
    q, k, v, rh, rw = _inputs(1, 3, 13, 10, 8, 8, 4, 2, dtype=torch.float32)
    out = halo_attention_2d(q, k, v, rh, rw, 4, 2, impl=impl)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), brute_force(q, k, v, rh, rw, 4, 2), rtol=0, atol=2e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_logits_float32_still_exact(impl):
    # logits of a few hundred: the border mask must still exclude the keys outside the map
    q, k, v, rh, rw = _inputs(1, 2, 6, 7, 8, 4, 4, 2, dtype=torch.float32, scale=6.0)
    out = halo_attention_2d(q, k, v, rh, rw, 4, 2, impl=impl)
    assert float((q.double() * k.double()).sum(-1).abs().max()) > 100
    torch.testing.assert_close(out.double(), brute_force(q, k, v, rh, rw, 4, 2), rtol=0, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_autocast_finite_and_close_to_float32(impl):
    q, k, v, rh, rw = _inputs(2, 2, 11, 10, 16, 16, 4, 2, dtype=torch.float32, scale=2.5)
    q, k, v = (t.bfloat16().requires_grad_(True) for t in (q, k, v))
    rh, rw = rh.requires_grad_(True), rw.requires_grad_(True)
    ref = brute_force(q.float(), k.float(), v.float(), rh.bfloat16().float(), rw.bfloat16().float(), 4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = halo_attention_2d(q, k, v, rh, rw, 4, 2, impl=impl)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert float((q.detach().float() * k.detach().float()).sum(-1).abs().max()) > 60
    err = (out.double() - ref).abs().detach()
    # bf16 keeps 8 mantissa bits: the fused route rounds the logits (|.| ~ 60) and the bias to
    # ~0.25; the other routes compute in float32 and round only their output.
    assert float(err.mean()) < 0.01 and float(err.max()) < 0.25, (float(err.mean()), float(err.max()))
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
    assert rh.grad.dtype == rw.grad.dtype == torch.float32
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, rh, rw))


# ----------------------------------------------------------------------------- dispatch, export
def test_impls_come_from_the_registry():
    import aadet.layers.functional.halo_attention as halo

    assert HALO_ATTENTION_BACKENDS.impls() == ("auto",) + tuple(HALO_ATTENTION_BACKENDS)
    assert {"materialized", "bmm", "cpp", "fused"} <= set(HALO_ATTENTION_BACKENDS)
    assert not HALO_ATTENTION_BACKENDS["cpp"].cuda
    assert HALO_ATTENTION_BACKENDS.exportable() == ("auto", "materialized")
    assert HALO_ATTENTION_BACKENDS.describe() in halo.__doc__


def test_auto_picks_cpp_on_cpu_and_materialized_while_tracing():
    q, k, v, rh, rw = _inputs(1, 1, 5, 5, 4, 4, 2, 1, dtype=torch.float32)
    assert auto_halo_attention_impl(q) == ("cpp" if halonet_cpp.KERNEL.available() else "bmm")
    seen = []

    def fn(q):
        seen.append(auto_halo_attention_impl(q))
        return q * 2

    torch.jit.trace(fn, (q,), check_trace=False)
    assert seen == ["materialized"]


def _traced(q, k, v, rh, rw, bs, hs, s):
    def fn(q, k, v, rh, rw):
        return halo_attention_2d(q, k, v, rh, rw, bs, hs, query_stride=s)

    return torch.jit.trace(fn, (q, k, v, rh, rw), check_trace=False)


@pytest.mark.parametrize("case", [(5, 7, 2, 1, 1), (3, 2, 4, 1, 1), (9, 7, 4, 1, 2)], ids=_ids)
def test_traced_route_is_plain_ops_and_exact(case):
    h, w, bs, hs, s = case
    args = [t.requires_grad_(True) for t in _inputs(2, 2, h, w, 5, 3, bs, hs, s)]
    traced = _traced(*args, bs, hs, s)
    kinds = {node.kind() for node in traced.inlined_graph.nodes()}
    assert "prim::PythonOp" not in kinds, sorted(kinds)
    assert not any("scaled_dot_product" in kind for kind in kinds), sorted(kinds)
    new = [t.detach() + 0.5 for t in args]  # a function of the inputs, not constants
    torch.testing.assert_close(traced(*new), brute_force(*new, bs, hs, s), rtol=0, atol=1e-12)


def test_onnx_export_opset17_runs_in_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    import io

    class Halo(torch.nn.Module):
        def __init__(self, rh, rw):
            super().__init__()
            self.rel_h, self.rel_w = torch.nn.Parameter(rh), torch.nn.Parameter(rw)

        def forward(self, q, k, v):
            return halo_attention_2d(q, k, v, self.rel_h, self.rel_w, 4, 2, query_stride=2)

    q, k, v, rh, rw = _inputs(1, 2, 11, 9, 8, 8, 4, 2, 2, dtype=torch.float32)
    model = Halo(rh, rw).eval()
    f = io.BytesIO()
    torch.onnx.export(model, (q, k, v), f, opset_version=17, dynamo=False,
                      input_names=["q", "k", "v"], output_names=["out"])
    session = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()})[0]
    ref = brute_force(q, k, v, rh, rw, 4, 2, 2)
    torch.testing.assert_close(torch.from_numpy(got).double(), ref, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize("change,match", [
    (dict(block_size=0), r"block_size must be an integer >= 1; got 0"),
    (dict(halo_size=-1), r"halo_size must be an integer >= 0; got -1"),
    (dict(halo_size=True), r"halo_size must be an integer >= 0; got True"),
    (dict(halo_size=1.0), r"halo_size must be an integer >= 0; got 1.0"),
    (dict(query_stride=3), r"query_stride must be a divisor of block_size=4 .*; got 3"),
    (dict(query_stride=0), r"query_stride must be an integer >= 1; got 0"),
    (dict(impl="nope"), r"impl must be one of \('auto', 'cpp', 'bmm', 'materialized', 'fused', 'triton'\); got 'nope'"),
    (dict(q=torch.zeros(1, 2, 6, 5, 4)), r"q must be k's shape = \(1, 2, 6, 7, 4\) .*got \(1, 2, 6, 5, 4\)"),
    (dict(q=torch.zeros(1, 2, 6, 7, 4), query_stride=2),
     r"q must be \[B, Nh, ceil\(H/2\), ceil\(W/2\), d\] for query_stride=2 = \(1, 2, 3, 4, 4\)"),
    (dict(v=torch.zeros(1, 2, 6, 6, 3)), r"v must be \[B, Nh, H, W, dv\]"),
    (dict(k=torch.zeros(2, 6, 7, 4)), r"q, k, v must be \[B, Nh, H, W, d\]"),
    (dict(rel_w=None), r"rel_h and rel_w must both be tensors or both be None"),
    (dict(rel_h=torch.zeros(11, 2), rel_w=torch.zeros(11, 2)),
     r"rel_h/rel_w must have 2 \* \(block_size \+ halo_size\) - 1 = 9 rows; got 11"),
    (dict(rel_h=torch.zeros(9, 3)), r"rel_h must be \[R, dk//2=2\]; got \(9, 3\)"),
])
def test_argument_errors_name_the_argument(change, match):
    args = dict(zip(("q", "k", "v", "rel_h", "rel_w"), _inputs(1, 2, 6, 7, 4, 3, 4, 1, dtype=torch.float32)))
    args.update(block_size=4, halo_size=1, query_stride=1, impl="auto")
    args.update(change)
    with pytest.raises(ValueError, match=match):
        halo_attention_2d(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("rel_h"),
                          args.pop("rel_w"), args.pop("block_size"), args.pop("halo_size"), **args)


# ----------------------------------------------------------------------------- CUDA
#: precision -> (compute dtype, autocast dtype or None, value limit, gradient limit): as
#: tests/layers/test_cuda.py (||x - ref|| / ||ref||).
PRECISIONS = {
    "fp64": (torch.float64, None, 1e-10, 1e-10),
    "fp32": (torch.float32, None, 1e-4, 1e-4),
    "bf16": (torch.float32, torch.bfloat16, 2e-2, 4e-2),
    "fp16": (torch.float32, torch.float16, 5e-3, 1e-2),
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("impl", [i for i, b in HALO_ATTENTION_BACKENDS.items() if b.cuda] + ["auto"])
def test_routes_on_cuda_match_brute_force(impl, precision, stride):
    dtype, amp, lim, glim = PRECISIONS[precision]
    leaves = [t.cuda().requires_grad_(True) for t in _inputs(2, 2, 13, 10, 16, 16, 4, 2, stride, seed=6)]
    with torch.device("cuda"):
        ref = brute_force(*leaves, 4, 2, stride)
    cot = torch.randn(ref.shape, device="cuda", dtype=D)
    grads_ref = torch.autograd.grad((ref * cot).sum(), leaves)
    inputs = [t.to(amp or dtype) if i < 3 else t.to(dtype) for i, t in enumerate(leaves)]
    with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
        out = halo_attention_2d(*inputs, 4, 2, query_stride=stride, impl=impl)
    assert out.is_cuda and torch.isfinite(out).all()
    grads = torch.autograd.grad((out.double() * cot).sum(), leaves)

    def rel_err(x, r):
        return float((x.detach().double() - r.detach()).norm() / r.detach().norm())

    assert rel_err(out, ref) < lim
    errs = [rel_err(g, gr) for g, gr in zip(grads, grads_ref)]
    assert max(errs) < glim, errs
