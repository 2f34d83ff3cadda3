"""The exactness tests catch every broken-attention mutation, in every attention module.

``tests/helpers/broken_attention.py`` breaks the attention of a whole model (the mutations behind
the learning measurements, docs/testing.md). Here each mutation is applied to each module kind that
computes attention -- the SASA layer (its C++ kernel in both modes: keeping the attention weights
for backward, and recomputing them there), the HaloNet layer (strided: attention downsampling), the
AA layer (also on its C++ kernel, which keeps the probabilities for backward at these sizes),
SASA's spatially-aware stem (its two PyTorch routes, and its C++ kernel in both of its weight
forms) and CCNet's criss-cross block, alone and recurrent in RCCA (``gamma`` set to 0.5: at its
init of 0 the block is the identity) -- and the module's output is compared with its float64
brute-force composition, the comparison the exactness tests make (for the C++ kernels of the SASA
layer, AA and the stem also the input's gradient: their own code is their backward): correct, they
agree to rounding; broken, by far more. So the harness reaches every module, and each mutation is a
bug the exactness tests would catch. The C++ kernels' kinds skip where they cannot be built;
``relative_zero`` skips on CCNet's kinds, which have no relative embeddings to zero.
"""
import pytest
import torch

from aadet.layers import AugmentedConv2d, HaloSelfAttention2d, LocalSelfAttention2d
from aadet.layers.attention_stem import SpatiallyAwareAttentionStem
from aadet.layers.criss_cross import CrissCrossAttention2d, RecurrentCrissCrossAttention
from aadet.layers.functional.backends import aa_cpp, stem_cpp

from tests.helpers.broken_attention import MUTATIONS, break_attention
from tests.layers.test_attention_stem import reference_stem
from tests.layers.test_augmented_conv import reference_forward as reference_aa
from tests.layers.test_criss_cross import reference_forward as reference_ccnet
from tests.layers.test_halo_layer import brute_force as reference_halo
from tests.layers.test_local_attention import _manual_layer as reference_sasa

D = torch.float64


def _with_gamma(module, gamma=0.5):
    """``module`` with its criss-cross block's ``gamma`` set (0 at init: the block is the identity)."""
    block = module.cca if isinstance(module, RecurrentCrissCrossAttention) else module
    with torch.no_grad():
        block.gamma.fill_(gamma)
    return module


#: module kind -> (float64 module, its brute-force composition); the stem in each of its routes
#: (its C++ kernel: the factorized weight form where in <= out / heads, else the projected one).
MODULES = {
    # impl="cpp": at these narrow heads "auto" would recompute, and the stored mode is tested here
    "sasa": (lambda: LocalSelfAttention2d(6, 8, kernel_size=5, num_heads=2, block_size=3, impl="cpp"),
             reference_sasa),
    "sasa_recompute": (lambda: LocalSelfAttention2d(6, 8, kernel_size=5, num_heads=2, recompute_attention=True),
                       reference_sasa),
    "halo": (lambda: HaloSelfAttention2d(6, 8, block_size=4, halo_size=1, num_heads=2, stride=2), reference_halo),
    "aa": (lambda: AugmentedConv2d(6, 16, dk=8, dv=8, num_heads=2, max_size=16), reference_aa),
    # the C++ kernel in float64 ("auto" takes "materialized" there), probabilities kept for backward
    "aa_cpp": (lambda: AugmentedConv2d(6, 16, dk=8, dv=8, num_heads=2, max_size=16, impl="cpp"), reference_aa),
    "stem_factorized": (lambda: SpatiallyAwareAttentionStem(3, 32, num_heads=1, norm="", impl="factorized"),
                        reference_stem),
    "stem_projected": (lambda: SpatiallyAwareAttentionStem(3, 8, num_heads=2, norm="", impl="projected"),
                       reference_stem),
    "stem_cpp": (lambda: SpatiallyAwareAttentionStem(3, 32, num_heads=1, norm="", impl="cpp"), reference_stem),
    "stem_cpp_projected_form": (lambda: SpatiallyAwareAttentionStem(6, 8, num_heads=2, norm="", impl="cpp"),
                                reference_stem),
    "ccnet": (lambda: _with_gamma(CrissCrossAttention2d(8, num_heads=2, reduction=2)), reference_ccnet),
    "ccnet_recurrent": (lambda: _with_gamma(RecurrentCrissCrossAttention(8, 6, inter_channels=8, reduction=2)),
                        reference_ccnet),
}
#: the kinds without relative embeddings: ``relative_zero`` has nothing to break there
NO_RELATIVE_KINDS = ("ccnet", "ccnet_recurrent")
#: the kinds whose input gradient is compared too (the C++ kernels' own backward passes)
GRADIENT_KINDS = ("sasa", "sasa_recompute", "aa_cpp", "stem_cpp", "stem_cpp_projected_form")
CORRECT_ATOL = 1e-10  # what the exactness tests allow (they use 1e-10 to 1e-12)
BROKEN_MIN = 1e-3  # every broken module is at least this far from its reference


def _max_error(kind):
    if kind.startswith("stem_cpp") and not stem_cpp.KERNEL.available():
        pytest.skip(f"the stem's C++ kernel is unavailable: {stem_cpp.KERNEL.build_error()}")
    if kind == "aa_cpp" and not aa_cpp.KERNEL.available():
        pytest.skip(f"AA's C++ kernel is unavailable: {aa_cpp.KERNEL.build_error()}")
    make, reference = MODULES[kind]
    torch.manual_seed(0)
    module = make().double()
    x = torch.randn(2, module.in_channels, 9, 7, dtype=D)
    if kind not in GRADIENT_KINDS:
        with torch.no_grad():
            return (module(x) - reference(module, x)).abs().max().item()
    x.requires_grad_(True)
    out, ref = module(x), reference(module, x)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    (gx_ref,) = torch.autograd.grad(ref, x, g)
    return max((out - ref).abs().max().item(), (gx - gx_ref).abs().max().item())


def test_stem_routes_are_all_exercised():
    routes = {kind: MODULES[kind][0]().route() for kind in MODULES if kind.startswith("stem")}
    assert routes == {"stem_factorized": "factorized", "stem_projected": "projected", "stem_cpp": "cpp",
                      "stem_cpp_projected_form": "cpp"}
    cpp, projected_form = MODULES["stem_cpp"][0](), MODULES["stem_cpp_projected_form"][0]()
    assert cpp.cpp_factorized and not projected_form.cpp_factorized  # the kernel's two weight forms


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_correct_module_matches_its_reference(kind):
    assert _max_error(kind) <= CORRECT_ATOL


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("kind", sorted(MODULES))
def test_broken_module_fails_its_reference(kind, mutation, monkeypatch):
    if mutation == "relative_zero" and kind in NO_RELATIVE_KINDS:
        pytest.skip(f"{kind} has no relative embeddings for relative_zero to zero")
    break_attention(mutation, patch=monkeypatch.setattr)
    err = _max_error(kind)
    print(f"{kind} {mutation}: max error {err:.3g}")
    assert err > BROKEN_MIN, err
