#!/usr/bin/env bash
# The GPU check on a lent machine: two calls on one machine start, no package index there.
#
#   bash dev/gpu_loan.sh prepare              # here, where the index is: wheel folder + manifest, size
#   bash dev/gpu_loan.sh first OUT            # call 1 (9 min): install, sweep, CUDA tests, configs
#   bash dev/gpu_loan.sh second OUT PREV      # call 2 (4 min, within 30 s of call 1, while the machine
#                                             # is warm): what call 1 did not finish (PREV: its OUT,
#                                             # carried), then benchmarks
#   bash dev/gpu_loan.sh only OUT STAGE...    # a call for the stages named, sharing AADET_LOAN_SECONDS
#   bash dev/gpu_loan.sh plan                 # each call's stages and budgets (dev/gpu_check.py --plan)
#   bash dev/gpu_loan.sh dry-run [first|second]  # here: the same in a copy of what is carried, on CPU
#
# The calls' stages and budgets are defined once, gpu_report.LOAN_PLAN; each stage writes what it
# finished when it is cut, and the second call goes on from the first's files (gpu_check --resume).
# The machine (requirements/gpu-machine-installed.txt): Python 3.12 with its own CUDA torch, Triton,
# numpy, onnxruntime, pytest, ninja...; no Detectron2, fvcore, yacs, iopath, pycocotools, omegaconf.
# `prepare` builds .whl/ (dev/make_wheelhouse.sh for Python 3.12, less what the machine has; again
# only when setup.py or requirements/ changed), writes the manifest .whl/aadet-checkout.txt of HEAD
# (the copied tree has no .git; the check verifies it file by file, dev/aadet_dev/checkout.py)
# and measures the working tree + .whl against the 64 MiB a call may carry. It refuses a dirty tree:
# stages of uncommitted code never count. Carry `.whl` (and, for `second`, PREV); run from the
# repository root.
#
# Install (within its budget, measured in loan.log): only what the machine lacks, unpacked from
# .whl into a folder on PYTHONPATH with the checkout (pip --no-deps --no-compile --target; the
# offline Detectron2 wheel's pure-Python files as tools/setup_env.sh takes them), nothing built:
# aadet runs from the checkout, its C++ CPU kernels are left to the first test that needs one.
# OUT gets four plain files (a call returns at most 8, none in a sub-folder): loan.log (this
# script's output), report.json, report.md and run.tar.gz (stage_*.json, sweep.jsonl,
# sweep.plan.json, and the work folder: logs, junit XML, raw and scratch benchmark JSON). The stage
# files are written loose into OUT while the stages run and packed at the end, so a call cut off
# before that still returns them. PREV (the first call's OUT, carried inside the checkout) is moved
# out of the tree before the checkout is verified, and its run.tar.gz unpacked. Merge both calls'
# stage files here with `tar -xzf run.tar.gz -C DIR` and `python dev/gpu_check.py --report-only
# --out DIR`. The exit status is gpu_check's.
#
# --dry-run (after first|second; `dry-run` passes it): on a machine without CUDA, install for real,
# check the imports and a tiny CPU run of the sweep and the configs stage, collect the CUDA tests,
# prepare the demo data (second), then run the check itself, which must stop at its first CUDA call
# ("needs a CUDA machine"); exit 0 only if it stopped there and nothing failed before. `dry-run` runs
# it in a fresh copy of the carried files (working tree + .whl, no .git) with PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHL=.whl
MANIFEST=$WHL/aadet-checkout.txt
MACHINE_PACKAGES=requirements/gpu-machine-installed.txt
CARRY_LIMIT=$((64 * 1024 * 1024))
PYTHON=${PYTHON:-python3}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
log() { echo "[gpu_loan $(date +%H:%M:%S) +${SECONDS}s] $*"; }

carried_bytes() {  # the working tree as a call carries it (tracked + untracked, not ignored) + .whl
  local tree whl
  tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
  whl=$(du -sb "$WHL" | cut -f1)
  echo "$tree $whl $((tree + whl))"
}

here_python() {  # here (where the index is): the project's environment, which imports aadet
  if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo "$PYTHON"; fi
}

prepare() {
  local changes stamp inputs
  changes=$(git status --porcelain --untracked-files=all)
  if [ -n "$changes" ]; then
    echo "[gpu_loan] the tree has changes; commit them first (stages of uncommitted code never count):" >&2
    echo "$changes" | head -20 >&2
    exit 1
  fi
  inputs=$(cat setup.py requirements/*.txt dev/make_wheelhouse.sh | sha1sum | cut -d' ' -f1)
  stamp=$WHL/.aadet-inputs
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
    log "$WHL is up to date ($(ls "$WHL"/*.whl | wc -l) wheels)"
  else
    rm -rf "$WHL"
    bash dev/make_wheelhouse.sh "$WHL" --python-version 3.12 --exclude-installed "$MACHINE_PACKAGES"
    echo "$inputs" > "$stamp"
  fi
  PYTHONPATH=dev "$(here_python)" -c "import sys; from aadet_dev.checkout import write_manifest; \
s = write_manifest('.', sys.argv[1]); print('[gpu_loan] manifest', sys.argv[1], 'of', s['commit'])" "$MANIFEST"
  read -r tree whl total < <(carried_bytes)
  awk -v t="$tree" -v w="$whl" -v d="$WHL" -v l="$CARRY_LIMIT" 'BEGIN { m = 1048576;
    printf "[gpu_loan] carried: working tree %.1f MiB + %s %.1f MiB = %.1f MiB of %d MiB\n", t/m, d, w/m, (t+w)/m, l/m }'
  if [ "$total" -gt "$CARRY_LIMIT" ]; then
    echo "[gpu_loan] too much to carry: $total bytes > $CARRY_LIMIT" >&2
    exit 1
  fi
  log "now one device call: bash dev/gpu_loan.sh first \$OUT   (carry: $WHL; timeout 600 s)"
}

install() {
  [ -d "$WHL" ] && [ -f "$MANIFEST" ] || { echo "[gpu_loan] no $WHL/ or $MANIFEST: run 'bash dev/gpu_loan.sh prepare' where the index is, and carry $WHL" >&2; exit 2; }
  local t0=$SECONDS site=${AADET_LOAN_SITE:-/tmp/aadet-site}
  log "machine: $("$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], sys.executable, "| torch", torch.__version__, "cuda", torch.version.cuda, "| devices", torch.cuda.device_count())')"
  log "triton $("$PYTHON" -c 'import triton; print(triton.__version__)' 2>&1 | tail -1); g++: $(command -v g++ || echo none); nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
  rm -rf "$site" && mkdir -p "$site"
  # what the machine lacks, unpacked (no dependency resolution, no bytecode, no build)
  local wheels=()
  for w in "$WHL"/*.whl; do
    case "$(basename "$w")" in sal_detectron2-*|setuptools-*|wheel-*) ;; *) wheels+=("$w") ;; esac
  done
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --target "$site" "${wheels[@]}"
  # the offline Detectron2: its wheel is tagged CPython 3.10; its pure-Python files run on 3.12
  "$PYTHON" - "$WHL" "$site" <<'PYEOF'
import glob, sys, zipfile
wheel = sorted(glob.glob(f"{sys.argv[1]}/sal_detectron2-*.whl"))[-1]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if not n.endswith(".so")])
PYEOF
  export PYTHONPATH=$REPO:$site${PYTHONPATH:+:$PYTHONPATH}
  PY=$PYTHON
  "$PY" -c "import aadet, detectron2.modeling, pycocotools, fvcore, triton, torch; print('[gpu_loan] imports ok: aadet', aadet.__version__, '| detectron2', detectron2.__version__, '| triton', triton.__version__, '| numpy', __import__('numpy').__version__)"
  log "install: $((SECONDS - t0)) s (budget $(plan_value install_s) s)"
  export AADET_CHECKOUT_MANIFEST=$REPO/$MANIFEST
  PYTHONPATH=dev:$PYTHONPATH "$PY" -c "from aadet_dev.checkout import checkout_state; s = checkout_state('.'); \
print('[gpu_loan] tree', s['commit'], 'clean' if s['dirty'] is False else 'NOT CLEAN', *s['changes'][:10], sep='\n  ')"
}

plan_value() {  # a number of gpu_report.LOAN_PLAN[$MODE] (install_s, finish_s, call_s)
  PYTHONPATH=dev:$PYTHONPATH "$PY" -c "import sys; from aadet_dev.gpu_report import LOAN_PLAN; print(LOAN_PLAN[sys.argv[1]][sys.argv[2]])" "${MODE:-first}" "$1"
}

dry_run_checks() {  # what can fail before the first CUDA call, tried on CPU
  local mode=$1
  log "dry run: the sweep and the configs stage's worker on CPU (a demo config, 64 px)"
  OMP_NUM_THREADS=2 "$PY" dev/gpu_check.py --device cpu --stages sweep configs --quick --size 64 --batch 1 \
      --configs configs/Demo/trees_R_26_slim_FPN.yaml --sweep-configs configs/Demo/trees_Halo_R_26_slim_FPN.yaml \
      --out output/loan_dry/cpu --work-dir output/loan_dry/work \
    && { echo "[gpu_loan] a CPU dry run must exit 1" >&2; return 1; }
  grep -q '"status": "ok"' output/loan_dry/cpu/stage_configs.json \
    || { echo "[gpu_loan] the configs worker failed on CPU:" >&2; head -c 3000 output/loan_dry/cpu/stage_configs.json >&2; return 1; }
  [ -s output/loan_dry/cpu/sweep.jsonl ] || { echo "[gpu_loan] the sweep measured nothing on CPU" >&2; return 1; }
  log "dry run: collect the CUDA tests with -n 2 (the tests stage needs pytest-xdist, which the machine has)"
  "$PY" -m pytest -q -p no:cacheprovider --collect-only -m cuda -n 2 tests | tail -2
  "$PY" tools/benchmark.py --help > /dev/null && "$PY" dev/benchmark_layers.py --help > /dev/null
  if [ "$mode" = second ] && [[ " ${stages[*]} " == *" demo "* ]]; then
    log "dry run: demo data from the carried deepforest wheel"
    "$PY" datasets/prepare_trees.py --root "${AADET_DATASETS:-datasets}" --wheelhouse "$WHL" | tail -3
  fi
}

run_stages() {  # MODE OUT DRY [PREV | STAGE...]
  local mode=$1 out=$2 dry=$3 rc=0 budgets=() args=()
  shift 3
  MODE=$mode
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  exec > >(tee -a "$out/loan.log") 2>&1
  log "mode $mode into $out"
  if [ "$mode" = second ]; then
    [ -n "${1:-}" ] && [ -d "$1" ] || { echo "[gpu_loan] second needs PREV, the first call's OUT (carried)" >&2; exit 2; }
    set -- "$(take_prev "$1")"
  fi
  install  # first: reading the plan imports aadet, which needs what the install brings (Detectron2)
  if [ "$mode" = only ]; then
    MODE=first
    local left=$(( ${AADET_LOAN_SECONDS:-540} - SECONDS - 30 )) n=$#
    for st in "$@"; do budgets+=("$st=$((left / n))"); done
  else
    read -r -a budgets < <("$PY" dev/gpu_check.py --plan "$mode")
  fi
  [ "${#budgets[@]}" -gt 0 ] || { echo "[gpu_loan] no stage budgets (dev/gpu_check.py --plan $mode failed)" >&2; exit 1; }
  log "budgets: ${budgets[*]} (seconds)"
  local stages=("${budgets[@]%%=*}")
  if [ "$dry" = 1 ]; then dry_run_checks "$mode"; fi  # reads stages
  args=(--stages "${stages[@]}" --budget "${budgets[@]}" --out "$out" --work-dir output/gpu_check_work
        --bench-json "$out/benchmarks_cuda.json")
  if [ "$mode" = second ]; then args+=(--resume "$1"); fi
  [[ " ${stages[*]} " == *" demo "* ]] && args+=(--wheelhouse "$WHL")
  mkdir -p output
  local total=0; for b in "${budgets[@]}"; do total=$((total + ${b##*=})); done
  timeout $((total + 15)) "$PY" dev/gpu_check.py "${args[@]}" 2> >(tee output/gpu_check_stderr.log >&2) || rc=$?
  if [ "$dry" = 1 ]; then
    if grep -q "needs a CUDA machine" output/gpu_check_stderr.log; then
      log "dry run: stopped at the first CUDA call, as it must without a GPU (exit $rc); nothing failed before it"
      rc=0
    else
      log "dry run: gpu_check did not stop at the CUDA check (exit $rc)"; rc=1
    fi
  fi
  pack_out "$out"
  log "done (exit $rc): $(cd "$out" && ls | tr '\n' ' ')"
  return "$rc"
}

take_prev() {  # PREV -> a folder outside the checkout with its stage files (run.tar.gz unpacked)
  local prev=$1 dest=${AADET_LOAN_PREV:-/tmp/aadet-loan-prev}
  rm -rf "$dest" && mkdir -p "$dest"
  cp -r "$prev"/. "$dest"/
  case "$(cd "$prev" && pwd)/" in "$REPO"/*) rm -rf "$prev" ;; esac  # not an uncommitted file of the tree
  if [ -f "$dest/run.tar.gz" ]; then tar -xzf "$dest/run.tar.gz" -C "$dest" --exclude='output/*'; fi
  echo "$dest"
}

pack_out() {  # OUT -> loan.log, report.json, report.md, run.tar.gz (module header)
  local out=$1 files
  # those of them there are (a call cut early has none; `ls` of a missing name would end the script)
  files=$(cd "$out" && for f in stage_*.json sweep.jsonl sweep.plan.json; do [ ! -e "$f" ] || printf '%s ' "$f"; done)
  # trainings' checkpoints and events left out
  if tar -czf "$out/run.tar.gz" --exclude='*.pth' --exclude='events.out.tfevents*' --exclude='specs' \
      -C "$out" $files -C "$REPO" output/gpu_check_work output/gpu_check_stderr.log 2>/dev/null \
      || [ -s "$out/run.tar.gz" ]; then
    (cd "$out" && rm -f $files)
  fi
}

dry_run_copy() {  # the carried files in a fresh folder (no .git, as on the machine), then --dry-run
  local mode=${1:-first} copy
  copy=$(mktemp -d /tmp/aadet_loan_dry.XXXXXX)
  git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$copy"
  cp -r "$WHL" "$copy/"
  log "dry run in $copy ($PYTHON)"
  local prev=()
  if [ "$mode" = second ]; then mkdir -p "$copy.prev"; prev=("$copy.prev"); fi  # an empty first call
  cd "$copy" && bash dev/gpu_loan.sh "$mode" "$copy.out" "${prev[@]}" --dry-run  # OUT outside the tree, as $OUT is
}

[ $# -ge 1 ] || usage 2
DRY=0; [ "${!#}" = --dry-run ] && DRY=1 && set -- "${@:1:$(($# - 1))}"
case "$1" in
  -h|--help) usage 0 ;;
  prepare) prepare ;;
  plan)
    PYTHONPATH=dev:$REPO "$(here_python)" dev/gpu_check.py --plan ;;
  first)
    [ $# -ge 2 ] || { echo "[gpu_loan] first needs OUT, the output folder (on the device: \$OUT)" >&2; exit 2; }
    run_stages first "$2" "$DRY" ;;
  second)
    [ $# -ge 3 ] || { echo "[gpu_loan] second needs OUT and PREV (the first call's OUT, carried)" >&2; exit 2; }
    run_stages second "$2" "$DRY" "$3" ;;
  only)
    [ $# -ge 3 ] || { echo "[gpu_loan] only needs OUT and one or more stages" >&2; exit 2; }
    for st in "${@:3}"; do
      case "$st" in sweep|tests|configs|benchmarks|demo) ;; *) echo "[gpu_loan] unknown stage $st (sweep, tests, configs, benchmarks, demo)" >&2; exit 2 ;; esac
    done
    run_stages only "$2" 0 "${@:3}" ;;
  dry-run) dry_run_copy "${2:-first}" ;;
  *) echo "[gpu_loan] unknown mode $1 (prepare, first OUT, second OUT PREV, only OUT STAGE..., plan, dry-run)" >&2; exit 2 ;;
esac
