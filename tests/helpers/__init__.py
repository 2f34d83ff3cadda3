"""What the tests share that is not a test: the checkout's path and :func:`load_tool`, and in its
modules the scripts the tests run (``train_worker.py``, ``broken_attention.py``,
``learning_runs.py``) and their helpers (``triton_aot``, ``tiny_training``, ``detectors``)."""
import importlib.util
import os
import sys
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools")


def load_tool(name: str) -> ModuleType:
    """``tools/{name}.py`` as a module, loaded from its file (whatever else is on the path).
    Loaded once per process and kept in ``sys.modules`` under its own name, as ``import name``
    with ``tools/`` on the path would."""
    path = os.path.join(TOOLS, f"{name}.py")
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not os.path.isfile(path):
        raise FileNotFoundError(f"no tool {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
