"""Exactness of AA's attention kernels that add the 2D relative logit tables without widening the
head: the Triton flash-attention kernel (``backends/aa_triton``) and the
``flex_attention`` route (``backends/aa_flex``).

References (float64):
  * ``reference``: ``softmax(q k^T + T_row[:, j // W] + T_col[:, j % W]) v`` written out;
  * ``brute_force_relative``: AA's logits from the relative embeddings, one ``(query, key)``
    offset lookup per pair (``rel_h[y' - y + H - 1]``, ``rel_w[x' - x + W - 1]``), no
    ``rel_to_abs``, no tables.

On CPU the Triton kernels run under Triton's interpreter, which must be on before triton is first
imported (triton decorates its own ``tl.sum``/``tl.zeros`` at import; the modes do not mix). So
``test_triton_cpu_in_interpreter`` runs this file's ``triton_cpu`` tests in a fresh process with
``TRITON_INTERPRET=1``; in a process already in that mode they run directly. ``@pytest.mark.cuda``
tests run the compiled kernels on a GPU. Without a GPU, the ``compile`` tests compile every kernel
variant the launch code makes for the configs' AA layers down to an sm_90 cubin
(``tests/helpers/triton_aot.py``).
"""
import os

import pytest
import torch

from aadet.layers.augmented_conv import AugmentedConv2d
from aadet.layers.functional.backends import aa_triton
from aadet.layers.functional.backends.aa_flex import (
    flex_attention_with_logit_tables,
    flex_attention_with_row_col_tables,
)
from aadet.layers.functional.backends.aa_triton import (
    TRITON_AVAILABLE,
    TRITON_INTERPRETED,
    triton_attention_with_logit_tables,
    triton_attention_with_row_col_tables,
)
from aadet.layers.functional.key_grid import row_col_tables_from_index
from aadet.layers.functional.relative_attention import relative_logit_tables_2d

from tests.helpers import REPO, passed_in_triton_interpreter, triton_aot

needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
compiled_triton = pytest.mark.skipif(
    TRITON_INTERPRETED, reason="compiled kernels: run without TRITON_INTERPRET"
)

# Error / max(1, max |reference|) against float64 on the same (rounded) inputs. float32: IEEE
# products (no TF32), float32 accumulation; measured ~1e-6. Half types: the kernel also rounds the
# probabilities (before p @ v) and dS (before dS @ k, dS^T @ q) to the input type, as flash
# attention does; measured (5x6 map, d = 8) fp16 <= 5.5e-4 (eps 4.9e-4), bf16 <= 9.5e-3 (eps
# 3.9e-3), about twice to four times the materialized route's float32-softmax error in that type.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2.5e-2}


@pytest.fixture
def interpreter():
    """Triton's interpreter (CPU tensors): these tests run where triton was imported in it."""
    if not TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    if not TRITON_INTERPRETED:
        pytest.skip("runs in test_triton_cpu_in_interpreter (a TRITON_INTERPRET=1 process)")


def _tables_inputs(b, nh, h, w, dk, dv, seed=0, device="cpu", rows=True, cols=True):
    """float64 ``q, k [B, Nh, L, dk]``, ``v [B, Nh, L, dv]``, ``T_row [.., L, H]``,
    ``T_col [.., L, W]`` (None where not wanted)."""
    g = torch.Generator().manual_seed(seed)
    length = h * w

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)

    q, k, v = r(b, nh, length, dk), r(b, nh, length, dk), r(b, nh, length, dv)
    t_row = 2 * r(b, nh, length, h) if rows else None
    t_col = 2 * r(b, nh, length, w) if cols else None
    return q, k, v, t_row, t_col


def reference(q, k, v, t_row, t_col, width):
    """float64 ``softmax(q k^T + T_row[..., j // W] + T_col[..., j % W]) v``."""
    pos = torch.arange(q.shape[-2], device=q.device)
    logits = q.double() @ k.double().transpose(-1, -2)  # [.., L, L]
    if t_row is not None:
        logits = logits + t_row.double()[..., pos // width]
    if t_col is not None:
        logits = logits + t_col.double()[..., pos % width]
    return torch.softmax(logits, dim=-1) @ v.double()


def brute_force_relative(q, k, v, rel_h, rel_w):
    """float64 AA attention from ``q, k, v [B, Nh, H, W, d]`` and the relative embeddings."""
    b, nh, h, w, dk = q.shape
    q, k, v = q.double(), k.double(), v.double()
    ys = torch.arange(h, device=q.device).repeat_interleave(w)  # [L] row of each position
    xs = torch.arange(w, device=q.device).repeat(h)  # [L] column
    qf, kf = q.reshape(b, nh, h * w, dk), k.reshape(b, nh, h * w, dk)
    logits = qf @ kf.transpose(-1, -2)
    rh = rel_h.double()[ys[None, :] - ys[:, None] + h - 1]  # [L(query), L(key), dk]
    rw = rel_w.double()[xs[None, :] - xs[:, None] + w - 1]
    logits = logits + torch.einsum("bnid,ijd->bnij", qf, rh) + torch.einsum("bnid,ijd->bnij", qf, rw)
    out = torch.softmax(logits, -1) @ v.reshape(b, nh, h * w, -1)
    return out.reshape(b, nh, h, w, -1)


def _run_with_grads(fn, inputs, dtype, grad_out_seed=1):
    """Output and gradients of ``fn`` at ``inputs`` cast to ``dtype`` (tables stay float32 for
    half types, as ``relative_logit_tables_2d`` makes them), for one fixed upstream gradient."""
    cast = []
    for i, x in enumerate(inputs):
        if x is None:
            cast.append(None)
            continue
        to = dtype if (i < 3 or dtype == torch.float64) else torch.float32
        cast.append(x.detach().to(to).requires_grad_())
    out = fn(*cast)
    g = torch.Generator().manual_seed(grad_out_seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    leaves = [x for x in cast if x is not None]
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return out, grads, cast


def _assert_matches(fn, inputs, width, dtype, tol=None):
    """``fn`` (a row/column-table route) against the float64 reference: value and every
    gradient, each relative to ``max(1, max |reference|)``."""
    tol = TOL[dtype] if tol is None else tol
    out, grads, cast = _run_with_grads(fn, inputs, dtype)
    # The reference sees the same (rounded) inputs the kernel saw.
    ref_inputs = [None if x is None else x.detach().double() for x in cast]
    ref, ref_grads, _ = _run_with_grads(lambda *a: reference(*a, width), ref_inputs, torch.float64)
    assert out.dtype == dtype and out.shape == ref.shape
    names = ["out"] + [n for n, x in zip(["dq", "dk", "dv", "dT_row", "dT_col"], cast) if x is not None]
    for name, a, r in zip(names, [out, *grads], [ref, *ref_grads]):
        err = (a.detach().double() - r).abs().max().item()
        scale = max(1.0, r.abs().max().item())
        assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"


# ----------------------------------------------------------------------------- Triton on CPU
# (H, W, dk, dv, tables): H != W, 1 x 1, single rows / columns, head dims that are not powers of
# two (20 -> 32, 17 -> 32), a row table alone, a column table alone, no table.
SHAPES = [
    (5, 7, 6, 5, "both"),
    (9, 4, 3, 8, "row"),
    (1, 1, 6, 5, "both"),
    (6, 1, 4, 4, "none"),
    (1, 6, 5, 3, "both"),
    (3, 5, 20, 17, "col"),
]


@pytest.mark.parametrize("h,w,dk,dv,tables", SHAPES)
def test_triton_cpu_fp32_matches_float64(interpreter, h, w, dk, dv, tables):
    inputs = _tables_inputs(1, 2, h, w, dk, dv, rows=tables in ("both", "row"),
                            cols=tables in ("both", "col"))
    _assert_matches(
        lambda q, k, v, tr, tc: triton_attention_with_row_col_tables(q, k, v, tr, tc, w),
        inputs, w, torch.float32,
    )


@pytest.mark.parametrize(
    "h,w,tiles",
    [
        # 3 query blocks (the last partial), 2 row blocks, 2 column chunks of 4 (7 = 4 + 3).
        (5, 7, dict(block_m=16, block_n=16, max_block_w=4)),
        # 3 query blocks, 16 rows of W = 3 (padded to 4) per tile, 2 row blocks.
        (11, 3, dict(block_m=16, block_n=64)),
    ],
)
def test_triton_cpu_fp32_small_tiles(interpreter, h, w, tiles):
    inputs = _tables_inputs(1, 1, h, w, 6, 5, seed=3)
    _assert_matches(
        lambda q, k, v, tr, tc: triton_attention_with_row_col_tables(q, k, v, tr, tc, w, **tiles),
        inputs, w, torch.float32,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_cpu_half_types(interpreter, dtype):
    inputs = _tables_inputs(1, 2, 5, 6, 8, 8, seed=5)
    _assert_matches(
        lambda q, k, v, tr, tc: triton_attention_with_row_col_tables(q, k, v, tr, tc, 6),
        inputs, 6, dtype,
    )


def test_triton_cpu_relative_attention_end_to_end(interpreter):
    """Through ``relative_logit_tables_2d``: gradients reach q (content and table paths), k, v
    and both relative embeddings, against the pixel-pair brute force."""
    b, nh, h, w, dk, dv = 1, 2, 4, 6, 6, 5
    g = torch.Generator().manual_seed(6)
    base = [
        torch.randn(b, nh, h, w, dk, generator=g, dtype=torch.float64),
        torch.randn(b, nh, h, w, dk, generator=g, dtype=torch.float64),
        torch.randn(b, nh, h, w, dv, generator=g, dtype=torch.float64),
        torch.randn(2 * h - 1, dk, generator=g, dtype=torch.float64),
        torch.randn(2 * w - 1, dk, generator=g, dtype=torch.float64),
    ]
    grad_out = torch.randn(b, nh, h, w, dv, generator=g, dtype=torch.float64)

    def kernel(q, k, v, rel_h, rel_w):
        tables, key_index = relative_logit_tables_2d(q, rel_h, rel_w)
        out = triton_attention_with_logit_tables(
            q.reshape(b, nh, h * w, dk), k.reshape(b, nh, h * w, dk),
            v.reshape(b, nh, h * w, dv), tables, key_index,
        )
        return out.reshape(b, nh, h, w, dv)

    results = []
    for fn, dtype in ((kernel, torch.float32), (brute_force_relative, torch.float64)):
        xs = [x.to(dtype).requires_grad_() for x in base]
        out = fn(*xs)
        results.append((out, torch.autograd.grad(out, xs, grad_out.to(dtype))))
    (out, grads), (ref, ref_grads) = results
    names = ["out", "dq", "dk", "dv", "drel_h", "drel_w"]
    for name, a, r in zip(names, [out, *grads], [ref, *ref_grads]):
        err = (a.detach().double() - r).abs().max().item()
        scale = max(1.0, r.abs().max().item())
        assert err <= TOL[torch.float32] * scale, f"{name}: max error {err:.3g}"


@needs_triton
@pytest.mark.skipif(TRITON_INTERPRETED, reason="this process interprets: the triton_cpu tests run here")
def test_triton_cpu_in_interpreter():
    """This file's ``triton_cpu`` tests in a fresh process with ``TRITON_INTERPRET=1``."""
    assert passed_in_triton_interpreter(__file__, "-k", "triton_cpu and not in_interpreter", timeout=600) > 0


def test_triton_argument_errors():
    q, k, v, t_row, t_col = _tables_inputs(1, 1, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="float64"):
        triton_attention_with_row_col_tables(q, k, v, t_row, t_col, 3)
    q, k, v = q.float(), k.float(), v.float()
    with pytest.raises(ValueError, match="width must divide L = 6"):
        triton_attention_with_row_col_tables(q, k, v, t_row, t_col, 4)
    with pytest.raises(ValueError, match=r"t_col must have shape \[\*, L, W\]"):
        triton_attention_with_row_col_tables(q, k, v, t_row, t_col[..., :2], 3)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        triton_attention_with_row_col_tables(q, k, v, t_row, t_col, 3, block_m=24)
    big = torch.zeros(65536, 6, 1).expand(65536, 6, 1)
    with pytest.raises(ValueError, match="at most 65535; got 65536"):
        triton_attention_with_row_col_tables(big, big, big, None, None, 3)
    if not TRITON_INTERPRETED:  # compiled mode (or no triton): CPU tensors cannot run
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1|pip install triton"):
            triton_attention_with_row_col_tables(q, k, v, None, None, 3)


# ----------------------------------------------------------------------------- (tables, key_index)
@pytest.mark.parametrize("h,w", [(5, 7), (7, 5), (4, 4), (1, 1), (1, 6), (6, 1)])
@pytest.mark.parametrize("which", ["both", "row", "col"])
def test_row_col_tables_from_index(h, w, which):
    """``relative_logit_tables_2d``'s ``(tables, key_index)`` read back as (T_row, T_col, W): the
    logits they define are the same (for 1-pixel axes the split may differ, the logits not)."""
    q = torch.randn(2, 3, h, w, 4, dtype=torch.float64)
    rel_h = torch.randn(2 * h - 1, 4, dtype=torch.float64) if which != "col" else None
    rel_w = torch.randn(2 * w - 1, 4, dtype=torch.float64) if which != "row" else None
    tables, key_index = relative_logit_tables_2d(q, rel_h, rel_w)
    t_row, t_col, width = row_col_tables_from_index(tables, key_index, h * w)
    assert (h * w) % width == 0
    pos = torch.arange(h * w)
    expected = sum(t[..., idx] for t, idx in zip(tables, key_index))
    got = 0
    if t_row is not None:
        got = got + t_row[..., pos // width]
    if t_col is not None:
        got = got + t_col[..., pos % width]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if h > 1 and w > 1:
        assert width == w and (t_row is not None) == (rel_h is not None)


def test_row_col_tables_from_index_rejects_other_layouts():
    t = torch.zeros(1, 12, 4)
    with pytest.raises(ValueError, match="row-major H x W key grid"):
        row_col_tables_from_index([t], [torch.randperm(12) % 4], 12)
    with pytest.raises(ValueError, match="at most two tables"):
        row_col_tables_from_index([t, t, t], [torch.arange(12) % 4] * 3, 12)


# ----------------------------------------------------------------------------- flex on CPU
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_flex_forward_cpu(dtype, tol):
    """CPU: forward only (flex has no CPU backward); the score_mod adds the tables exactly."""
    h, w = 5, 7
    q, k, v, t_row, t_col = _tables_inputs(2, 2, h, w, 6, 5, seed=7)
    with torch.no_grad():
        out = flex_attention_with_row_col_tables(
            q.to(dtype), k.to(dtype), v.to(dtype), t_row.to(dtype), t_col.to(dtype), w
        )
    ref = reference(q, k, v, t_row, t_col, w)
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_flex_general_key_index_cpu():
    """Any key index (not only a 2D grid): a permuted 3-column table and a 1-column one."""
    g = torch.Generator().manual_seed(8)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = r(2, 9, 4), r(2, 11, 4), r(2, 11, 3)  # 9 queries, 11 keys
    tables = [r(2, 9, 3), r(2, 9, 1)]
    key_index = [torch.randint(0, 3, (11,), generator=g), torch.zeros(11, dtype=torch.long)]
    with torch.no_grad():
        out = flex_attention_with_logit_tables(q, k, v, tables, key_index)
    logits = q @ k.transpose(-1, -2) + tables[0][..., key_index[0]] + tables[1][..., key_index[1]]
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=0, atol=1e-12)


def test_flex_cpu_backward():
    """A CPU call that needs gradients raises, unless the materialized fallback is asked for;
    then values and gradients are the reference's."""
    q, k, v, t_row, t_col = _tables_inputs(1, 2, 3, 4, 5, 5, seed=9)
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        flex_attention_with_row_col_tables(q, k, v, t_row, t_col, 4)
    t_row.requires_grad_()
    with pytest.raises(RuntimeError, match="cpu_backward='materialized'"):
        flex_attention_with_row_col_tables(q.detach(), k, v, t_row, t_col, 4)
    _assert_matches(
        lambda *a: flex_attention_with_row_col_tables(*a, 4, cpu_backward="materialized"),
        (q, k, v, t_row, t_col), 4, torch.float64, tol=1e-12,
    )
    with pytest.raises(ValueError, match="cpu_backward must be one of"):
        flex_attention_with_row_col_tables(q, k, v, t_row, t_col, 4, cpu_backward="eager")


# ----------------------------------------------------------------------------- CUDA
# AA-R50's shapes: dkh = 6 / 13 / 26 at 8 heads (kappa = 0.2 of 256 / 512 / 1024 channels).
CUDA_SHAPES = [(20, 20, 6, 6), (40, 40, 6, 6), (25, 38, 13, 13), (13, 21, 26, 26), (1, 1, 6, 6)]


@pytest.mark.cuda
@needs_cuda
@needs_triton
@compiled_triton
@pytest.mark.parametrize("h,w,dk,dv", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_cuda(h, w, dk, dv, dtype):
    inputs = _tables_inputs(2, 4, h, w, dk, dv, seed=10, device="cuda")
    _assert_matches(
        lambda q, k, v, tr, tc: triton_attention_with_row_col_tables(q, k, v, tr, tc, w),
        inputs, w, dtype,
    )


@pytest.mark.cuda
@needs_cuda
@needs_triton
@compiled_triton
def test_triton_cuda_wide_map_column_chunks():
    """W = 150 > 128: two column chunks, table row sums summed over chunks."""
    inputs = _tables_inputs(1, 2, 3, 150, 8, 8, seed=11, device="cuda")
    _assert_matches(
        lambda q, k, v, tr, tc: triton_attention_with_row_col_tables(q, k, v, tr, tc, 150),
        inputs, 150, torch.float32,
    )


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("h,w,dk,dv", CUDA_SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_cuda(h, w, dk, dv, dtype):
    """Compiled flex, forward and backward (table gradients through flex's captured buffers)."""
    inputs = _tables_inputs(2, 4, h, w, dk, dv, seed=12, device="cuda")
    _assert_matches(
        lambda q, k, v, tr, tc: flex_attention_with_row_col_tables(q, k, v, tr, tc, w),
        inputs, w, dtype,
    )


# ----------------------------------------------------------------------------- compiled for an H100, no GPU
# The interpreter does not type-check the kernels as the compiler does (tl.dot's operand types,
# constexpr branches, the tile reshapes): tests/helpers/triton_aot.py runs the launch code on CPU with the
# kernels recorded and compiles each launch for sm_90 (Triton's bundled LLVM and ptxas need no GPU).
compiles_for_h100 = pytest.mark.skipif(
    not TRITON_AVAILABLE or TRITON_INTERPRETED or not triton_aot.nvidia_backend_available(),
    reason="needs Triton's CUDA backend (compiled mode)")
AA_KERNELS = ("fwd", "dkdv", "dq")
#: fp32: a float32 model; bf16: bf16 autocast (bf16 q, k, v; the tables in float32).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
RESNET_STRIDES = {"res2": 4, "res3": 8, "res4": 16, "res5": 32}


@pytest.fixture(scope="module")
def config_aa_layers():
    """``{(num_heads, dkh, dvh, relative): [configs]}`` of every config."""
    return triton_aot.config_attention_layers()["aa"]


def _config_map_widths(config):
    """Attention map widths of ``config``'s AA layers: its training crops (``INPUT.SCALE_JITTER
    .CROP_SIZE``) and its test images' longer side (``INPUT.MAX_SIZE_TEST``), at each AA stage's
    stride (twice that where the layer pools first). Other aspect ratios give other widths: the
    slow test compiles every tile the launch code can choose."""
    from aadet.engine import load_config

    cfg = load_config(os.path.join(REPO, config))
    jitter = cfg.INPUT.SCALE_JITTER
    sides = {cfg.INPUT.MAX_SIZE_TEST} | ({jitter.CROP_SIZE} if jitter.ENABLED else set())
    return {-(-side // (RESNET_STRIDES[stage] * (2 if stage in cfg.MODEL.AA.DOWNSAMPLE_STAGES else 1)))
            for side in sides for stage in cfg.MODEL.AA.STAGES}


def _aa_layer_launches(spec, precision, size):
    """The kernel launches of an ``AugmentedConv2d`` of ``spec`` on the ``impl="triton"`` route
    (forward and backward, attention map ``size``), on CPU with the kernels recorded."""
    heads, dkh, dvh, rel = spec
    dv = heads * dvh
    layer = AugmentedConv2d(8, dv + 8, 3, dk=heads * dkh, dv=dv, num_heads=heads, max_size=max(size),
                            positional_encoding="relative" if rel else "none", impl="triton")
    x = torch.randn(1, 8, *size)

    def run():
        with torch.autocast("cpu", dtype=PRECISIONS[precision] or torch.bfloat16,
                            enabled=PRECISIONS[precision] is not None):
            out = layer(x)
        out.float().sum().backward()

    saved = aa_triton._check_runnable  # the launch without its "CUDA tensors" check
    aa_triton._check_runnable = lambda q: None
    try:
        return triton_aot.run_recorded(aa_triton._KERNELS, AA_KERNELS, run)
    finally:
        aa_triton._check_runnable = saved


def _tiles(launches):
    return {(launch.kwargs["ROWS"], launch.kwargs["BLOCK_W"]) for launch in launches}




@compiles_for_h100
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_kernels_compile_for_an_h100_without_a_gpu(config_aa_layers, precision):
    # Every AA layer of the COCO and demo configs at its training and test map widths, in fp32 and
    # under bf16 autocast (tl.dot on bf16 tiles): forward, dk/dv and dq kernels.
    assert {c.split("/")[1] for cs in config_aa_layers.values() for c in cs} == {"COCO-Detection", "Demo"}
    launches, tiles = [], set()
    for spec, configs in config_aa_layers.items():
        widths = set().union(*(_config_map_widths(c) for c in configs))
        for w in sorted(widths):
            got = _aa_layer_launches(spec, precision, (2, w))
            assert {launch.kernel.__name__ for launch in got} == {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"}
            launches += got
        if spec[3]:  # relative: the key tile follows the map's rows (BLOCK_W = W rounded up)
            tiles |= {min(1 << (w - 1).bit_length(), aa_triton.MAX_BLOCK_W) for w in widths}
    assert {bw for _, bw in _tiles(launches)} >= tiles
    dtype = "*bf16" if precision == "bf16" else "*fp32"
    for launch in launches:
        sig = triton_aot.specialization(launch)[0]
        assert sig["Q"] == sig["K"] == sig["V"] == dtype and sig["LSE"] == "*fp32", sig
        assert launch.kwargs["OP_F32"] is False  # compiled mode: tl.dot on the input type
    triton_aot.assert_compile(launches)


@pytest.mark.slow  # some 20 more variants each: about a minute on 2 cores without Triton's cache
@compiles_for_h100
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_tile_the_launch_code_makes_compiles_for_an_h100(config_aa_layers, precision):
    # Any image size: every key tile the launch code can choose (ROWS x BLOCK_W whole rows, up to
    # MAX_BLOCK_W columns), with and without the relative tables, and single-row / single-column
    # maps (Triton folds an integer argument equal to 1 into a constant).
    lt = aa_triton
    widths = {}  # tile (ROWS, BLOCK_W) of the launch code's plan -> the narrowest map that gets it
    for w in range(1, 2 * lt.MAX_BLOCK_W + 1):
        plan = lt._Plan(1, 2, w, 8, 8, lt.BLOCK_M, lt.BLOCK_N, lt.MAX_BLOCK_W)
        widths.setdefault((plan.rows, plan.block_w), w)
    launches = []
    for heads, dkh, dvh, _ in config_aa_layers:
        for rel in (True, False):
            for size in [(2, w) for w in sorted(widths.values())] + [(1, 1), (1, 7), (7, 1)]:
                launches += _aa_layer_launches((heads, dkh, dvh, rel), precision, size)
    assert _tiles(launches) == set(widths) and len(widths) == 8
    flags = {(launch.kwargs["HAS_ROW"], launch.kwargs["HAS_COL"]) for launch in launches}
    assert flags >= {(True, True), (False, False)}
    triton_aot.assert_compile(launches)
