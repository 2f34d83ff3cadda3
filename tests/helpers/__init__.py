"""What the tests share that is not a test: the checkout's path, :func:`load_tool` and
:func:`load_dev`, and in its
modules the scripts the tests run (``train_worker.py``, ``broken_attention.py``,
``learning_runs.py``) and their helpers (``triton_aot``, ``tiny_training``, ``detectors``)."""
import importlib.util
import os
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
