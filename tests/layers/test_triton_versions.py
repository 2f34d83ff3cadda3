"""The Triton kernels compile for an H100 (sm_90) under the lent GPU machines' Triton as under this
environment's own: the AOT compile tests of both kernel families
(``test_triton_local_attention.py``; ``test_aa_kernels.py`` and ``test_triton_halo_attention.py``,
whose route runs AA's kernel; ``-k compile_for_an_h100``, the non-slow ones) run again in a
subprocess whose ``import triton`` finds the machines' version first.

That Triton lives in a side folder (``make triton-side``: ``pip install --target``, default
``.cache/triton<version>``, ``$AADET_TRITON_SIDE`` to move it), never installed into the
environment; its version is the machines' ``triton==`` line of
``requirements/gpu-machine-installed.txt``. CI (``.ci/run``) makes it before ``make test-packaging``.
"""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO


def machine_triton_version() -> str:
    """The Triton version of the lent GPU machines (``requirements/gpu-machine-installed.txt``)."""
    with open(os.path.join(REPO, "requirements", "gpu-machine-installed.txt")) as f:
        found = [m.group(1) for m in (re.match(r"triton==(\S+)", line.strip()) for line in f) if m]
    if len(found) != 1:
        raise ValueError(f"requirements/gpu-machine-installed.txt: expected one 'triton==VERSION' line; got {found}")
    return found[0]


SIDE = os.environ.get("AADET_TRITON_SIDE", os.path.join(REPO, ".cache", f"triton{machine_triton_version()}"))


@pytest.mark.packaging
@pytest.mark.slow  # 75 s on 2 cores (measured with Triton 3.6.0): every kernel compiled anew, no cache
@pytest.mark.skipif(not os.path.isdir(os.path.join(SIDE, "triton")),
                    reason=f"no Triton side folder {SIDE}: `make triton-side` makes it")
def test_kernels_compile_for_an_h100_under_the_gpu_machines_triton(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SIDE, REPO]), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    probe = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__); print(triton.__file__)"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    version, where = (probe.stdout.split() + ["", ""])[:2]
    assert version == machine_triton_version() and where.startswith(SIDE), (probe.stdout, probe.stderr[-2000:])
    tests = ["tests/layers/test_triton_local_attention.py", "tests/layers/test_aa_kernels.py",
             "tests/layers/test_triton_halo_attention.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
           "-k", "compile_for_an_h100", *tests]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and "skipped" not in summary and re.search(r"\d+ passed", summary), (
        f"Triton {version} ({where}):\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}")
