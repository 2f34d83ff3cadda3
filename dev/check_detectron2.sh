#!/usr/bin/env bash
# Run aadet's tests against another Detectron2: a source checkout (e.g. upstream main), without
# touching the project's environment.
#
#   bash dev/check_detectron2.sh D2_SRC [PYTEST_ARGS...]
#       D2_SRC: a folder holding Detectron2's `detectron2/` package (a clone of
#               https://github.com/facebookresearch/detectron2, or any snapshot of one)
#       PYTEST_ARGS: pytest's arguments; without them, `make test` runs with the side interpreter
#
# It makes a side environment in .cache/detectron2-side whose site-packages holds D2_SRC's Python
# package and, after it, everything of the project's environment ($VENV, default .venv: torch,
# fvcore, aadet editable, ...), so `import detectron2` finds D2_SRC's and everything else is the
# project's. The tests' subprocesses (training runs, tools) run with the same interpreter, so they
# see the same Detectron2. Detectron2's compiled `_C` is not built: RetinaNet does not need it
# (as on the offline route of tools/setup_env.sh, whose `_C` is for another Python).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ ! -f "$1/detectron2/__init__.py" ]; then
  echo "usage: bash dev/check_detectron2.sh D2_SRC [PYTEST_ARGS...]" >&2
  echo "  D2_SRC must hold detectron2/__init__.py (a Detectron2 checkout); got '${1:-}'" >&2
  exit 2
fi
SRC=$(cd "$1" && pwd)
shift
VENV=${VENV:-.venv}
SIDE=.cache/detectron2-side
BASE=$("$VENV/bin/python" -c "import sys; print(sys.base_prefix)")
MAIN_SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$SIDE"
"$BASE/bin/python3" -m venv "$SIDE"
SIDE_SITE=$("$SIDE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp -r "$SRC/detectron2" "$SIDE_SITE/"
# After the side's own site-packages: the project's, with its .pth files (aadet's editable install).
echo "import site; site.addsitedir('$MAIN_SITE')" > "$SIDE_SITE/zz_project_env.pth"
COMMIT="not a git checkout"
if [ "$(git -C "$SRC" rev-parse --show-toplevel 2>/dev/null)" = "$SRC" ]; then
  COMMIT=$(git -C "$SRC" log -1 --format='%h of %cs')
fi
"$SIDE/bin/python" - "$SIDE_SITE" <<'EOF'
import os, sys
import detectron2
import aadet  # noqa: F401  (the project's, editable)
got = os.path.realpath(detectron2.__file__)
if not got.startswith(os.path.realpath(sys.argv[1]) + os.sep):
    sys.exit(f"check_detectron2: imported Detectron2 from {got}, not the side environment's copy")
print(f"check_detectron2: detectron2 {detectron2.__version__} from {os.path.dirname(got)}")
EOF
echo "check_detectron2: Detectron2 source $SRC (commit $COMMIT)"
if [ $# -eq 0 ]; then
  exec make test VENV="$VENV" PY="$SIDE/bin/python"
fi
OMP_NUM_THREADS=1 exec "$SIDE/bin/python" -m pytest -q -p no:cacheprovider "$@"
