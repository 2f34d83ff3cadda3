#!/usr/bin/env python
"""One command on a CUDA machine that checks aadet there and writes ONE report.

    make gpu-check                                   # every stage, full size
    python dev/gpu_check.py --stages tests configs # some stages (e.g. one machine call each)
    python dev/gpu_check.py --quick                # smoke run: tiny sizes, few iterations
    python dev/gpu_check.py --report-only --out DIR  # merge stage_*.json of separate runs
    python dev/gpu_check.py --report-only --allow-stale --out DIR  # ... some of another commit

Stages, in order of what they tell (``dev/aadet_dev/gpu_report.py`` names them; each has a time
budget, ``--budget STAGE=SECONDS``, and a failing stage does not stop the next):

1. ``sweep``: ``dev/gpu_sweep.py`` (``dev/aadet_dev/sweep.py``) into ``OUT/sweep.jsonl``: every
   attention layer shape of the COCO configs at 640x640, batch 8, by every CUDA route of its
   family and a 3x3 conv, fp32 / bf16 / fp16: finite, agreeing with the float64 brute force on a
   sample, time and peak memory; a failing case bisected over SDPA's backends.
2. ``tests``: ``pytest -m cuda`` (``tests/layers/test_cuda.py``: every attention route in fp32 and
   under bf16 / fp16 autocast against the float64 brute force on the GPU, and the ``cuda`` cases
   of the other test files, the compiled Triton kernels among them), in ``--test-workers``
   pytest-xdist processes; its junit XML is parsed into the report, or where the run was cut
   off, its progress record (``conftest.py``: what finished, the slowest tests). The stage
   passes only if CUDA tests ran and all passed: a skipped CUDA test fails it (the report lists
   each skip and its reason). Every test that needs CUDA carries the ``cuda`` marker
   (``dev/tests/test_gpu_check.py`` checks it), so ``-m cuda`` selects them all.
3. ``configs``: every config under ``configs/`` built on the device and trained ``--iters`` (20)
   iterations in fp32 and in bf16 autocast on a synthetic batch at its own training size
   (:func:`training_shape`: COCO 640x640, batch 8; ``--size`` / ``--batch`` override), with the
   config's optimizer and LR schedule: every loss and gradient finite, peak memory recorded. One
   process per config (an error or OOM in one does not touch the others).
4. ``benchmarks``: ``tools/benchmark.py`` on the conv R50 baseline, AA-R50, SASA-backbone R50
   and all-attention R50 COCO configs (640x640, batch 8, fp32 and bf16 autocast) and
   ``dev/benchmark_layers.py`` (SASA layer, 256 ch, k 7, vs a 3x3 conv) -> ``--bench-json``
   (default ``docs/benchmarks_cuda.json``) with a verdict per performance target (the attention
   models' time and memory as ratios to the conv R50, the SASA layer's to a 3x3 conv; limits in
   ``dev/aadet_dev/gpu_report.py``): pass, or missed by how much. Then, with what is left of
   the stage's budget, ``dev/benchmark_layers.py --suite halo`` (HaloNet layer, 256 ch, b 8,
   h 3, vs a 3x3 conv), reported as measured, without a target: where it fails or the budget is
   spent before it, the report says it was not measured, and neither fails the stage nor keeps
   the record from being written. Last, the same way, ``MODEL.COMPILE`` as an option: the conv
   baseline and AA-R50 compiled (``--compile``), in bf16, where at least ``COMPILED_MIN_S`` of the
   budget is left. Every case is profiled once more after its timed steps (``--profile``): each
   time target's verdict says what bounds it. The targets are defined at ``gpu_report.PROTOCOL`` (640x640,
   batch 8, fp32 and bf16, at least 10 timed iterations after 3 warm-up ones): only a complete
   run at it, whose stage passed, writes ``--bench-json``; anything else (``--quick``, fewer
   iterations, a failed case, a precision not measured) goes to
   ``WORK_DIR/benchmarks_cuda.scratch.json``, whose ``"scratch"`` says why it is not the record.
5. ``demo``: the demo data (``datasets/prepare_trees.py``, the deepforest wheel taken from
   ``--wheelhouse`` on a machine without a package index) and a short real training of the four
   demo configs with ``tools/train_net.py`` (``--demo-epochs``), their COCO AP on each dataset
   of the configs' ``DATASETS.TEST``: ``trees_val`` (where choices are made) and ``trees_test``.

``--resume DIR`` (a lent machine's second call): an earlier run's stage files and sweep rows are
copied into OUT; its stages that passed are not run again, the sweep and the configs stage go on
from the cases it finished. ``--plan`` prints the lent machine's calls (``gpu_report.LOAN_PLAN``).

Every stage writes ``<out>/stage_<name>.json`` with the device it ran on, the git commit and
whether the tree was clean; after the stages run, every ``stage_*.json`` in ``<out>`` is merged
into ``<out>/report.json`` and ``<out>/report.md``, which give two verdicts: the **check** (every
stage of ``--stages`` ran on CUDA, at the checked-out clean commit, not as a ``--quick`` smoke
run, and passed: anything else is named under "Not counted") and the **targets** (met, missed,
not measured; a stage that ran may miss them), then each stage's environment. The exit status is
0 only when the check passed, ``--report-only`` included (it judges ``--stages``, default all).
So stages can run in separate calls of a machine lent for 10 minutes a command: collect their
``stage_*.json`` in one folder, then ``--report-only``. The merge refuses stage files of another
commit than the checkout's HEAD (the error names each file and both commits) unless
``--allow-stale``, which marks them stale (never counted). A tree with uncommitted or untracked
changes is not its commit. Where the checkout has no ``.git`` (a copied tree),
``$AADET_CHECKOUT_MANIFEST`` names a manifest written where it has one, against which the copy is
verified file by file (``dev/aadet_dev/checkout.py``).

Without a package index (a lent GPU machine: Python 3.12 with its own CUDA torch, 10 minutes a
command): ``dev/gpu_loan.sh`` prepares the wheel folder and the manifest here and runs the
stages there, in two calls on one machine start (docs/gpu_check.md).

``--device cpu`` is a dry run of the ``sweep`` and ``configs`` stages on a machine without CUDA (what
the CPU unit tests run): it exits 1, its stages never count; every other stage needs CUDA and says so.
"""

import argparse
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from aadet.benchmark.report import write_json  # noqa: E402
from aadet.benchmark.synthetic_batch import detectron2_inputs, make_batch  # noqa: E402
from aadet.benchmark.timing import environment_info, run_worker  # noqa: E402
from aadet.engine.run_summary import last_box_metrics  # noqa: E402
from aadet.layers.functional.route_table import capability  # noqa: E402
from aadet_dev import gpu_report  # noqa: E402
from aadet_dev.checkout import checkout_state  # noqa: E402

#: Default time budget of each stage in seconds (a lent machine runs a command 10 minutes).
DEFAULT_BUDGET_S = {"sweep": 300, "tests": 300, "configs": 300, "benchmarks": 560, "demo": 540}
DEMO_CONFIGS = (
    "configs/Demo/trees_R_26_slim_FPN.yaml",
    "configs/Demo/trees_AA_R_26_slim_FPN.yaml",
    "configs/Demo/trees_SASA_R_26_slim_FPN.yaml",
    "configs/Demo/trees_SASA_full_attention_R_26_slim.yaml",
)


# ----------------------------------------------------------------------------- environment
def gpu_environment(device: str) -> dict:
    """Device name, torch / Triton / CUDA / driver / Detectron2 versions."""
    env = environment_info(device)
    env["cuda"] = torch.version.cuda  # the CUDA torch was built with (None: a CPU build)
    # the route table's key (aadet/layers/functional/route_table.py)
    env["capability"] = capability(torch.device(device)) if torch.device(device).type == "cuda" else None
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import detectron2

        env["detectron2"] = f"{detectron2.__version__} ({os.path.dirname(detectron2.__file__)})"
    except ImportError:
        env["detectron2"] = None
    env["driver"] = None
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        env["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    return env


def checkout_commit() -> dict:
    """``{"commit", "dirty", "changes", "how"}`` of this checkout: git, or in a copied tree the
    manifest ``$AADET_CHECKOUT_MANIFEST`` (``dev/aadet_dev/checkout.py``)."""
    return checkout_state(REPO)


def _run(cmd, timeout, log_path=None, env=None):
    """Run ``cmd`` with a timeout; returns ``(returncode or "timeout", output tail)``.

    stdout and stderr go to one stream, unbuffered (``PYTHONUNBUFFERED=1``), so a command cut off
    at its timeout still leaves every line it printed (progress lines are how a timed-out stage
    says where its time went). The command runs in its own process group, and on timeout the
    whole group is killed: a benchmark's worker processes must not go on holding the GPU while
    the next command runs."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = "timeout"
        out += f"\n[gpu_check] timed out after {timeout:.0f} s: {' '.join(cmd)}".encode()
    out = out.decode(errors="replace")
    if log_path:
        with open(log_path, "w") as f:
            f.write(out)
    return rc, out[-3000:]


class Budget:
    """Seconds left of a stage's budget."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# ----------------------------------------------------------------------------- stage: sweep
SWEEP_ROWS = "sweep.jsonl"


def stage_sweep(args, budget: Budget) -> dict:
    """``dev/gpu_sweep.py`` into ``OUT/sweep.jsonl`` (continued where ``--resume`` left it): every
    attention layer shape of the COCO configs at 640x640, batch 8. ok when every case was measured
    and each was finite and agreed with the brute force."""
    from aadet_dev.sweep import read_rows

    rows_file = os.path.join(args.out, SWEEP_ROWS)
    size = (["--size", "64", "--batch", "1", "--iters", "1"] if args.quick
            else ["--batch", str(gpu_report.PROTOCOL.batch)])
    configs = ["--configs", *args.sweep_configs] if args.sweep_configs else []
    cmd = [sys.executable, os.path.join(REPO, "dev", "gpu_sweep.py"), "--out", rows_file, "--device", args.device,
           "--seconds", f"{max(1.0, budget.left() - 10):.0f}", *size, *configs]
    rc, tail = _run(cmd, budget.left(), os.path.join(args.work_dir, "sweep.log"))
    rows = read_rows(rows_file)
    plan_file = os.path.splitext(rows_file)[0] + ".plan.json"
    planned = shapes = None
    if os.path.isfile(plan_file):
        with open(plan_file) as f:
            plan = json.load(f)
        planned, shapes = plan["cases"], len(plan["shapes"])
    failures = [r for r in rows if not r.get("ok")]
    counts = {"measured": len(rows), "failed": len(failures), "planned": planned, "shapes": shapes}
    complete = planned is not None and len(rows) >= planned
    out = {"status": "ok" if complete and not failures else "failed", "counts": counts,
           "failures": failures, "rows_file": SWEEP_ROWS, "exit": rc}
    if out["status"] != "ok":
        out["error"] = "; ".join(filter(None, [f"{len(failures)} cases not ok" if failures else "",
                                                "" if complete else f"{len(rows)} of {planned} cases measured"]))
        out["log_tail"] = tail
    return out


# ----------------------------------------------------------------------------- stage: tests
def test_workers(requested: int) -> int:
    """pytest-xdist worker processes for the tests stage: ``requested``, or 0 (one process) where
    xdist is not installed. The processes share the GPU and do the tests' CPU side (Triton's
    kernel compilation, building inputs and references) in parallel."""
    if requested <= 0:
        return 0
    try:
        import xdist  # noqa: F401
    except ImportError:
        print("[gpu_check] tests: pytest-xdist is not installed: one process", file=sys.stderr, flush=True)
        return 0
    return requested


def stage_tests(args, budget: Budget) -> dict:
    junit = os.path.join(args.work_dir, "junit_cuda.xml")
    progress = os.path.join(args.work_dir, "pytest_progress.jsonl")
    workers = test_workers(args.test_workers)
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "--durations=20", *(["-n", str(workers)] if workers else []),
           *(["-x"] if args.quick else []), "tests"]
    for stale in (junit, progress):
        if os.path.isfile(stale):
            os.remove(stale)  # never read the record of an earlier run
    rc, tail = _run(cmd, budget.left(), os.path.join(args.work_dir, "pytest_cuda.log"),
                    env={gpu_report.TEST_PROGRESS_ENV: progress})
    j = p = None
    if os.path.isfile(junit):
        with open(junit) as f:
            j = gpu_report.parse_junit(f.read())
    if os.path.isfile(progress):
        with open(progress) as f:
            p = gpu_report.parse_test_progress(f.read())
    out = dict(gpu_report.tests_stage_result(j, rc, p), exit=rc, junit=j, progress=p, workers=workers)
    if out["status"] != "ok":
        out["log_tail"] = tail
    return out


# ----------------------------------------------------------------------------- stage: configs
def all_configs():
    """Every config under configs/ except the ``Base-*`` files, relative to the repository."""
    paths = glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)
    return sorted(os.path.relpath(p, REPO) for p in paths if not os.path.basename(p).startswith("Base-"))


def synthetic_inputs(batch: int, size: int, num_classes: int, seed: int, device):
    """Detectron2 training inputs on ``device``: ``tools/benchmark.py``'s random images and boxes
    (:mod:`aadet.benchmark.synthetic_batch`)."""
    return detectron2_inputs(make_batch(batch, size, size, seed), num_classes, device=device)


def training_shape(cfg) -> tuple:
    """``(side, images)`` a device trains ``cfg`` with: the scale-jitter crop (else the test size)
    and ``SOLVER.IMS_PER_BATCH`` over ``SOLVER.REFERENCE_WORLD_SIZE`` workers; where the config
    names no world size (the COCO configs: 64 images on the papers' 8 accelerators), the
    protocol's batch a device (8)."""
    jitter = cfg.INPUT.SCALE_JITTER
    side = jitter.CROP_SIZE if jitter.ENABLED else cfg.INPUT.MAX_SIZE_TEST
    world = cfg.SOLVER.REFERENCE_WORLD_SIZE
    return side, (cfg.SOLVER.IMS_PER_BATCH // world if world else gpu_report.PROTOCOL.batch)


def train_config_worker(spec: dict) -> dict:
    """Build ``spec["config"]`` on ``spec["device"]`` and train ``spec["iters"]`` iterations per
    precision at ``spec["size"]`` x ``spec["batch"]`` (None: the config's own,
    :func:`training_shape`), in a fresh process. One result row per precision."""
    from detectron2.modeling import build_model

    import aadet  # noqa: F401
    from aadet.benchmark.timing import PeakMemory, synchronize
    from aadet.benchmark.training_step import TrainingStep
    from aadet.engine import Trainer, load_config

    device = torch.device(spec["device"])
    cfg = load_config(os.path.join(REPO, spec["config"]), ["MODEL.DEVICE", str(device)])
    own_size, own_batch = training_shape(cfg)
    size, batch = spec.get("size") or own_size, spec.get("batch") or own_batch
    rows = []
    for precision in spec["precisions"]:
        row = {"config": gpu_report.config_name(spec["config"]), "precision": precision, "size": size,
               "batch": batch, "iters": spec["iters"]}
        model = opt = inputs = None
        try:
            torch.manual_seed(spec["seed"])
            model = build_model(cfg)
            opt = Trainer.build_optimizer(cfg, model)
            inputs = synthetic_inputs(batch, size, cfg.MODEL.RETINANET.NUM_CLASSES, spec["seed"], device)
            step = TrainingStep(model, inputs, opt, scheduler=Trainer.build_lr_scheduler(cfg, opt),
                                amp_dtype=gpu_report.AMP_DTYPES.get(precision), check_finite=True)
            losses, times = [], []
            with PeakMemory(device) as mem:
                for _ in range(spec["iters"]):
                    t0 = time.perf_counter()
                    loss = step()
                    synchronize(device)
                    times.append(time.perf_counter() - t0)
                    losses.append(float(loss))
            unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
            row.update(
                status="ok", first_loss=losses[0], last_loss=losses[-1], losses=losses,
                peak_mib=mem.peak_abs_bytes / 2**20,
                step_ms=1e3 * sorted(times)[len(times) // 2],  # median; the first includes warm-up
                params=sum(p.numel() for p in model.parameters()), params_without_grad=unused[:10],
            )
        except Exception as e:  # noqa: BLE001  (reported per config and precision)
            row.update(status="failed", error=f"{type(e).__name__}: {e}"[:500])
        finally:
            model = opt = inputs = None  # free before the next precision
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    return {"rows": rows}


def _previous_rows(args, stage: str) -> list:
    """The result rows of ``OUT/stage_<stage>.json`` from an earlier call (``--resume``), or []."""
    path = os.path.join(args.out, f"stage_{stage}.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return json.load(f).get("results", [])


def stage_configs(args, budget: Budget) -> dict:
    """Each config trained ``--iters`` iterations in each precision at its own training size
    (:func:`training_shape`, unless ``--size`` / ``--batch``), one process per config; the rows an
    earlier call left ok in ``OUT/stage_configs.json`` are kept and not run again."""
    configs = args.configs or all_configs()
    spec_dir = os.path.join(args.work_dir, "specs")
    os.makedirs(spec_dir, exist_ok=True)
    kept = [r for r in _previous_rows(args, "configs") if r.get("status") == "ok"]
    done = {(r["config"], r["precision"]) for r in kept}
    results = list(kept)
    for i, config in enumerate(configs):
        if all((gpu_report.config_name(config), p) in done for p in args.precisions):
            continue
        if budget.left() <= 5:
            results += [{"config": gpu_report.config_name(config), "precision": p, "status": "skipped",
                         "error": "stage budget spent"} for p in args.precisions]
            continue
        spec = dict(config=config, device=args.device, precisions=args.precisions, iters=args.iters,
                    batch=args.batch, size=args.size, seed=0)
        spec_file = os.path.join(spec_dir, f"config_{i}.json")
        write_json(spec_file, spec)
        print(f"[gpu_check] configs: {config}", file=sys.stderr, flush=True)
        try:
            results += run_worker([os.path.abspath(__file__), "--worker-config", spec_file],
                                  timeout=max(1.0, budget.left()))["rows"]
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            why = "timed out (stage budget)" if isinstance(e, subprocess.TimeoutExpired) else str(e)[-400:]
            results += [{"config": gpu_report.config_name(config), "precision": p, "status": "failed",
                         "error": why} for p in args.precisions]
    ok = bool(results) and all(r["status"] == "ok" for r in results)
    return {"status": "ok" if ok else "failed", "size": args.size or "each config's own",
            "batch": args.batch or "each config's own", "iters": args.iters, "results": results,
            "resumed": len(kept)}


# ----------------------------------------------------------------------------- stage: demo
def demo_test_datasets(config: str) -> tuple:
    """The datasets ``config`` evaluates (its ``DATASETS.TEST``)."""
    from aadet.engine import load_config

    return tuple(load_config(os.path.join(REPO, config)).DATASETS.TEST)


def _read_metrics(out_dir: str, datasets) -> dict:
    """The last AP / AP50 / AP75 of each of ``datasets`` in the run's ``metrics.json`` (Detectron2
    writes ``bbox/AP`` for one test dataset, ``<name>/bbox/AP`` for several), its iterations and
    first and last loss."""
    path = os.path.join(out_dir, "metrics.json")
    metrics = {}
    for name in datasets:
        try:
            m = last_box_metrics(path, name if len(datasets) > 1 else None)
        except ValueError as e:
            raise RuntimeError(f"{name}: {e}") from None
        if not all(math.isfinite(m.get(k, math.nan)) for k in ("AP", "AP50")):
            # Detectron2 reports NaN when the model has no detection above the test score threshold.
            raise RuntimeError(f"{name}: AP is not a number ({m.get('AP')}): no detections after training")
        metrics[name] = m
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    losses = [r["total_loss"] for r in rows if "total_loss" in r]
    return {"metrics": metrics, "iters": max((r.get("iteration", 0) for r in rows), default=0) + 1,
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}


def demo_schedule(epochs: int) -> list:
    """Config overrides of the demo recipe shortened to ``epochs`` (LR steps at 75 % and 90 %, as
    the full recipe's 75 / 90 of 100 epochs; warm-up at most 4 iterations an epoch)."""
    return ["SOLVER.EPOCHS", str(epochs), "SOLVER.STEPS_EPOCHS", f"({0.75 * epochs:g}, {0.9 * epochs:g})",
            "SOLVER.WARMUP_ITERS", str(min(50, 4 * epochs)), "SOLVER.CHECKPOINT_PERIOD", "100000"]


def stage_demo(args, budget: Budget) -> dict:
    root = os.path.abspath(args.data_root)
    env = {"AADET_DATASETS": root, "DETECTRON2_DATASETS": root}
    prep = [sys.executable, "datasets/prepare_trees.py", "--root", root]
    if args.wheelhouse:
        prep += ["--wheelhouse", args.wheelhouse]
    rc, tail = _run(prep, budget.left(), os.path.join(args.work_dir, "prepare_demo_data.log"), env)
    if rc != 0:
        return {"status": "failed", "error": f"demo data preparation failed (exit {rc})", "log_tail": tail}
    epochs = args.demo_epochs
    schedule = demo_schedule(epochs)
    results = []
    for i, config in enumerate(DEMO_CONFIGS):
        name = gpu_report.config_name(config)
        if budget.left() <= 10:
            results.append({"config": name, "status": "skipped", "error": "stage budget spent"})
            continue
        out_dir = os.path.join(args.work_dir, "demo", name)
        shutil.rmtree(out_dir, ignore_errors=True)
        cmd = [sys.executable, "tools/train_net.py", "--config-file", config, "--num-gpus", "1",
               "OUTPUT_DIR", out_dir, "MODEL.DEVICE", args.device, *schedule]
        print(f"[gpu_check] demo: {config} ({epochs} epochs)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        # Each run may take what is left, shared fairly with the runs after it.
        rc, tail = _run(cmd, budget.left() / (len(DEMO_CONFIGS) - i) * 1.5,
                        os.path.join(args.work_dir, f"demo_{name}.log"), env)
        row = {"config": name, "epochs": epochs, "elapsed_s": time.monotonic() - t0}
        try:
            if rc != 0:
                raise RuntimeError(f"train_net exit {rc}: {tail.strip()[-300:]}")
            row.update(_read_metrics(out_dir, demo_test_datasets(config)), status="ok")
        except (OSError, RuntimeError, ValueError) as e:
            row.update(status="failed", error=str(e)[:500])
        results.append(row)
    ok = all(r["status"] == "ok" for r in results)
    return {"status": "ok" if ok else "failed", "epochs": epochs, "results": results}


# ----------------------------------------------------------------------------- stage: benchmarks
def bench_settings(args) -> dict:
    """Size, batch, warm-up, iterations and precisions of the benchmarks stage: the targets'
    protocol (:data:`aadet_dev.gpu_report.PROTOCOL`), iterations from the command line (their
    defaults are the protocol's least), or a smoke run's small sizes with ``--quick``."""
    p = gpu_report.PROTOCOL
    if args.quick:
        return dict(size=256, batch=2, warmup=1, iters=3, precisions=p.precisions)
    return dict(size=p.size[0], batch=p.batch, warmup=args.bench_warmup, iters=args.bench_iters,
                precisions=p.precisions)


def _bench_layers(args, s: dict, suite: str, precision: str, budget: Budget):
    """``dev/benchmark_layers.py --suite SUITE`` in ``precision`` at the stage's settings ``s``:
    ``(its JSON, None)``, or ``(None, why)`` (the exit status and the output's tail)."""
    out = os.path.join(args.work_dir, f"bench_layers_{suite}_{precision}.json")
    cmd = ["dev/benchmark_layers.py", "--suite", suite, "--device", args.device, "--batch", str(s["batch"]),
           "--sizes", *(str(x) for x in args.layer_sizes), "--warmup", str(s["warmup"]),
           "--iters", str(s["iters"]), "--output-json", out, "--output-md", out[:-5] + ".md", "--profile"]
    cmd += ["--amp", "--amp-dtype", gpu_report.AMP_DTYPES[precision]] if precision != "fp32" else []
    print(f"[gpu_check] benchmarks: {' '.join(cmd)}", file=sys.stderr, flush=True)
    rc, tail = _run([sys.executable, *cmd], budget.left(), out[:-5] + ".log")
    if rc == 0 and os.path.isfile(out):
        with open(out) as f:
            return json.load(f), None
    return None, f"exit {rc}: {tail.strip()[-300:]}"


def _bench_configs_cmd(args, s: dict, configs, out: str, amp: str, amp_dtype, *extra) -> list:
    """``tools/benchmark.py`` on ``configs`` at the stage's settings ``s`` (``amp``: its ``--amp``),
    each phase profiled once more after its timed steps (what bounds each target); on CUDA every
    case in one process (at 3a55981 a fresh process a case cost 20-35 s, about 1 s of it timed
    steps, and each timed out at its 19 s): the cases in ``configs`` order, fp32 first; the cases
    finished when the budget ends are kept."""
    cmd = ["tools/benchmark.py", "--configs", *configs, "--device", args.device, "--size", str(s["size"]),
           "--batch", str(s["batch"]), "--warmup", str(s["warmup"]), "--iters", str(s["iters"]),
           "--output-json", out, "--output-md", out[:-5] + ".md", "--amp", amp, "--profile", *extra]
    cmd += ["--amp-dtype", amp_dtype] if amp_dtype and amp != "off" else []
    return cmd + (["--in-process"] if args.device == "cuda" else [])


#: The least of the benchmarks stage's budget left for the compiled cases to start: Inductor
#: compiles each config's inference and training graphs in its first warm-up calls (not yet
#: measured on a GPU; the demo detector's training step took 4.8 min on 2 CPU cores).
COMPILED_MIN_S = 120


def _bench_compiled(args, s: dict, budget: Budget, notes: list) -> list:
    """``MODEL.COMPILE`` as an option, after everything else (no target): ``tools/benchmark.py
    --compile`` on :data:`~aadet_dev.gpu_report.COMPILED_CONFIGS` in
    :data:`~aadet_dev.gpu_report.COMPILED_PRECISION`, with what is left of the budget when that is
    at least :data:`COMPILED_MIN_S`. Returns its JSON in a list (empty where it did not run or
    wrote nothing); why not, and a failure, go to ``notes``."""
    what = f"tools/benchmark.py --compile ({gpu_report.COMPILED_PRECISION})"
    if args.quick or budget.left() < COMPILED_MIN_S:
        why = "a smoke run" if args.quick else \
            f"{budget.left():.0f} s of the stage budget left, less than its {COMPILED_MIN_S} s"
        notes.append(f"{what} not run: {why} (no target; not measured)")
        return []
    out = os.path.join(args.work_dir, "bench_compiled.json")
    cmd = _bench_configs_cmd(args, s, gpu_report.COMPILED_CONFIGS, out, "on",
                             gpu_report.AMP_DTYPES[gpu_report.COMPILED_PRECISION], "--compile")
    print(f"[gpu_check] benchmarks: {' '.join(cmd)}", file=sys.stderr, flush=True)
    rc, tail = _run([sys.executable, *cmd], budget.left(), out[:-5] + ".log")
    reports = []
    if os.path.isfile(out):  # complete, or the cases finished before the budget ended
        with open(out) as f:
            reports.append(json.load(f))
    if rc != 0:
        notes.append(f"{what} exit {rc}: {tail.strip()[-300:]} (no target)")
    return reports


def stage_benchmarks(args, budget: Budget) -> dict:
    s = bench_settings(args)
    if gpu_report.PROTOCOL.size[0] != gpu_report.PROTOCOL.size[1]:
        raise ValueError(f"tools/benchmark.py measures square images; the protocol has {gpu_report.PROTOCOL.size}")
    amp = [p for p in s["precisions"] if p != "fp32"]
    if len(amp) > 1:
        raise ValueError(f"tools/benchmark.py measures one AMP dtype a run; the protocol has {amp}")
    amp_dtype = gpu_report.AMP_DTYPES[amp[0]] if amp else None
    amp_modes = (["fp32"] if "fp32" in s["precisions"] else []) + amp
    notes, errors = [], []
    cfg_json = os.path.join(args.work_dir, "bench_configs.json")
    cmd = _bench_configs_cmd(args, s, gpu_report.BENCHMARK_CONFIGS, cfg_json,
                             "both" if len(amp_modes) == 2 else "on" if amp else "off", amp_dtype)
    layer_budget = 0.3 * budget.left()  # kept from benchmark.py for the layer runs below
    print(f"[gpu_check] benchmarks: {' '.join(cmd)}", file=sys.stderr, flush=True)
    for stale in glob.glob(os.path.join(args.work_dir, "bench_*.json")):
        os.remove(stale)  # never read a benchmark JSON of an earlier run
    rc, tail = _run([sys.executable, *cmd], budget.left() - layer_budget,
                    os.path.join(args.work_dir, "bench_configs.log"))
    config_reports = []
    if os.path.isfile(cfg_json):  # complete, or the cases finished before a timeout ("partial")
        with open(cfg_json) as f:
            config_reports.append(json.load(f))
    if rc != 0 or not config_reports:
        partial = config_reports and config_reports[0].get("partial")
        done = f" after {len(config_reports[0]['results'])} finished case(s)" if partial else ""
        errors.append(f"tools/benchmark.py exit {rc}{done}: {tail.strip()[-300:]}")
    layer_reports = []
    # SASA's layer (the layer targets) first; the suites without a target get what is left.
    for suite in ("sasa", *gpu_report.INFORMATIONAL_LAYER_SUITES):
        for precision in amp_modes:
            what = f"dev/benchmark_layers.py --suite {suite} ({precision})"
            if suite != "sasa" and budget.left() <= 5:
                notes.append(f"{what} not run: stage budget spent (no target; not measured)")
                continue
            report, why = _bench_layers(args, s, suite, precision, budget)
            if report is not None:
                layer_reports.append(report)
            elif suite == "sasa":
                errors.append(f"{what} {why}")
            else:
                notes.append(f"{what} {why} (no target; not measured)")
    compiled_reports = _bench_compiled(args, s, budget, notes)
    if not config_reports and not layer_reports:
        return {"status": "failed", "error": "; ".join(errors), "notes": notes}
    bench = gpu_report.benchmarks_cuda(config_reports, layer_reports, compiled_reports=compiled_reports,
                                       amp_dtype=amp_dtype, smoke=args.quick)
    bench["quick"] = args.quick
    # The stage's verdict first ("ran": every case measured; unless a smoke run, at the targets'
    # protocol), then where the numbers go: only a passed, complete run is the record.
    if bench["missing"]:
        errors.append(f"not measured: {', '.join(bench['missing'])}")
    if not args.quick and not bench["comparable"]:
        errors.append(f"not at the targets' protocol: {bench['not_comparable_why']}")
    status = "ok" if not errors else "failed"
    if status == "ok" and bench["complete"]:
        write_json(args.bench_json, bench)
        notes.append(f"wrote the record {args.bench_json}")
    else:
        why = "; ".join(errors) or bench["not_comparable_why"] or "a smoke run"
        scratch = os.path.join(args.work_dir, "benchmarks_cuda.scratch.json")
        write_json(scratch, dict(bench, scratch=f"not the record ({args.bench_json} is left as it was): {why}"))
        notes.append(f"wrote {scratch}, not the record: {why}")
    with open(os.path.join(args.work_dir, "benchmarks_cuda.md"), "w") as f:
        f.write(gpu_report.render_benchmarks_markdown(bench))
    out = {"status": status, "benchmarks": bench, "notes": notes}
    if errors:
        out["error"] = "; ".join(errors)
    return out


#: The stages that run on a CPU too, as a dry run (``--device cpu``: never counted).
CPU_DRY_RUN_STAGES = {"sweep", "configs"}
STAGE_FUNCTIONS = {"sweep": stage_sweep, "tests": stage_tests, "configs": stage_configs,
                   "benchmarks": stage_benchmarks, "demo": stage_demo}
assert tuple(STAGE_FUNCTIONS) == tuple(gpu_report.STAGES)


# ----------------------------------------------------------------------------- main
def resume_from(previous: str, out: str) -> set:
    """Copy an earlier call's ``stage_*.json`` and sweep rows into ``out`` (where the stages go on
    from them); returns the stages that passed there (their files stay as they are)."""
    passed = set()
    for name in gpu_report.STAGES:
        src = os.path.join(previous, f"stage_{name}.json")
        if not os.path.isfile(src):
            continue
        with open(src) as f:
            stage = json.load(f)
        if os.path.abspath(src) != os.path.abspath(os.path.join(out, f"stage_{name}.json")):
            shutil.copy(src, out)
        if stage.get("status") == "ok":
            passed.add(name)
    for extra in (SWEEP_ROWS, os.path.splitext(SWEEP_ROWS)[0] + ".plan.json"):
        src = os.path.join(previous, extra)
        if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out, extra)):
            shutil.copy(src, out)
    return passed


def _budgets(items):
    budgets = dict(DEFAULT_BUDGET_S)
    for item in items or ():
        name, _, sec = item.partition("=")
        if name not in budgets or not sec:
            raise SystemExit(f"--budget takes STAGE=SECONDS with STAGE in {list(budgets)}; got {item!r}")
        try:
            budgets[name] = float(sec)
        except ValueError:
            raise SystemExit(f"--budget {item!r}: SECONDS must be a number") from None
    return budgets


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", default=list(gpu_report.STAGES), choices=list(gpu_report.STAGES),
                   help="stages to run, in this order (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: configs 2 iters at 128 px, demo 2 epochs, benchmarks 256 px batch 2; "
                   "exits 1 even when every stage passes (a smoke run is not the check)")
    p.add_argument("--device", default="cuda",
                   help="cuda (default) or cpu (dry run of the configs stage: exits 1, its stage never counts)")
    p.add_argument("--out", default=None,
                   help="report folder (stage_*.json, report.md/json; default output/gpu_check, for --device cpu "
                   "output/gpu_check_cpu_dry_run)")
    p.add_argument("--work-dir", default="output/gpu_check_work",
                   help="logs, junit XML, raw benchmark JSON, training outputs (default output/gpu_check_work; "
                   "kept out of OUT so that OUT holds only the report files)")
    p.add_argument("--report-only", action="store_true",
                   help="only merge OUT/stage_*.json into the report; exit 0 only when every stage of --stages "
                   "(default all) counts")
    p.add_argument("--allow-stale", action="store_true",
                   help="merge stage files of another commit than HEAD too (marked stale in the report)")
    p.add_argument("--budget", nargs="+", metavar="STAGE=SECONDS",
                   help=f"time budget per stage (default {DEFAULT_BUDGET_S})")
    p.add_argument("--test-workers", type=int, default=8,
                   help="tests stage: pytest-xdist processes sharing the GPU (0: one process; "
                        "one process too where pytest-xdist is not installed)")
    p.add_argument("--configs", nargs="+", metavar="FILE", help="configs stage: these configs (default: all)")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(gpu_report.PRECISIONS),
                   help="configs stage: precisions (default fp32 bf16)")
    p.add_argument("--iters", type=int, default=None, help="configs stage: iterations (default 20; quick 2)")
    p.add_argument("--size", type=int, default=None,
                   help="configs stage: image side (default each config's own: COCO 640; quick 128)")
    p.add_argument("--batch", type=int, default=None,
                   help="configs stage: images per iteration (default each config's own: COCO 8; quick 2)")
    p.add_argument("--sweep-configs", nargs="+", metavar="FILE",
                   help="sweep stage: the configs whose layers it takes (default the COCO configs)")
    p.add_argument("--plan", choices=["all", *gpu_report.LOAN_PLAN], nargs="?", const="all",
                   help="print the lent machine's call plan (each call's stages and budgets) and exit; "
                   "with a call's name, only its budgets as STAGE=SECONDS (what dev/gpu_loan.sh reads)")
    p.add_argument("--resume", metavar="DIR",
                   help="an earlier call's OUT (stage_*.json, sweep.jsonl): its stages that passed are not run "
                   "again, the sweep and the configs stage go on from the cases it finished")
    p.add_argument("--demo-epochs", type=int, default=None, help="demo stage: epochs, >= 2 (default 30; quick 2)")
    p.add_argument("--data-root", default=os.environ.get("AADET_DATASETS", "datasets"),
                   help="demo stage: data root (default $AADET_DATASETS or ./datasets)")
    p.add_argument("--wheelhouse", default=os.environ.get("AADET_WHEELHOUSE"),
                   help="demo stage: folder holding the deepforest wheel (default $AADET_WHEELHOUSE)")
    protocol = gpu_report.PROTOCOL
    p.add_argument("--bench-iters", type=int, default=protocol.min_iters,
                   help=f"benchmarks: timed iterations (default {protocol.min_iters}, the targets' least: fewer "
                   "make a scratch JSON, not the record)")
    p.add_argument("--bench-warmup", type=int, default=protocol.min_warmup,
                   help=f"benchmarks: warm-up iterations (default {protocol.min_warmup}, the targets' least)")
    p.add_argument("--layer-sizes", type=int, nargs="+", default=[80], help="benchmarks: layer map sides (80)")
    p.add_argument("--bench-json", default=os.path.join(REPO, "docs", "benchmarks_cuda.json"),
                   help="benchmarks: the record, written only by a complete run at the targets' protocol whose "
                   "stage passed (default docs/benchmarks_cuda.json); else WORK_DIR/benchmarks_cuda.scratch.json")
    p.add_argument("--worker-config", metavar="SPEC", help=argparse.SUPPRESS)
    return p


def write_merged_report(out_dir: str, allow_stale: bool = False, required=tuple(gpu_report.STAGES)) -> dict:
    """Merge ``out_dir/stage_*.json`` into ``report.json`` / ``report.md``, judged against this
    checkout's commit; SystemExit naming the files and commits when some ran at another commit
    than HEAD (unless ``allow_stale``: merged, marked stale, never counted)."""
    stages, files = {}, {}
    for name in gpu_report.STAGES:
        path = os.path.join(out_dir, f"stage_{name}.json")
        if os.path.isfile(path):
            with open(path) as f:
                stages[name], files[name] = json.load(f), path
    head = checkout_commit()["commit"]
    try:
        stale = gpu_report.stale_stages(stages, head, allow_stale=allow_stale, files=files)
    except gpu_report.StaleStageError as e:
        raise SystemExit(f"[gpu_check] {e}") from None
    report = gpu_report.merge_stage_results(stages, head=head, required=required, stale=stale)
    write_json(os.path.join(out_dir, "report.json"), report)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(gpu_report.render_report_markdown(report))
    return report


def _finish(report: dict, out_dir: str) -> int:
    """Print both verdicts; the exit status: 0 only when the check passed."""
    print(f"[gpu_check] {gpu_report.summary_line(report)}: {os.path.join(out_dir, 'report.md')}")
    return 0 if report["status"] == "ok" else 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plan:
        if args.plan == "all":
            print("\n".join(gpu_report.loan_plan_lines()))
        else:
            print(" ".join(f"{k}={v}" for k, v in gpu_report.LOAN_PLAN[args.plan]["stages"].items()))
        return 0
    if args.worker_config:
        with open(args.worker_config) as f:
            print(json.dumps(train_config_worker(json.load(f))))
        return 0
    device = torch.device(args.device)
    args.out = args.out or ("output/gpu_check" if device.type == "cuda" else "output/gpu_check_cpu_dry_run")
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        return _finish(write_merged_report(args.out, args.allow_stale, args.stages), args.out)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check needs a CUDA machine: torch {torch.__version__} (CUDA build "
                         f"{torch.version.cuda}) sees no CUDA device. For a CPU dry run of the configs "
                         "stage: --device cpu --stages configs")
    if device.type != "cuda" and not set(args.stages) <= CPU_DRY_RUN_STAGES:
        raise SystemExit(f"--device {args.device}: only the {sorted(CPU_DRY_RUN_STAGES)} stages have a CPU dry run; "
                         f"stages {sorted(set(args.stages) - CPU_DRY_RUN_STAGES)} need CUDA")
    args.iters = args.iters or (2 if args.quick else 20)
    args.size = args.size or (128 if args.quick else None)
    args.batch = args.batch or (2 if args.quick else None)
    args.demo_epochs = args.demo_epochs or (2 if args.quick else 30)
    if min(args.iters, args.size or 1, args.batch or 1) < 1:
        raise SystemExit(f"--iters, --size and --batch must be >= 1; got {args.iters}, {args.size}, {args.batch}")
    if args.demo_epochs < 2:  # 1 epoch = 4 iterations: an LR step would round onto the last one
        raise SystemExit(f"--demo-epochs must be >= 2; got {args.demo_epochs}")
    budgets = _budgets(args.budget)
    # Every tool, test and worker started from here imports this checkout's aadet.
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    args.work_dir, args.out = os.path.abspath(args.work_dir), os.path.abspath(args.out)
    os.makedirs(args.work_dir, exist_ok=True)
    env = gpu_environment(args.device)
    commit = checkout_commit()
    if commit["dirty"] is not False:
        print(f"[gpu_check] the tree is not a clean commit ({commit.get('how')}): these stages will not count\n  "
              + "\n  ".join(commit.get("changes") or ["state unknown"]), file=sys.stderr, flush=True)
    passed = resume_from(args.resume, args.out) if args.resume else set()
    for name in gpu_report.STAGES:
        if name not in args.stages:
            continue
        if name in passed:
            print(f"[gpu_check] stage {name}: passed in {args.resume}, not run again", file=sys.stderr, flush=True)
            continue
        budget = Budget(budgets[name])
        print(f"[gpu_check] stage {name} (budget {budgets[name]:.0f} s)", file=sys.stderr, flush=True)
        try:
            result = STAGE_FUNCTIONS[name](args, budget)
        except Exception as e:  # noqa: BLE001  (the next stage still runs; the report says why)
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:1000]}
        result.update(env=env, device=device.type, elapsed_s=budget.elapsed(), budget_s=budgets[name],
                      quick=args.quick, **commit)
        write_json(os.path.join(args.out, f"stage_{name}.json"), result)
        print(f"[gpu_check] stage {name}: {result['status']} ({budget.elapsed():.0f} s)", file=sys.stderr, flush=True)
    return _finish(write_merged_report(args.out, args.allow_stale, args.stages), args.out)


if __name__ == "__main__":
    sys.exit(main())
