"""The C++ CPU kernels' build and fallback (:mod:`aadet.layers.functional.backends.cpu_kernels`):
without a compiler, or switched off, ``auto`` takes each kernel's pure-PyTorch route and gives the
same result, and naming ``impl="cpp"`` says why the kernel is missing. Each kernel's exactness:
test_sasa_cpp.py, test_aa_cpp.py, test_halo_attention.py, test_stem_cpp.py."""
import os
import subprocess
import sys
import textwrap

import pytest

from aadet.layers.functional.backends.cpu_kernels import KERNELS
from tests.helpers import REPO

#: kernel -> (fallback route, a script printing "auto: <route>", "equal: <bool>", "cpp: <error>")
_SCRIPTS = {
    "sasa": ("neighborhood", """
        from aadet.layers.functional.local_attention import auto_local_attention_impl as auto
        from aadet.layers.functional.local_attention import local_self_attention_2d
        q = torch.randn(1, 2, 5, 6, 4, dtype=torch.float64)
        route = auto(q, 7)
        fn = lambda impl: local_self_attention_2d(q, q, q, None, None, 7, impl=impl)
    """),
    "aa": ("fused", """
        from aadet.layers.functional import relative_self_attention_2d
        from aadet.layers.functional.logit_tables import auto_logit_table_impl as auto
        q, rh, rw = torch.randn(1, 2, 5, 6, 4), torch.randn(9, 4), torch.randn(11, 4)
        route = auto(q)
        fn = lambda impl: relative_self_attention_2d(q, q, q, rh, rw, impl=impl)
    """),
    "halonet": ("bmm", """
        from aadet.layers.functional import halo_attention_2d
        from aadet.layers.functional.halo_attention import auto_halo_attention_impl as auto
        q, rh, rw = torch.randn(1, 2, 5, 6, 4), torch.randn(5, 2), torch.randn(5, 2)
        route = auto(q)
        fn = lambda impl: halo_attention_2d(q, q, q, rh, rw, 2, 1, impl=impl)
    """),
    "stem": ("factorized", """
        from aadet.layers.attention_stem import SpatiallyAwareAttentionStem
        x = torch.randn(1, 3, 9, 6, dtype=torch.float64)
        route = SpatiallyAwareAttentionStem(3, 16).route()
        def fn(impl):
            torch.manual_seed(0)
            return SpatiallyAwareAttentionStem(3, 16, norm="", impl=impl).double()(x)
    """),
}
_REPORT = """
    print("auto:", route)
    print("equal:", torch.equal(fn("auto"), fn(route)))
    try:
        fn("cpp")
    except RuntimeError as e:
        print("cpp:", e)
"""


def test_every_kernel_has_a_fallback_script():
    assert set(_SCRIPTS) == set(KERNELS)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(_SCRIPTS))
@pytest.mark.parametrize("env", [{"CXX": "/nonexistent/g++"}, {"AADET_CPP_KERNELS": "0"}],
                         ids=["no-compiler", "switched-off"])
def test_without_the_kernel_auto_falls_back_and_cpp_says_why(tmp_path, kernel, env):
    fallback, script = _SCRIPTS[kernel]
    code = "import torch\n" + textwrap.dedent(script) + textwrap.dedent(_REPORT)
    # A fresh extension cache, so the build really runs (and fails) without a compiler.
    run_env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), **env)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=run_env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"auto: {fallback}" in res.stdout and "equal: True" in res.stdout
    assert f"impl='cpp' needs the {KERNELS[kernel].what}, which did not build" in res.stdout
    if "CXX" in env:
        assert f"the slower '{fallback}' route is used instead" in res.stderr
    else:
        assert "AADET_CPP_KERNELS=0" in res.stdout
