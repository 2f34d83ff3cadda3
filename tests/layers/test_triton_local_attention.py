"""The Triton SASA kernels (forward, both backward passes) against the float64 brute force of Eq. 3.

On CPU the kernels run in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before the
process first imports triton. A plain ``pytest`` run therefore skips the ``cpu`` cases in its own
process and :func:`test_kernels_in_the_triton_interpreter` runs them in a subprocess that sets the
flag (``TRITON_INTERPRET=1 pytest this_file`` runs them directly). Shapes are tiny because the
interpreter runs every operation of every program in Python. The ``cuda`` variants run the same
checks, plus larger maps, on a GPU when one is present (compiled kernels).
"""
import importlib.util
import sys

import pytest
import torch

from aadet.layers.functional.backends import sasa_triton, triton_kernels
from aadet.layers.functional.backends.sasa_triton import (
    TRITON_AVAILABLE,
    TRITON_INTERPRETED,
    triton_local_attention,
)
from aadet.layers.functional.local_attention import local_self_attention_2d
from aadet.layers.local_attention import LocalSelfAttention2d

from aadet.layers.functional.reference import local_self_attention_2d_reference as brute_force

from tests.helpers import passed_in_triton_interpreter, triton_aot, triton_devices

pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs the triton package")

HAS_CUDA = torch.cuda.is_available() and not TRITON_INTERPRETED
DEVICES = triton_devices()


@pytest.fixture(params=DEVICES)
def device(request):
    """``"cpu"`` (Triton's interpreter) or ``"cuda"`` (compiled kernels)."""
    return torch.device(request.param)


@pytest.mark.skipif(TRITON_INTERPRETED, reason="this process already runs the interpreter")
def test_kernels_in_the_triton_interpreter():
    # the CPU cases really ran there: 11 kernel tests plus the error checks
    # (the compiled-only tests skip there)
    assert passed_in_triton_interpreter(__file__, "-m", "not cuda", allow_skipped=True) >= 13


def _inputs(b, nh, h, w, dk, dv, ks, device, dtype=torch.float32, seed=0, scale=1.0, channels_first=False):
    """float64 master copies (for the brute force) and the kernel's inputs in ``dtype``.

    ``channels_first``: q, k, v are permuted views of ``[B, Nh, d, H, W]`` tensors, the layout
    ``split_heads`` produces from a 1x1 convolution (strided channels, no copy).
    """
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, s=1.0):
        if channels_first:
            t = torch.randn(*shape[:2], shape[4], *shape[2:4], generator=g, dtype=torch.float64)
            t = t.permute(0, 1, 3, 4, 2)
        else:
            t = torch.randn(*shape, generator=g, dtype=torch.float64)
        return t * s

    q = rand(b, nh, h, w, dk, s=scale)
    k = rand(b, nh, h, w, dk, s=scale)
    v = rand(b, nh, h, w, dv)
    rel_h = torch.randn(ks, dk // 2, generator=g, dtype=torch.float64)
    rel_w = torch.randn(ks, dk - dk // 2, generator=g, dtype=torch.float64)
    # round to the kernel's dtype first, so the reference sees exactly the kernel's inputs
    master = [t.to(dtype).to(torch.float64) for t in (q, k, v, rel_h, rel_w)]
    if channels_first:
        kernel = [t.to(dtype) if t.dim() < 5
                  else t.permute(0, 1, 4, 2, 3).to(dtype).contiguous().permute(0, 1, 3, 4, 2)
                  for t in master]
        assert not kernel[0].is_contiguous()
    else:
        kernel = [t.to(dtype) for t in master]
    kernel = [t.to(device) for t in kernel]
    return master, kernel


def _run_both(master, kernel, ks, rel, block_pixels=None, seed=1):
    """Output and the gradients of ``<out, g>`` (random ``g``) for the kernel and the brute force."""
    if not rel:
        master = master[:3] + [None, None]
        kernel = kernel[:3] + [None, None]
    a = [None if t is None else t.detach().clone().requires_grad_(True) for t in kernel]
    b = [None if t is None else t.detach().clone().requires_grad_(True) for t in master]
    out = triton_local_attention(*a, ks, block_pixels=block_pixels)
    ref = brute_force(*b, ks)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(out.dtype).double()  # autograd hands the kernel the gradient in out's dtype
    (out.double() * g.to(out.device)).sum().backward()
    (ref * g).sum().backward()
    grads = [(None if t is None else t.grad) for t in a]
    ref_grads = [(None if t is None else t.grad) for t in b]
    return out, ref, grads, ref_grads


CASES = [  # (B, Nh, H, W, dk, dv, kernel_size, relative, block_pixels, channels_first)
    (2, 2, 5, 7, 5, 3, 3, True, 32, True),  # blocks across heads, odd dk (2 + 3), dv != dk, strides
    (1, 2, 3, 2, 4, 6, 7, True, None, False),  # map smaller than the window
    (1, 1, 1, 1, 3, 3, 3, True, None, False),  # a single pixel: attends to itself
    (1, 2, 4, 5, 6, 6, 3, False, None, False),  # no relative term
    (1, 1, 6, 5, 3, 2, 5, True, None, False),  # k = 5, map taller than the window only
]


@pytest.mark.parametrize("b,nh,h,w,dk,dv,ks,rel,bp,cf", CASES)
def test_values_and_gradients_match_brute_force(device, b, nh, h, w, dk, dv, ks, rel, bp, cf):
    master, kernel = _inputs(b, nh, h, w, dk, dv, ks, device, channels_first=cf)
    out, ref, grads, ref_grads = _run_both(master, kernel, ks, rel, bp)
    assert out.shape == (b, nh, h, w, dv) and out.dtype == torch.float32
    torch.testing.assert_close(out.double().cpu(), ref, rtol=0, atol=1e-5)
    for name, g, rg in zip(("q", "k", "v", "rel_h", "rel_w"), grads, ref_grads):
        if rg is None:
            assert g is None, name
            continue
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double().cpu(), rg, rtol=0, atol=5e-5, msg=f"grad of {name}")
    if h * w > 1:  # (a single pixel's softmax has one term: only v gets a gradient)
        assert float(ref_grads[0].abs().max()) > 0.1  # the gradients tested are not trivially small


# The arithmetic is float32 and the reference sees exactly the rounded inputs (and the rounded
# output gradient), so the only error is the final rounding of the output and of each gradient to
# the input dtype: at most about one unit in the last place of the largest value (float16: 2^-10
# relative; bfloat16: 2^-7; the interpreter's casts truncate). Tolerances: twice / 1.3x that.
HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _assert_close_to_max(x, ref, tol, name):
    x, ref = x.detach().double().cpu(), ref.detach()
    atol = tol * float(ref.abs().max())
    torch.testing.assert_close(x, ref, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(device, dtype):
    master, kernel = _inputs(1, 2, 4, 5, 6, 4, 3, device, dtype=dtype, scale=2.0)
    out, ref, grads, ref_grads = _run_both(master, kernel, 3, True)
    assert out.dtype == dtype
    _assert_close_to_max(out, ref, HALF_TOL[dtype], "out")
    for name, g, rg in zip(("q", "k", "v", "rel_h", "rel_w"), grads, ref_grads):
        assert g.dtype == dtype, name
        _assert_close_to_max(g, rg, HALF_TOL[dtype], f"grad of {name}")


def test_bf16_maps_with_float32_relative_embeddings(device):
    # The autocast case: bf16 projections, float32 parameters; each gradient in its input's dtype.
    master, kernel = _inputs(1, 1, 3, 4, 4, 4, 3, device, dtype=torch.bfloat16, scale=2.0)
    kernel[3], kernel[4] = master[3].float().to(device), master[4].float().to(device)
    out, ref, grads, ref_grads = _run_both(master, kernel, 3, True)
    assert out.dtype == torch.bfloat16
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3 + [torch.float32] * 2
    _assert_close_to_max(out, ref, HALF_TOL[torch.bfloat16], "out")
    for g, rg in zip(grads, ref_grads):
        _assert_close_to_max(g, rg, HALF_TOL[torch.bfloat16], "grads")
    for g, rg in zip(grads[3:], ref_grads[3:]):  # float32 gradients: float32 accuracy
        torch.testing.assert_close(g.double().cpu(), rg, rtol=0, atol=5e-5)


def test_gradients_for_a_subset_of_inputs(device):
    # Frozen inputs get None; the backward passes skip what is not needed (pass 2 entirely when
    # neither k nor v needs a gradient) and the rest equals the full computation.
    _, kernel = _inputs(1, 2, 4, 3, 4, 3, 3, device)
    full = [t.clone().requires_grad_(True) for t in kernel]
    triton_local_attention(*full, 3).sum().backward()
    for wanted in ((0, 3, 4), (2,)):  # (q, rel): no pass 2; (v,): pass 2 without dk
        part = [t.clone().requires_grad_(i in wanted) for i, t in enumerate(kernel)]
        triton_local_attention(*part, 3).sum().backward()
        for i in range(5):
            if i in wanted:
                torch.testing.assert_close(part[i].grad, full[i].grad, rtol=0, atol=1e-6)
            else:
                assert part[i].grad is None


def test_out_of_map_keys_are_excluded(device):
    # Constant values stay constant at the border only if padding gets no weight.
    _, kernel = _inputs(1, 1, 3, 5, 4, 1, 5, device, scale=3.0)
    q, k, _, rh, rw = kernel
    v = torch.ones(1, 1, 3, 5, 1, device=device)
    out = triton_local_attention(q, k, v, rh, rw, 5)
    torch.testing.assert_close(out, torch.ones_like(out), rtol=0, atol=1e-6)


def test_saved_for_backward_is_the_inputs_out_and_lse(device):
    # Memory claim of the module docstring: nothing of size k^2 per pixel, no copies of the inputs.
    _, kernel = _inputs(2, 2, 3, 4, 4, 3, 5, device, dtype=torch.bfloat16, channels_first=True)
    args = [t.clone().requires_grad_(True) for t in kernel]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = triton_local_attention(*args, 5)
    inputs = [t for t in saved if any(t.data_ptr() == a.data_ptr() for a in args)]
    others = sorted(((tuple(t.shape), t.dtype) for t in saved if not any(t is i for i in inputs)), key=str)
    assert len(inputs) == 5
    assert others == [((2, 2, 3, 4), torch.float32), ((2, 2, 3, 4, 3), torch.float32)]  # lse, out
    assert out.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- errors
@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter runs CPU tensors")
def test_cpu_tensors_need_the_interpreter():
    _, (q, k, v, rh, rw) = _inputs(1, 1, 3, 3, 4, 4, 3, "cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors.*TRITON_INTERPRET=1.*before"):
        triton_local_attention(q, k, v, rh, rw, 3)


def test_errors():
    # the shared argument rules are check_local_attention's (test_local_attention.py tests them):
    # one of them here shows they run; then the kernels' own
    _, (q, k, v, rh, rw) = _inputs(1, 1, 3, 3, 4, 4, 3, "cpu")
    with pytest.raises(ValueError, match="kernel_size=5 rows"):
        triton_local_attention(q, k, v, rh, rw, 5)
    with pytest.raises(ValueError, match=r"float64.*impl='neighborhood'"):
        triton_local_attention(q.double(), k, v, rh, rw, 3)
    with pytest.raises(ValueError, match="block_pixels must be a power of two"):
        triton_local_attention(q, k, v, rh, rw, 3, block_pixels=12)


def test_module_imports_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    package = "aadet.layers.functional.backends"
    for module in (triton_kernels, sasa_triton):  # fresh copies: the shared module first
        name = module.__name__.rsplit(".", 1)[1]
        spec = importlib.util.spec_from_file_location(f"{package}.{name}", module.__file__)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, mod)
        spec.loader.exec_module(mod)
    assert mod.TRITON_AVAILABLE is False and mod.TRITON_INTERPRETED is False
    _, (q, k, v, rh, rw) = _inputs(1, 1, 3, 3, 4, 4, 3, "cpu")
    with pytest.raises(ValueError, match="needs the 'triton' package"):
        mod.triton_local_attention(q, k, v, rh, rw, 3)


# ----------------------------------------------------------------------------- GPU sizes
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("h,w,ks,dk", [(19, 23, 7, 32), (40, 33, 3, 16), (5, 4, 7, 20)])
def test_cuda_matches_neighborhood_route(h, w, ks, dk):
    # Sizes of the real layers (res3-res5 maps of small images, 8 heads): against the float64
    # neighborhood route (itself tested against the brute force), values and every gradient.
    master, kernel = _inputs(2, 8, h, w, dk, dk, ks, "cuda", scale=1.5, channels_first=True)
    a = [t.detach().clone().requires_grad_(True) for t in kernel]
    b = [t.detach().clone().cuda().requires_grad_(True) for t in master]
    out = triton_local_attention(*a, ks)
    ref = local_self_attention_2d(*b, ks, impl="neighborhood")
    g = torch.randn_like(ref)
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
    for name, ta, tb in zip(("q", "k", "v", "rel_h", "rel_w"), a, b):
        tol = 1e-4 * max(1.0, float(tb.grad.abs().max()))
        torch.testing.assert_close(ta.grad.double(), tb.grad, rtol=0, atol=tol, msg=f"grad of {name}")


# ----------------------------------------------------------------------------- compiled path, no GPU
# The interpreter runs the kernels' Python; it does not type-check them like the compiler
# (loop-carried types, constexpr branches, casts). tests/helpers/triton_aot.py runs the launch code on CPU
# with the kernels recorded and compiles each launch down to a cubin for sm_90 (Triton's bundled
# LLVM and ptxas need no GPU).
compiles_for_h100 = pytest.mark.skipif(
    TRITON_INTERPRETED or not triton_aot.nvidia_backend_available(), reason="needs Triton's CUDA backend")
SASA_KERNELS = ("_fwd_kernel", "_bwd_query_kernel", "_bwd_key_kernel")
#: fp32: a float32 model; bf16: bf16 autocast (bf16 maps, float32 relative embeddings).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def config_sasa_layers():
    """``{(num_heads, head_channels, kernel_size, relative): [configs]}`` of every config."""
    return triton_aot.config_attention_layers()["sasa"]


def _layer_launches(spec, precision, frozen=(), size=(5, 7)):
    """The kernel launches of a ``LocalSelfAttention2d`` of ``spec`` on the ``impl="triton"``
    route, forward and backward (the parts in ``frozen`` need no gradient: ``"q"``, ``"k"``,
    ``"v"``, ``"rel"``), on CPU with the kernels recorded."""
    heads, d, ks, rel = spec
    layer = LocalSelfAttention2d(heads * d, heads * d, ks, heads, positional_encoding="relative" if rel else "none",
                                 impl="triton")
    for part, module in (("q", layer.query), ("k", layer.key), ("v", layer.value)):
        module.requires_grad_(part not in frozen)
    for p in (layer.rel_h, layer.rel_w):
        if p is not None:
            p.requires_grad_("rel" not in frozen)
    x = torch.randn(1, heads * d, *size)

    def run():
        with torch.autocast("cpu", dtype=PRECISIONS[precision] or torch.bfloat16,
                            enabled=PRECISIONS[precision] is not None):
            out = layer(x)
        if out.requires_grad:
            out.float().sum().backward()

    # the launch as triton_local_attention makes it, without its "CUDA tensors" check
    def launch(q, k, v, rel_h, rel_w, kernel_size, *, block_pixels=None):
        return sasa_triton._TritonLocalAttention.apply(q, k, v, rel_h, rel_w, kernel_size, block_pixels)

    saved = sasa_triton.launch_triton_local_attention
    sasa_triton.launch_triton_local_attention = launch
    try:
        return triton_aot.run_recorded(sasa_triton, SASA_KERNELS, run)
    finally:
        sasa_triton.launch_triton_local_attention = saved




@compiles_for_h100
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_kernels_compile_for_an_h100_without_a_gpu(config_sasa_layers, precision):
    # Every SASA layer of the COCO and demo configs, trained in fp32 and under bf16 autocast:
    # forward and both backward passes with every gradient, as the launch code makes them.
    assert {c.split("/")[1] for cs in config_sasa_layers.values() for c in cs} == {"COCO-Detection", "Demo"}
    launches = [launch for spec in config_sasa_layers for launch in _layer_launches(spec, precision)]
    seen = {(launch.kernel.__name__, launch.kwargs["DK_PAD"], launch.kwargs["BLOCK_P"]) for launch in launches}
    tile = sasa_triton._ELEMENTS_PER_THREAD * 32 * sasa_triton._NUM_WARPS  # [BLOCK_P, d_pad] elements
    for heads, d, ks, rel in config_sasa_layers:
        pad = 1 << (d - 1).bit_length()
        assert {(k, pad, tile // pad) for k in SASA_KERNELS} <= seen, (d, sorted(seen))
    maps = "*bf16" if precision == "bf16" else "*fp32"
    for launch in launches:
        sig = triton_aot.specialization(launch)[0]
        assert sig["Q"] == sig["K"] == sig["V"] == maps and sig.get("RH", "*fp32") == "*fp32", sig
    assert triton_aot.assert_compile(launches) >= 3 * len({d for _, d, _, _ in config_sasa_layers})


@pytest.mark.slow  # some 85 more variants each: 1-3 minutes on 2 cores without Triton's cache
@compiles_for_h100
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_variant_the_launch_code_makes_compiles_for_an_h100(config_sasa_layers, precision):
    # Beyond the configs' training launches: without the relative term (positional encodings
    # "none", "sine2d"), every subset of inputs needing a gradient (frozen projections or
    # embeddings: the NEED_* flags of both backward passes), and a 1-pixel map (Triton folds an
    # integer argument equal to 1 into a constant: H = W = 1).
    parts = ("q", "k", "v", "rel")
    frozen_sets = [tuple(p for i, p in enumerate(parts) if bits >> i & 1) for bits in range(16)]
    launches = []
    for heads, d, ks, rel in config_sasa_layers:
        launches += _layer_launches((heads, d, ks, rel), precision, size=(1, 1))
        for with_rel in (True, False):
            for frozen in frozen_sets:
                launches += _layer_launches((heads, d, ks, with_rel), precision, frozen)
    flags = {(launch.kernel.__name__, *(launch.kwargs.get(f) for f in ("NEED_DQ", "NEED_DREL", "NEED_DK", "NEED_DV")))
             for launch in launches}
    assert {f for f in flags if f[0] == "_bwd_query_kernel"} == {
        ("_bwd_query_kernel", dq, drel, None, None) for dq in (True, False) for drel in (True, False)}
    assert {f for f in flags if f[0] == "_bwd_key_kernel"} == {
        ("_bwd_key_kernel", None, None, dk, dv) for dk, dv in ((True, True), (True, False), (False, True))}
    assert {launch.kwargs["HAS_REL"] for launch in launches} == {True, False}
    triton_aot.assert_compile(launches)
