# aadet: the README's two commands are `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= datasets
DEMO_CONFIG ?= configs/Demo/trees_R_26_slim_FPN.yaml
DEMO_OUT ?= output/demo
export DETECTRON2_DATASETS ?= $(abspath $(DATA))
export AADET_DATASETS ?= $(abspath $(DATA))

.PHONY: setup data demo lint test test-fast test-learning test-packaging test-multimachine docs clean-demo gpu-check triton-side

setup: $(VENV)/.aadet-setup-done

$(VENV)/.aadet-setup-done: setup.py tools/setup_env.sh requirements/detectron2-offline.txt
	bash tools/setup_env.sh $(VENV)

data: setup
	$(PY) datasets/prepare_trees.py --root $(DATA)

# Train a small ResNet RetinaNet from scratch on the tree-crown tiles (CPU), evaluate COCO AP on
# the val split, and write visualizations of its detections under $(DEMO_OUT)/vis.
demo: data
	$(PY) tools/train_net.py --config-file $(DEMO_CONFIG) --num-gpus 0 OUTPUT_DIR $(DEMO_OUT)
	$(PY) tools/visualize_detections.py --config-file $(DEMO_CONFIG) --dataset trees_val \
	    --weights $(DEMO_OUT)/model_final.pth --output $(DEMO_OUT)/vis --max-images 6 --show-gt

# Linter (ruff, from the dev extra; settings in pyproject.toml). CI (.ci/run) runs it before the tests.
lint: setup
	$(PY) -m ruff check aadet tools datasets dev tests configs conftest.py

# The tests of what a user gets (tests/) and of the project's own machinery (dev/tests).
TESTS := tests dev/tests

# Four tiers (markers in pytest.ini): test-fast while editing, test before a commit, test-learning
# when a change touches attention, training or the recipe, test-packaging when it touches the install
# scripts, the requirements or a Triton kernel. CI (.ci/run) runs lint, test, test-packaging, test-learning.
# `make test` runs on TEST_WORKERS pytest-xdist workers (default: one per core) of one thread each,
# so that 2 cores run two tests rather than two threads of one test fighting over both; it ends with
# its 30 slowest tests (--durations): where to look when it grows.
TEST_WORKERS ?= auto
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not learning and not packaging" --durations=30 $(TESTS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not learning" $(TESTS)

# Two "machines" and torchrun on localhost (gloo), part of `make test` (about 2 minutes): tests/engine/test_multi_machine.py.
test-multimachine: setup
	$(PY) -m pytest -q -m multimachine $(TESTS)

# The short trainings that must reach an AP on the demo data and on generated fields.
test-learning: setup
	$(PY) -m pytest -q -m learning $(TESTS)

# Installing without a package index from a wheel folder, and the Triton kernels compiled for sm_90
# under the lent GPU machines' Triton (both need the index to prepare: wheels, the side Triton).
test-packaging: setup triton-side
	$(PY) -m pytest -q -m packaging $(TESTS)

# Regenerate every generated table of the docs, the model table counted again (dev/update_docs.py).
docs: setup
	$(PY) dev/update_docs.py --model-table

# On a CUDA machine, one report (output/gpu_check/report.md + report.json): pytest -m cuda, every
# config trained a few iterations in fp32 and bf16, a short demo training with AP, the 640x640
# benchmarks (-> docs/benchmarks_cuda.json, only from a complete run at the targets' protocol). Exit 0
# only when every stage ran on CUDA at the clean commit and passed. No package index there:
# AADET_WHEELHOUSE=DIR AADET_SYSTEM_SITE=1 make gpu-check (DIR from dev/make_wheelhouse.sh), or on a
# lent machine dev/gpu_loan.sh. Pick stages: make gpu-check GPU_CHECK_ARGS="--stages tests configs".
GPU_CHECK_ARGS ?=
gpu-check: setup
	$(PY) dev/gpu_check.py $(GPU_CHECK_ARGS)

# The lent GPU machines' Triton (their triton== line in requirements/gpu-machine-installed.txt) in a
# side folder beside the venv's own, never imported unless put first on PYTHONPATH:
# tests/layers/test_triton_versions.py (`make test-packaging`) compiles every kernel for sm_90 with it.
TRITON_SIDE_VERSION := $(shell sed -n 's/^triton==//p' requirements/gpu-machine-installed.txt)
TRITON_SIDE ?= .cache/triton$(TRITON_SIDE_VERSION)
triton-side: $(TRITON_SIDE)/.aadet-done

$(TRITON_SIDE)/.aadet-done: requirements/gpu-machine-installed.txt | setup
	rm -rf $(TRITON_SIDE)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --target $(TRITON_SIDE) "triton==$(TRITON_SIDE_VERSION)"
	touch $@

clean-demo:
	rm -rf $(DEMO_OUT)
