"""The Triton kernels are reachable through the public functions' ``impl`` and give the same
values and gradients as the default routes (run under Triton's interpreter in a fresh process:
``TRITON_INTERPRET`` is read when Triton is first imported)."""
import os
import subprocess
import sys
import textwrap

import pytest

from aadet.layers import LOCAL_ATTENTION_BACKENDS, LOGIT_TABLE_BACKENDS

SCRIPT = textwrap.dedent(
    """
    import torch
    from aadet.layers.functional import local_self_attention_2d, relative_self_attention_2d

    def grads(fn, inputs):
        out = fn(*inputs)
        return [out] + list(torch.autograd.grad(out.square().sum(), inputs))

    torch.manual_seed(0)
    B, Nh, H, W, d = 1, 2, 5, 9, 8
    q, k, v = (torch.randn(B, Nh, H, W, d, requires_grad=True) for _ in range(3))
    # SASA: window 7 on a 5 x 9 map (the window is clipped at every border)
    rh, rw = torch.randn(7, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)
    ref = grads(lambda *t: local_self_attention_2d(*t, 7, impl="neighborhood"), (q, k, v, rh, rw))
    got = grads(lambda *t: local_self_attention_2d(*t, 7, impl="triton"), (q, k, v, rh, rw))
    print("sasa", max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref)))
    # AA: global attention with 2D relative logits
    rh, rw = torch.randn(2 * H - 1, d, requires_grad=True), torch.randn(2 * W - 1, d, requires_grad=True)
    ref = grads(lambda *t: relative_self_attention_2d(*t, impl="materialized"), (q, k, v, rh, rw))
    got = grads(lambda *t: relative_self_attention_2d(*t, impl="triton"), (q, k, v, rh, rw))
    print("aa", max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref)))
    """
)


def test_triton_is_an_impl_of_both_attentions():
    assert "triton" in LOCAL_ATTENTION_BACKENDS.impls()
    assert {"triton", "flex"} <= set(LOGIT_TABLE_BACKENDS.impls())


def test_importing_aadet_does_not_import_the_kernel_modules():
    kernels = [f"aadet.layers.functional.backends.{m}"
               for m in ("sasa_triton", "aa_triton", "triton_kernels", "aa_flex")]
    code = f"import sys, aadet; print(any(m in sys.modules for m in {kernels!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode != 0,
    reason="triton is not installed",
)
def test_triton_impls_match_default_routes_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    errors = dict(line.split() for line in out.stdout.strip().splitlines())
    # float32 kernels vs float32 routes: relative error of values and every gradient
    assert float(errors["sasa"]) < 1e-5, errors
    assert float(errors["aa"]) < 1e-5, errors
