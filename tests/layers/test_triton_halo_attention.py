"""HaloNet's ``"triton"`` route (``backends/halonet_triton``: AA's Triton flash-attention kernel over
every block's window, the position tables and border mask added in the kernel) against the float64
brute force, values and gradients.

On CPU the kernels run in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before the
process first imports triton: a plain ``pytest`` run skips the ``cpu`` cases in its own process and
:func:`test_kernels_in_the_triton_interpreter` runs them in a subprocess that sets the flag. The
``cuda`` variants run the same checks on a GPU (compiled kernels). Without a GPU, the ``compile``
test compiles every launch of the configs' HaloNet layers for sm_90 (``tests/helpers/triton_aot.py``).
"""
import pytest
import torch

from aadet.layers.functional.backends import aa_triton, halonet_triton
from aadet.layers.functional.backends.aa_triton import TRITON_AVAILABLE, TRITON_INTERPRETED
from aadet.layers.functional.halo_attention import halo_attention_2d
from aadet.layers.functional.reference import halo_attention_2d_reference as brute_force
from aadet.layers.halo_attention import HaloSelfAttention2d

from tests.helpers import passed_in_triton_interpreter, triton_aot, triton_devices

pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs the triton package")

DEVICES = triton_devices()
# Error / max(1, max |reference|) against float64 on the same rounded inputs: the kernel's (see
# tests/layers/test_aa_kernels.py; measured here fp32 <= 1.6e-6).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2.5e-2}
#: (B, Nh, H, W, d, dv, block, halo, stride, relative): partial blocks, a halo wider than the
#: kernel's tile of key rows (b 4, h 5: a border block's first tile lies wholly outside the map),
#: strided queries, no embeddings, no halo.
CASES = [
    (1, 2, 9, 11, 8, 8, 4, 2, 1, True),
    (2, 1, 16, 16, 8, 4, 8, 3, 1, True),
    (1, 2, 7, 13, 8, 8, 4, 5, 1, True),
    (1, 1, 10, 10, 8, 8, 4, 2, 2, True),
    (1, 2, 8, 8, 8, 8, 4, 0, 1, False),
    (1, 2, 9, 6, 8, 8, 4, 1, 1, False),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.mark.skipif(TRITON_INTERPRETED, reason="this process already runs the interpreter")
def test_kernels_in_the_triton_interpreter():
    selected = "not compile_for_an_h100 and not in_the_triton_interpreter"  # the compiled-only tests
    assert passed_in_triton_interpreter(__file__, "-m", "not cuda", "-k", selected) >= len(CASES) + 3


def _inputs(case, seed=0):
    bsz, nh, h, w, d, dv, b, halo, s, relative = case
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    ho, wo = -(-h // s), -(-w // s)
    args = [r(bsz, nh, ho, wo, d), r(bsz, nh, h, w, d), r(bsz, nh, h, w, dv)]
    rows = 2 * (b + halo) - 1
    args += [r(rows, d // 2), r(rows, d - d // 2)] if relative else [None, None]
    return args, dict(block_size=b, halo_size=halo, query_stride=s)


def _check(case, device, dtype, seed=0):
    args, geo = _inputs(case, seed)
    leaves = [t.requires_grad_() for t in args if t is not None]
    ref = brute_force(*args, **geo)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    want = torch.autograd.grad((ref * cot).sum(), leaves)
    ours = [None if t is None else t.detach().to(device, dtype).requires_grad_() for t in args]
    out = halo_attention_2d(*ours, impl="triton", **geo)
    assert out.dtype == dtype and out.shape == ref.shape
    got = torch.autograd.grad((out.double() * cot.to(device)).sum(), [t for t in ours if t is not None])
    tol = TOL[dtype]
    for name, a, b in zip(["out", "q", "k", "v", "rel_h", "rel_w"], [out] + list(got), [ref] + list(want)):
        err = float((a.detach().double().cpu() - b.detach()).abs().max()) / max(1.0, float(b.abs().max()))
        assert err <= tol, f"{name}: {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:9])) + ("" if c[9] else "-norel"))
def test_fp32_values_and_gradients_match_float64(device, case):
    _check(case, device, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types(device, dtype):
    _check(CASES[0], device, dtype)


def test_calls_past_the_grid_limit_go_in_chunks(device, monkeypatch):
    """More (batch, head, block) problems than one launch's 65,535 program rows: launched in chunks,
    each problem independent, so the same numbers."""
    args, geo = _inputs(CASES[1])
    args = [None if t is None else t.float().to(device) for t in args]
    whole = halo_attention_2d(*args, impl="triton", **geo)  # 2 x 1 x 4 blocks: one launch
    monkeypatch.setattr(halonet_triton, "_MAX_GRID_Y", 3)
    launches = []
    real = halonet_triton.triton_attention_on_key_grid
    monkeypatch.setattr(halonet_triton, "triton_attention_on_key_grid",
                        lambda *a, **kw: launches.append(a[0].shape[0]) or real(*a, **kw))
    assert torch.equal(halo_attention_2d(*args, impl="triton", **geo), whole)
    assert launches == [3, 3, 2]


def test_layer_on_the_route_matches_the_materialized_route(device):
    torch.manual_seed(0)
    layer = HaloSelfAttention2d(8, 16, block_size=4, halo_size=2, num_heads=2, impl="triton").to(device)
    ref = HaloSelfAttention2d(8, 16, block_size=4, halo_size=2, num_heads=2, impl="materialized").to(device)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 8, 9, 7, device=device)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=2e-5)


def test_key_grid_argument_errors():
    q = torch.zeros(2, 5, 8)
    with pytest.raises(ValueError, match=r"k must have shape \[2, 12, 8\] \(keys on the 3x4 grid\)"):
        aa_triton.triton_attention_on_key_grid(q, torch.zeros(2, 11, 8), torch.zeros(2, 11, 8), None, None, (3, 4))
    with pytest.raises(ValueError, match=r"t_col must have shape \[2, 5, 4\]"):
        aa_triton.triton_attention_on_key_grid(q, torch.zeros(2, 12, 8), torch.zeros(2, 12, 8), None,
                                               torch.zeros(2, 5, 3), (3, 4))


# ----------------------------------------------------------------------------- compiled for sm_90
compiles_for_h100 = pytest.mark.skipif(
    not TRITON_AVAILABLE or TRITON_INTERPRETED or not triton_aot.nvidia_backend_available(),
    reason="needs Triton's CUDA backend (compiled mode)")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


@compiles_for_h100
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_kernels_compile_for_an_h100_without_a_gpu(precision):
    """Every HaloNet layer of the configs on the ``triton`` route, forward and backward, at a map
    with partial blocks and a border: each launch compiled for sm_90."""
    layers = triton_aot.config_attention_layers()["halo"]
    assert layers, "no config has a HaloNet layer"
    launches = []
    saved = aa_triton._check_runnable  # the launch without its "CUDA tensors" check
    aa_triton._check_runnable = lambda q: None
    try:
        for heads, d, b, h, s, rel in layers:
            layer = HaloSelfAttention2d(8, heads * d, block_size=b, halo_size=h, num_heads=heads, stride=s,
                                        positional_encoding="relative" if rel else "none", impl="triton")
            x = torch.randn(1, 8, 2 * b + 3, 2 * b + 1)

            def run():
                with torch.autocast("cpu", dtype=PRECISIONS[precision] or torch.bfloat16,
                                    enabled=PRECISIONS[precision] is not None):
                    out = layer(x)
                out.float().sum().backward()

            launches += triton_aot.run_recorded(aa_triton._KERNELS, ("fwd", "dkdv", "dq"), run)
    finally:
        aa_triton._check_runnable = saved
    assert {launch.kernel.__name__ for launch in launches} == {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"}
    dtype = "*bf16" if precision == "bf16" else "*fp32"
    for launch in launches:
        sig = triton_aot.specialization(launch)[0]
        assert sig["Q"] == sig["K"] == sig["V"] == dtype and sig["TR"] == sig["TC"] == "*fp32", sig
    triton_aot.assert_compile(launches)
