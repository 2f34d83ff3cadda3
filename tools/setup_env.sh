#!/usr/bin/env bash
# Create (or reuse) a virtual environment with everything aadet needs.
#
#   bash tools/setup_env.sh [VENV_DIR] [--wheelhouse DIR] [--system-site]
#                                             (default VENV_DIR: .venv; `make setup` calls this)
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
#  3. aadet itself, editable, with its test dependencies, and its C++ CPU kernel for SASA (built
#     with g++ and ninja; where that fails SASA on CPU takes a slower pure-PyTorch route).
#
# Machines without a package index (cluster nodes, air-gapped GPU machines):
#  * AADET_WHEELHOUSE=DIR (or --wheelhouse DIR): every pip install runs with
#    `--no-index --find-links DIR`, and the Detectron2 wheel is taken from DIR. Make DIR on a
#    machine with the index: `bash dev/make_wheelhouse.sh DIR --python-version 3.12` (see there).
#  * AADET_SYSTEM_SITE=1 (or --system-site): reuse the machine's own torch (a CUDA build that must
#    not be replaced); torch must import already, nothing installs one. If $PYTHON is itself a
#    virtual environment (e.g. /opt/torch/.venv/bin/python3), aadet goes into that environment (a
#    venv made from a venv would not see its packages) and VENV_DIR/bin/python becomes a wrapper
#    that runs it, so `make test`, `make gpu-check` work unchanged; otherwise VENV_DIR is created
#    with --system-site-packages. Packages the system already has are kept, NumPy
#    included (its compiled packages were built against it: the offline route's numpy<2 pin is
#    not applied).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
WHEELHOUSE=${AADET_WHEELHOUSE:-}
SYSTEM_SITE=${AADET_SYSTEM_SITE:-0}
POSITIONAL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse) WHEELHOUSE=${2:?--wheelhouse needs a DIR}; shift 2 ;;
    --system-site) SYSTEM_SITE=1; shift ;;
    -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "[setup] unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ $POSITIONAL = 0 ] || { echo "[setup] one VENV_DIR only; got also $1" >&2; exit 2; }
       VENV=$1; POSITIONAL=1; shift ;;
  esac
done
case "$SYSTEM_SITE" in 0|1) ;; *) echo "[setup] AADET_SYSTEM_SITE must be 0 or 1; got $SYSTEM_SITE" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${AADET_TORCH:-2.14.1}
TORCHVISION_VERSION=${AADET_TORCHVISION:-0.29.1}
D2_OFFLINE=sal-detectron2==0.7.2

SOURCE=()
if [ -n "$WHEELHOUSE" ]; then
  [ -d "$WHEELHOUSE" ] || { echo "[setup] AADET_WHEELHOUSE/--wheelhouse $WHEELHOUSE is not a directory" >&2; exit 2; }
  WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
  SOURCE=(--no-index --find-links "$WHEELHOUSE")
  echo "[setup] wheelhouse $WHEELHOUSE: installing without a package index"
fi

if [ "$SYSTEM_SITE" = 1 ] && "$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  SYS_PY=$("$PYTHON" -c 'import sys; print(sys.executable)')
  if [ -f "$VENV/pyvenv.cfg" ]; then
    echo "[setup] $VENV is a virtual environment, but AADET_SYSTEM_SITE=1 installs into $SYS_PY's own: remove $VENV or pass another VENV_DIR" >&2
    exit 2
  fi
  echo "[setup] system site: installing into $SYS_PY's own environment; $VENV/bin/python runs it"
  # A wrapper, not a symlink: through a symlink Python would not find that venv's pyvenv.cfg.
  mkdir -p "$VENV/bin"
  printf '#!/bin/sh\n# aadet: AADET_SYSTEM_SITE=1 (tools/setup_env.sh) installed into this interpreter\nexec "%s" "$@"\n' "$SYS_PY" > "$VENV/bin/python"
  chmod +x "$VENV/bin/python"
  PY="$SYS_PY"
else
  if [ ! -x "$VENV/bin/python" ]; then
    VENV_FLAGS=()
    [ "$SYSTEM_SITE" = 1 ] && VENV_FLAGS=(--system-site-packages)
    echo "[setup] creating virtual environment $VENV ${VENV_FLAGS[*]:-}"
    "$PYTHON" -m venv "${VENV_FLAGS[@]}" "$VENV"
  fi
  PY="$VENV/bin/python"
fi
PIP=("$PY" -m pip install --disable-pip-version-check -q "${SOURCE[@]}")

if "$PY" -c "import torch, torchvision.ops" 2>/dev/null; then
  echo "[setup] keeping $("$PY" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__, "from", torch.__file__)')"
elif [ "$SYSTEM_SITE" = 1 ]; then
  echo "[setup] AADET_SYSTEM_SITE=1 reuses the system's torch, but $PY cannot import torch and torchvision.ops" >&2
  exit 1
else
  echo "[setup] installing torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION"
  "${PIP[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

# The offline route's pins, less numpy when the system's own packages are reused.
PINS=requirements/detectron2-offline.txt
if [ "$SYSTEM_SITE" = 1 ]; then
  PINS=$(mktemp)
  trap 'rm -f "$PINS"' EXIT
  grep -v -E '^numpy([^a-zA-Z0-9_-]|$)' requirements/detectron2-offline.txt > "$PINS"
fi

if "$PY" -c "import detectron2.modeling" 2>/dev/null; then
  echo "[setup] keeping detectron2 $("$PY" -c 'import detectron2; print(detectron2.__version__, detectron2.__file__)')"
  CONSTRAINTS=()
elif [ "${AADET_DETECTRON2:-}" = "skip" ]; then
  echo "[setup] Detectron2 is not importable and AADET_DETECTRON2=skip: install it first (see README)." >&2
  exit 1
else
  echo "[setup] Detectron2 not found: offline route ($D2_OFFLINE, pure-Python files)"
  "${PIP[@]}" -c "$PINS" -r "$PINS"
  if [ -n "$WHEELHOUSE" ]; then
    WHEELS="$WHEELHOUSE"
  else
    WHEELS="$("$PY" -c 'import sys; print(sys.prefix)')/aadet-wheels"
    mkdir -p "$WHEELS"
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --python-version 3.10 -d "$WHEELS" "$D2_OFFLINE"
  fi
  "$PY" - "$WHEELS" <<'PYEOF'
import glob, sys, sysconfig, zipfile
found = sorted(glob.glob(f"{sys.argv[1]}/sal_detectron2-0.7.2-*.whl"))
if not found:
    sys.exit(f"[setup] no sal_detectron2-0.7.2-*.whl in {sys.argv[1]} (dev/make_wheelhouse.sh puts it there)")
wheel = found[-1]
site = sysconfig.get_paths()["purelib"]
with zipfile.ZipFile(wheel) as z:
    z.extractall(site)
print(f"[setup] unpacked {wheel} into {site}")
PYEOF
  "$PY" -c "import detectron2.modeling, detectron2.evaluation" \
    || { echo "[setup] the offline Detectron2 does not import" >&2; exit 1; }
  CONSTRAINTS=(-c "$PINS")
fi

# aadet (with the offline route's pins as constraints, so nothing upgrades past them).
"${PIP[@]}" "${CONSTRAINTS[@]}" -e ".[dev]"
# The C++ CPU kernels of SASA and AA (aadet/layers/functional/backends/csrc): compiled here once
# for this CPU and cached (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Without g++
# the attention on CPU falls back to slower pure-PyTorch routes, so a failed build does not fail
# the setup.
# AADET_BUILD_CPU_KERNELS=0 leaves the build to their first use (dev/gpu_loan.sh: minutes are counted there).
if [ "${AADET_BUILD_CPU_KERNELS:-1}" = 1 ]; then
  "$PY" -c "from aadet.layers.functional.backends.cpu_kernels import main; main()" || echo "[setup] C++ kernels not built (see above)"
fi
touch "$VENV/.aadet-setup-done"
echo "[setup] done: $("$PY" -c 'import aadet, detectron2, torch; print("aadet", aadet.__version__, "| detectron2", detectron2.__version__, "| torch", torch.__version__)' 2>/dev/null)"
