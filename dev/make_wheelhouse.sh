#!/usr/bin/env bash
# Download every wheel aadet needs into a folder, for a machine WITHOUT a package index.
#
#   bash dev/make_wheelhouse.sh DIR [--python-version 3.12] [--platform TAG ...] [--with-torch]
#                                     [--exclude-installed FILE] [--dry-run]
#
# Run it on a machine WITH the index; copy DIR to the target machine; there run
#   AADET_WHEELHOUSE=DIR bash tools/setup_env.sh [VENV]              (or --wheelhouse DIR)
#   AADET_WHEELHOUSE=DIR AADET_SYSTEM_SITE=1 bash tools/setup_env.sh  (keep the machine's CUDA torch)
#
# DIR receives, as wheels for the target Python and platform (default: this machine's):
#  * aadet's requirements (setup.py install_requires and the dev extra, setuptools and wheel to
#    build its editable install) and the offline
#    Detectron2's companions with their pins (requirements/detectron2-offline.txt), with every
#    dependency; torch and torchvision are left out (GPU and cluster images ship their own CUDA
#    build; --with-torch adds them);
#  * sal-detectron2==0.7.2, the Detectron2 snapshot of the offline route (a cp310 wheel whose
#    pure-Python files setup_env.sh unpacks for any Python);
#  * deepforest==2.1.0, the demo data's source (datasets/prepare_trees.py --wheelhouse DIR; not
#    installed).
# A few companions are published as source only (fvcore, iopath, antlr4-python3-runtime): they
# are pure Python, so they are built here into py3-none-any wheels that fit every target.
#
# Platforms: --platform may be repeated; default for another --python-version is the manylinux
# x86_64 family pip matches exactly (manylinux_2_28/2_27/2_17, manylinux2014, manylinux1). If pip
# finds no matching distribution for some package, add --platform manylinux_2_N_x86_64 for other N.
# --exclude-installed FILE: drop the wheels of packages the target already has (FILE: one name a
# line, `pip list --format=freeze` of the target works; e.g. a GPU image's own numpy, matplotlib,
# opencv, tensorboard...), so DIR stays small enough to carry; the target must then reuse them
# (AADET_SYSTEM_SITE=1). torch and torchvision are never downloaded without --with-torch.
# --dry-run resolves everything (pip install --dry-run --report, metadata only) and lists the
# wheels that would be downloaded, without downloading them.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[ $# -ge 1 ] || usage 2
case "$1" in -h|--help) usage 0 ;; -*) echo "make_wheelhouse: first argument is DIR; got $1" >&2; exit 2 ;; esac
DIR=$1; shift
PYVER=""; PLATFORMS=(); WITH_TORCH=0; DRY_RUN=0; EXCLUDE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER=${2:?--python-version needs a value like 3.12}; shift 2 ;;
    --platform) PLATFORMS+=("${2:?--platform needs a tag like manylinux_2_28_x86_64}"); shift 2 ;;
    --with-torch) WITH_TORCH=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --exclude-installed) EXCLUDE=${2:?--exclude-installed needs a FILE}; shift 2
      [ -f "$EXCLUDE" ] || { echo "make_wheelhouse: --exclude-installed file $EXCLUDE not found" >&2; exit 2; } ;;
    -h|--help) usage 0 ;;
    *) echo "make_wheelhouse: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
PIP=("$PYTHON" -m pip --disable-pip-version-check)
D2_OFFLINE=sal-detectron2==0.7.2
DEMO_DATA=deepforest==2.1.0
SOURCE_ONLY=("fvcore>=0.1.5" "iopath>=0.1.7" "antlr4-python3-runtime==4.9.*")
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

# Target: another Python version needs explicit platform tags (pip matches them exactly).
TARGET=()
if [ -n "$PYVER" ]; then
  if [ ${#PLATFORMS[@]} -eq 0 ]; then
    PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
  fi
  TARGET+=(--python-version "$PYVER" --implementation cp)
fi
for p in "${PLATFORMS[@]}"; do TARGET+=(--platform "$p"); done

# The requirement list: setup.py's install_requires + dev extra (one definition of aadet's needs)
# and the offline Detectron2's pinned companions; torch/torchvision only with --with-torch.
REQS="$DIR/.aadet-requirements.txt"
"$PYTHON" - "$WITH_TORCH" > "$REQS" <<'PYEOF'
import ast, re, sys
tree = ast.parse(open("setup.py").read())
call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
reqs = list(kw["install_requires"]) + list(kw.get("extras_require", {}).get("dev", []))
for line in open("requirements/detectron2-offline.txt"):
    line = line.split("#")[0].strip()
    if line:
        reqs.append(line)
with_torch = sys.argv[1] == "1"
reqs += ["setuptools", "wheel"]  # build requirements of the editable install (pip's isolated build)
for r in reqs:
    name = re.split(r"[<>=!~ \[;]", r, 1)[0].lower()
    if with_torch or name not in ("torch", "torchvision"):
        print(r)
PYEOF
echo "[wheelhouse] requirements ($(wc -l < "$REQS")): $(tr '\n' ' ' < "$REQS")"

# 1. Source-only pure-Python companions -> py3-none-any wheels (valid for every target).
BUILT="$DIR/.built"
mkdir -p "$BUILT"
"${PIP[@]}" wheel -q --no-deps -w "$BUILT" "${SOURCE_ONLY[@]}"
for w in "$BUILT"/*.whl; do
  case "$w" in *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
    *) echo "[wheelhouse] $w is not a pure-Python wheel; cannot serve another platform" >&2; exit 1 ;; esac
done
cp "$BUILT"/*.whl "$DIR"/

if [ "$DRY_RUN" = 1 ]; then
  REPORT="$DIR/.resolve-report.json"
  "${PIP[@]}" install -q --dry-run --ignore-installed --only-binary=:all: "${TARGET[@]}" \
      --target "$DIR/.dry-target" --find-links "$BUILT" --report "$REPORT" -r "$REQS" \
      -c requirements/detectron2-offline.txt
  "$PYTHON" - "$REPORT" <<'PYEOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
names = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items)
print(f"[wheelhouse] dry run: {len(names)} wheels resolve: {' '.join(names)}")
PYEOF
  "${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.10 -d "$DIR/.dry-d2" "$D2_OFFLINE" \
      && echo "[wheelhouse] dry run: $D2_OFFLINE resolves" && rm -rf "$DIR/.dry-d2"
  rm -rf "$DIR/.dry-target"
  exit 0
fi

# 2. Everything else as binary wheels for the target (the built wheels satisfy their names).
"${PIP[@]}" download -q --only-binary=:all: "${TARGET[@]}" --find-links "$BUILT" -d "$DIR" \
    -r "$REQS" -c requirements/detectron2-offline.txt
# 3. The Detectron2 snapshot (cp310 only; its pure-Python files serve any Python) and the demo data.
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.10 -d "$DIR" "$D2_OFFLINE"
"${PIP[@]}" download -q --no-deps --only-binary=:all: -d "$DIR" "$DEMO_DATA"
rm -rf "$BUILT"
if [ -n "$EXCLUDE" ]; then  # wheel names are normalised to lower case with '_' (PEP 427)
  "$PYTHON" - "$DIR" "$EXCLUDE" <<'PYEOF'
import glob, os, re, sys
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
# setuptools, wheel and wheel's own packaging: pip's isolated build of the editable install, which
# sees none of the target's packages
keep = {"sal_detectron2", "deepforest", "setuptools", "wheel", "packaging"}
names = {norm(re.split(r"[<>=!~ \[;@]", l.strip(), 1)[0]) for l in open(sys.argv[2]) if l.strip() and not l.startswith("#")}
dropped = []
for w in glob.glob(os.path.join(sys.argv[1], "*.whl")):
    name = norm(os.path.basename(w).split("-")[0])
    if name in names - keep:
        os.remove(w)
        dropped.append(name)
print(f"[wheelhouse] left out {len(dropped)} wheels the target has: {' '.join(sorted(dropped))}")
PYEOF
fi
echo "[wheelhouse] $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "[wheelhouse] on the target: AADET_WHEELHOUSE=$DIR bash tools/setup_env.sh  (AADET_SYSTEM_SITE=1 keeps its torch)"
