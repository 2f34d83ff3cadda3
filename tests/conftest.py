"""Shared fixtures: the pinned demo wheel and the prepared tree-crown dataset.

``tools/`` is on the test path (``pythonpath = . tools`` in pytest.ini), so tests import the tools'
modules (``demo_trees``, ``visualize_detections``, ...) by name, as the tools import each other.
"""
import os

import pytest

import demo_trees  # tools/demo_trees.py
from aadet.data import register_trees
from demo_trees import WHEEL_NAME

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def wheel(request, tmp_path_factory):
    path = os.environ.get("AADET_DEMO_WHEEL")
    if path:
        assert os.path.isfile(path), f"$AADET_DEMO_WHEEL={path} does not exist"
        return path
    path = os.path.join(REPO, "datasets", ".cache", WHEEL_NAME)
    if os.path.isfile(path):
        return path
    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider
    cache_dir = (
        str(cache.mkdir("aadet_demo_wheel"))
        if cache is not None
        else str(tmp_path_factory.mktemp("wheel"))
    )
    try:
        return demo_trees.fetch_wheel(cache_dir)
    except RuntimeError as e:
        pytest.fail(f"could not download {WHEEL_NAME} (set $AADET_DEMO_WHEEL to a local copy): {e}")



@pytest.fixture(scope="session")
def trees_root(wheel):
    """The demo dataset under ``$AADET_DATASETS`` or ``./datasets`` (built once, idempotent, shared
    with ``make demo``), registered as ``trees_train`` / ``trees_val``."""
    root = os.environ.get("AADET_DATASETS") or os.path.join(REPO, "datasets")
    demo_trees.prepare(root, wheel=wheel)
    register_trees(root)
    return root
