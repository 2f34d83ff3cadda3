#!/usr/bin/env bash
# Create (or reuse) a virtual environment with everything aadet needs.
#
#   bash tools/setup_env.sh [VENV_DIR]        (default: .venv; `make setup` calls this)
#
# The one explicit place for the environment:
#  1. PyTorch: a torch/torchvision pair that imports is kept; otherwise torch==$AADET_TORCH
#     and torchvision==$AADET_TORCHVISION (defaults 2.14.1 / 0.29.1) are installed.
#  2. Detectron2: an importable Detectron2 (e.g. installed from the official source with
#     `pip install 'git+https://github.com/facebookresearch/detectron2.git'`) is kept untouched.
#     Otherwise, the OFFLINE ROUTE: the package index has no Detectron2, but it has
#     `sal-detectron2==0.7.2`, a 2024 snapshot of it published for CPython 3.10 only. We install its
#     companions with the pins in requirements/detectron2-offline.txt, download that wheel without
#     dependencies and unpack its pure-Python files into the environment's site-packages. On Python
#     other than 3.10 its compiled `detectron2._C` does not load; RetinaNet does not need it and COCO
#     evaluation falls back to pycocotools. Set AADET_DETECTRON2=skip to fail instead of using it.
#  3. aadet itself, editable, with its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${AADET_TORCH:-2.14.1}
TORCHVISION_VERSION=${AADET_TORCHVISION:-0.29.1}
D2_OFFLINE=sal-detectron2==0.7.2

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if "$PY" -c "import torch, torchvision.ops" 2>/dev/null; then
  echo "[setup] keeping $("$PY" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)')"
else
  echo "[setup] installing torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION"
  "${PIP[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

if "$PY" -c "import detectron2.modeling" 2>/dev/null; then
  echo "[setup] keeping detectron2 $("$PY" -c 'import detectron2; print(detectron2.__version__, detectron2.__file__)')"
  CONSTRAINTS=()
elif [ "${AADET_DETECTRON2:-}" = "skip" ]; then
  echo "[setup] Detectron2 is not importable and AADET_DETECTRON2=skip: install it first (see README)." >&2
  exit 1
else
  echo "[setup] Detectron2 not found: offline route ($D2_OFFLINE, pure-Python files)"
  "${PIP[@]}" -r requirements/detectron2-offline.txt
  WHEELS="$VENV/aadet-wheels"
  mkdir -p "$WHEELS"
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
      --python-version 3.10 -d "$WHEELS" "$D2_OFFLINE"
  "$PY" - "$WHEELS" <<'PYEOF'
import glob, sys, sysconfig, zipfile
wheel = sorted(glob.glob(f"{sys.argv[1]}/sal_detectron2-0.7.2-*.whl"))[-1]
site = sysconfig.get_paths()["purelib"]
with zipfile.ZipFile(wheel) as z:
    z.extractall(site)
print(f"[setup] unpacked {wheel} into {site}")
PYEOF
  "$PY" -c "import detectron2.modeling, detectron2.evaluation" \
    || { echo "[setup] the offline Detectron2 does not import" >&2; exit 1; }
  CONSTRAINTS=(-c requirements/detectron2-offline.txt)
fi

# aadet (with the offline route's pins as constraints, so nothing upgrades past them).
"${PIP[@]}" "${CONSTRAINTS[@]}" -e ".[dev]"
touch "$VENV/.aadet-setup-done"
echo "[setup] done: $("$PY" -c 'import aadet, detectron2, torch; print("aadet", aadet.__version__, "| detectron2", detectron2.__version__, "| torch", torch.__version__)' 2>/dev/null)"
