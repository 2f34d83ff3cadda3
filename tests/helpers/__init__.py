"""What the tests share that is not a test: the checkout's path, :func:`load_tool` and
:func:`load_dev`, :func:`passed_in_triton_interpreter` and :func:`triton_devices`, and in its
modules the scripts the tests run (``train_worker.py``, ``broken_attention.py``,
``learning_runs.py``) and their helpers (``triton_aot``, ``tiny_training``, ``detectors``)."""
import importlib.util
import os
import re
import subprocess
import sys
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools")
DEV = os.path.join(REPO, "dev")


def load_tool(name: str) -> ModuleType:
    """``tools/{name}.py`` (a user's command) as a module: :func:`load_script`."""
    return load_script(os.path.join(TOOLS, f"{name}.py"))


def load_dev(name: str) -> ModuleType:
    """``dev/{name}.py`` (the project's own machinery) as a module: :func:`load_script`."""
    return load_script(os.path.join(DEV, f"{name}.py"))


def load_script(path: str) -> ModuleType:
    """The script at ``path`` as a module, loaded from its file (whatever else is on the path).
    Loaded once per process and kept in ``sys.modules`` under its own name, as ``import name``
    with its folder on the path would."""
    name = os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not os.path.isfile(path):
        raise FileNotFoundError(f"no script {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def markdown_row(markdown: str, *first: str) -> list:
    """The cells of the one markdown table row whose first cells are ``first`` (AssertionError
    where none or several are)."""
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in markdown.splitlines()
            if line.startswith("| ")]
    rows = [r for r in rows if r[:len(first)] == list(first)]
    assert len(rows) == 1, (first, rows)
    return rows[0]


def passed_in_triton_interpreter(test_file: str, *pytest_args: str, timeout: float = 900,
                                 allow_skipped: bool = False) -> int:
    """``pytest test_file *pytest_args`` in a fresh process with ``TRITON_INTERPRET=1`` (Triton
    reads it when first imported, so a process that imported it compiled cannot interpret): how
    many tests passed there; AssertionError with the output's tail where it failed, or skipped any
    unless ``allow_skipped``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file), *pytest_args]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    log = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, f"{' '.join(cmd)} (TRITON_INTERPRET=1) failed:\n{log}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None and (allow_skipped or "skipped" not in summary), \
        f"the interpreted tests did not all run:\n{log}"
    return int(passed.group(1))


def triton_devices() -> list:
    """The ``device`` params of a Triton kernel's tests: ``"cpu"``, Triton's interpreter, run only in
    the process :func:`passed_in_triton_interpreter` starts (a test named
    ``test_kernels_in_the_triton_interpreter`` calls it), and ``"cuda"``, compiled kernels on a GPU
    (marked ``cuda``)."""
    import pytest
    import torch

    from aadet.layers.functional.backends.triton_kernels import TRITON_INTERPRETED

    has_cuda = torch.cuda.is_available() and not TRITON_INTERPRETED
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(
            not TRITON_INTERPRETED, reason="run by test_kernels_in_the_triton_interpreter (a subprocess)")),
        pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not has_cuda, reason="needs CUDA")]),
    ]
