#!/usr/bin/env bash
# The GPU check on a lent machine: ONE command a call, at most 9 minutes, no package index there.
#
#   bash dev/gpu_loan.sh prepare               # here, where the index is: wheel folder + manifest, size
#   bash dev/gpu_loan.sh first OUT             # on the lent machine: install, then tests + benchmarks
#   bash dev/gpu_loan.sh second OUT            # a second call, if time is left: configs + demo
#   bash dev/gpu_loan.sh only OUT STAGE [STAGE]  # a call for the stages named (one the first
#                                                # call did not finish, say), sharing the budget
#   bash dev/gpu_loan.sh dry-run [first|second]  # here: the same in a copy of what is carried, on CPU
#
# The machine (requirements/gpu-machine-installed.txt): Python 3.12 with its own CUDA torch, Triton,
# numpy, onnxruntime, pytest, ninja...; no Detectron2, fvcore, yacs, iopath, pycocotools, omegaconf.
# `prepare` builds .whl/ (dev/make_wheelhouse.sh for Python 3.12, less what the machine has; again
# only when setup.py or requirements/ changed), writes the manifest .whl/aadet-checkout.txt of HEAD
# (the copied tree has no .git; the check verifies it file by file, dev/aadet_dev/checkout.py)
# and measures the working tree + .whl against the 64 MiB a call may carry. It refuses a dirty tree:
# stages of uncommitted code never count. Carry `.whl`; run from the repository root.
#
# `first` / `second` install into the machine's own python ($PYTHON, default python3) from .whl
# without an index (tools/setup_env.sh with AADET_SYSTEM_SITE=1; its C++ CPU kernels are left to the
# first test that needs them: g++ and ninja), then run dev/gpu_check.py: `first` the tests and
# benchmarks stages, `second` configs and demo (demo data from the carried deepforest wheel). The
# stages share what is left of AADET_LOAN_SECONDS (default 540 = 9 minutes) after the install, less
# 30 s to merge and pack. Everything goes into OUT, at most 8 plain files, none in a sub-folder:
# stage_*.json, report.json, report.md, benchmarks_cuda.json (the record, only from a complete run at
# the targets' protocol), loan.log (this script's output) and work.tar.gz (logs, junit XML, raw and
# scratch benchmark JSON). Merge both calls' stage files here with
# `python dev/gpu_check.py --report-only --out DIR`. The exit status is gpu_check's.
#
# --dry-run (after first|second; `dry-run` passes it): on a machine without CUDA, install for real,
# check the imports and a tiny CPU training of the configs stage's worker, collect the CUDA tests,
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

usage() { sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
log() { echo "[gpu_loan $(date +%H:%M:%S) +${SECONDS}s] $*"; }

carried_bytes() {  # the working tree as a call carries it (tracked + untracked, not ignored) + .whl
  local tree whl
  tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
  whl=$(du -sb "$WHL" | cut -f1)
  echo "$tree $whl $((tree + whl))"
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
  PYTHONPATH=dev "$PYTHON" -c "import sys; from aadet_dev.checkout import write_manifest; \
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
  log "machine: $("$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], sys.executable, "| torch", torch.__version__, "cuda", torch.version.cuda, "| devices", torch.cuda.device_count())')"
  log "triton $("$PYTHON" -c 'import triton; print(triton.__version__)' 2>&1 | tail -1); g++: $(command -v g++ || echo none); ninja: $(command -v ninja || echo none); nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
  log "install from $WHL without an index (tools/setup_env.sh, AADET_SYSTEM_SITE=1)"
  AADET_WHEELHOUSE=$WHL AADET_SYSTEM_SITE=1 AADET_BUILD_CPU_KERNELS=0 PYTHON=$PYTHON bash tools/setup_env.sh
  PY=$REPO/.venv/bin/python
  "$PY" -c "import aadet, detectron2.modeling, pycocotools, fvcore, triton, torch; print('[gpu_loan] imports ok: aadet', aadet.__version__, '| detectron2', detectron2.__version__, '| triton', triton.__version__, '| numpy', __import__('numpy').__version__)"
  export AADET_CHECKOUT_MANIFEST=$REPO/$MANIFEST
  PYTHONPATH=dev "$PY" -c "from aadet_dev.checkout import checkout_state; s = checkout_state('.'); \
print('[gpu_loan] tree', s['commit'], 'clean' if s['dirty'] is False else 'NOT CLEAN', *s['changes'][:10], sep='\n  ')"
}

dry_run_checks() {  # what can fail before the first CUDA call, tried on CPU
  local mode=$1
  log "dry run: the configs stage's worker on CPU (tiny demo config, 2 iterations)"
  OMP_NUM_THREADS=2 "$PY" dev/gpu_check.py --device cpu --stages configs --quick --size 64 --batch 1 \
      --configs configs/Demo/trees_R_26_slim_FPN.yaml --out output/loan_dry/cpu --work-dir output/loan_dry/work \
    && { echo "[gpu_loan] a CPU dry run must exit 1" >&2; return 1; }
  grep -q '"status": "ok"' output/loan_dry/cpu/stage_configs.json \
    || { echo "[gpu_loan] the configs worker failed on CPU:" >&2; head -c 3000 output/loan_dry/cpu/stage_configs.json >&2; return 1; }
  log "dry run: collect the CUDA tests with -n 2 (the tests stage needs pytest-xdist, which the machine has)"
  "$PY" -m pytest -q -p no:cacheprovider --collect-only -m cuda -n 2 tests | tail -2
  "$PY" tools/benchmark.py --help > /dev/null && "$PY" dev/benchmark_layers.py --help > /dev/null
  if [ "$mode" = second ]; then
    log "dry run: demo data from the carried deepforest wheel"
    "$PY" datasets/prepare_trees.py --root "${AADET_DATASETS:-datasets}" --wheelhouse "$WHL" | tail -3
  fi
}

run_stages() {
  local mode=$1 out=$2 dry=$3 stages left finish=30 budget_a budget_b rc=0
  case "$mode" in
    first) stages=(tests benchmarks) ;;
    second) stages=(configs demo) ;;
    only) shift 3; stages=("$@") ;;
  esac
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  exec > >(tee -a "$out/loan.log") 2>&1
  log "mode $mode: stages ${stages[*]} into $out (budget ${AADET_LOAN_SECONDS:-540} s in all)"
  install
  if [ "$dry" = 1 ]; then dry_run_checks "$mode"; fi
  left=$(( ${AADET_LOAN_SECONDS:-540} - SECONDS - finish ))
  [ "$left" -gt 60 ] || { echo "[gpu_loan] only $left s left after the install" >&2; exit 1; }
  # tests (pytest -m cuda, 8 processes) 35 % and benchmarks the rest; otherwise equal shares
  local budgets=()
  if [ "${#stages[@]}" = 1 ]; then
    budgets=("${stages[0]}=$((left - 5))")
  else
    case "$mode" in first) budget_a=$((left * 35 / 100)) ;; *) budget_a=$((left * 50 / 100)) ;; esac
    budget_b=$((left - budget_a - 5))
    budgets=("${stages[0]}=$budget_a" "${stages[1]}=$budget_b")
  fi
  log "gpu_check: ${budgets[*]} (seconds)"
  local args=(--stages "${stages[@]}" --budget "${budgets[@]}"
              --out "$out" --work-dir output/gpu_check_work --bench-json "$out/benchmarks_cuda.json")
  [[ " ${stages[*]} " == *" demo "* ]] && args+=(--wheelhouse "$WHL")
  mkdir -p output
  timeout $((left + 15)) "$PY" dev/gpu_check.py "${args[@]}" 2> >(tee output/gpu_check_stderr.log >&2) || rc=$?
  if [ "$dry" = 1 ]; then
    if grep -q "needs a CUDA machine" output/gpu_check_stderr.log; then
      log "dry run: stopped at the first CUDA call, as it must without a GPU (exit $rc); nothing failed before it"
      rc=0
    else
      log "dry run: gpu_check did not stop at the CUDA check (exit $rc)"; rc=1
    fi
  fi
  # logs, junit XML, raw and scratch JSON: one file (trainings' checkpoints and events left out)
  tar -czf "$out/work.tar.gz" --exclude='*.pth' --exclude='events.out.tfevents*' --exclude='specs' \
      output/gpu_check_work output/gpu_check_stderr.log 2>/dev/null || true
  log "done (exit $rc): $(cd "$out" && ls | tr '\n' ' ')"
  return "$rc"
}

dry_run_copy() {  # the carried files in a fresh folder (no .git, as on the machine), then --dry-run
  local mode=${1:-first} copy
  copy=$(mktemp -d /tmp/aadet_loan_dry.XXXXXX)
  git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$copy"
  cp -r "$WHL" "$copy/"
  log "dry run in $copy ($PYTHON)"
  cd "$copy" && bash dev/gpu_loan.sh "$mode" "$copy.out" --dry-run  # OUT outside the tree, as $OUT is
}

[ $# -ge 1 ] || usage 2
case "$1" in
  -h|--help) usage 0 ;;
  prepare) prepare ;;
  first|second)
    [ $# -ge 2 ] || { echo "[gpu_loan] $1 needs OUT, the output folder (on the device: \$OUT)" >&2; exit 2; }
    DRY=0; [ "${3:-}" = --dry-run ] && DRY=1
    run_stages "$1" "$2" "$DRY" ;;
  only)
    [ $# -ge 3 ] && [ $# -le 4 ] || { echo "[gpu_loan] only needs OUT and one or two stages" >&2; exit 2; }
    for st in "${@:3}"; do
      case "$st" in tests|configs|demo|benchmarks) ;; *) echo "[gpu_loan] unknown stage $st (tests, configs, demo, benchmarks)" >&2; exit 2 ;; esac
    done
    run_stages only "$2" 0 "${@:3}" ;;
  dry-run) dry_run_copy "${2:-first}" ;;
  *) echo "[gpu_loan] unknown mode $1 (prepare, first OUT, second OUT, dry-run)" >&2; exit 2 ;;
esac
