#!/usr/bin/env python
"""Training and inference speed and memory of aadet configs, as ratios to the conv baseline.

    # CPU (small sizes): the demo models, the first config is the baseline
    OMP_NUM_THREADS=1 python tools/benchmark.py --configs configs/Demo/trees_R_26_slim_FPN.yaml \\
        configs/Demo/trees_AA_R_26_slim_FPN.yaml configs/Demo/trees_SASA_R_26_slim_FPN.yaml \\
        --device cpu --size 256 --batch 2 --output-json out/bench_demo_cpu.json

    # CUDA: the COCO R50 models at the papers' 640x640, batch 16, AMP off and on
    python tools/benchmark.py --configs configs/COCO-Detection/retinanet_R_50_FPN_scratch_150ep.yaml \\
        configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep.yaml \\
        configs/COCO-Detection/sasa_convstem_retinanet_R_50_FPN_scratch_150ep.yaml \\
        --device cuda --size 640 --batch 16 --amp both --warmup 10 --iters 50 \\
        --output-json out/bench_coco_cuda.json --output-md out/bench_coco_cuda.md

For every config (and AMP mode), in one run and on the same synthetic batch (random images and
boxes, generated once and loaded by every case; no dataset needed):

* **training iteration**: forward with losses, backward, SGD step (Detectron2's RetinaNet loss,
  the config's model; ``aadet/benchmark/training_step.py``); median over ``--iters`` after
  ``--warmup``; images/s = batch / median;
* **inference latency**: ``model.eval()`` forward of the batch under ``torch.no_grad()``,
  post-processing included; median per batch and per image;
* **peak memory** of each phase: CUDA ``max_memory_allocated``; CPU the process' resident-set
  high-water mark in a memory pass after the timed rounds (each case once more, in a process
  where malloc returns every tensor to the system when it is freed: see
  ``aadet/benchmark/timing.py``), both absolute and above the state before the phase (weights
  and inputs already resident): the ratios use the latter;
* each as a **ratio to the baseline** (``--baseline``, default the first config) of the same run
  and AMP mode;
* with ``--profile``, what bounds each phase: one more call of it under ``torch.profiler``
  (:mod:`aadet.benchmark.step_profile`): the device time by operator and by kind of work
  (attention, conv, matmul, norm, copies, other), beside the timed median.

``MODEL.COMPILE`` holds here as in training (``--compile`` sets ``MODEL.COMPILE.ENABLED``): every
config's model runs through ``torch.compile``, the first warm-up call of each phase compiling it
(the phase's ``wall_s`` includes it); each result records the compile settings it ran with.

Each (config, AMP) case runs in a fresh process, so one model's allocator state cannot inflate
another's peak. AMP: autocast to ``--amp-dtype`` (default float16 with a GradScaler on CUDA, as
Detectron2's AMPTrainer; bfloat16 on CPU; bfloat16 on CUDA needs no GradScaler). On CPU the
process CPU time per iteration is recorded next to wall time: on a shared machine it is the
steadier number (with ``OMP_NUM_THREADS=1`` it is the compute time). Where the machine itself
changes speed (a virtual machine on a shared host; BENCHMARKS.md, "How it is measured"), CPU time
drifts with it: ``--interleave`` keeps every config's process alive and lets them take turns
iteration by iteration (the train-time ratio is the median of each iteration over the baseline's
of the same turn), ``--rounds N`` measures every case N times round-robin (the median of the
rounds' medians); either reports the ratio's spread. Writes JSON
(``--output-json``; without ``--interleave`` or ``--rounds`` it is also written after every case,
marked ``"partial": true`` until the run ends, so a run cut off at a time limit keeps the cases
it finished; each case records its build time and each phase's wall time, warm-up included, as
the progress lines on stderr do) and a markdown table (``--output-md``, or stdout; rendered by
:mod:`aadet.benchmark.report`); the measuring is :mod:`aadet.benchmark`'s, shared with the
project's layer benchmarks (``dev/benchmark_layers.py``).
"""

import argparse
import gc
import os
import sys
import tempfile
import time
import traceback
import warnings
from typing import List

warnings.filterwarnings(
    "ignore", category=FutureWarning
)  # torch.jit deprecation (detectron2, fvcore)

import torch  # noqa: E402

from aadet.benchmark.report import (  # noqa: E402
    index_results,
    ratios,
    render_model_table,
    write_json,
    write_report,
)
from aadet.benchmark.timing import (  # noqa: E402
    add_amp_dtype_argument,
    TakeTurns,
    autocast,
    command_device,
    combine_rounds,
    merge_rounds,
    environment_info,
    peak_memory_meaning,
    measure,
    quantile,
    memory_pass,
    run_case_in_subprocess,
    run_interleaved,
    worker_main,
)
from aadet.benchmark.synthetic_batch import detectron2_inputs, make_batch  # noqa: E402
from aadet.benchmark.step_profile import add_profile_argument  # noqa: E402
from aadet.benchmark.training_step import TrainingStep  # noqa: E402
from aadet.engine.compile import add_compile_argument, compile_opts  # noqa: E402
from aadet.engine.defaults import parse_args_with_opts  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--configs",
        nargs="+",
        metavar="FILE",
        help="config files (the first is the baseline " "unless --baseline)",
    )
    p.add_argument(
        "--baseline", metavar="FILE", help="the conv baseline config (default: the first)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument(
        "--size",
        type=int,
        nargs="+",
        default=[256],
        metavar="PX",
        help="image size S or H W (default 256; the papers train at 640)",
    )
    p.add_argument("--batch", type=int, default=1, help="images per iteration (default 1)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations (default 2 CPU, 10 CUDA)"
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed iterations (default 5 CPU, 30 CUDA)"
    )
    p.add_argument(
        "--amp",
        choices=("off", "on", "both"),
        default="off",
        help="autocast to --amp-dtype (default off)",
    )
    add_amp_dtype_argument(p)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every case this many times, round-robin over the configs, each time in a "
        "fresh process; times are the median of the rounds' medians, and the train-time ratio's "
        "range over the rounds is reported (default 1; 3 on a shared machine whose speed drifts)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="all configs' processes alive at once, taking turns iteration by iteration, so that "
        "every case is timed in the same minutes (a machine whose speed drifts moves them alike); "
        "the train-time ratio's interquartile range over the paired iterations is reported",
    )
    p.add_argument("--no-train", action="store_true", help="skip the training measurement")
    p.add_argument("--no-inference", action="store_true", help="skip the inference measurement")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every case")
    add_compile_argument(p, "every case's model (its first warm-up call of each phase compiles)")
    add_profile_argument(p, "each phase")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic batch and the weights"
    )
    p.add_argument(
        "--case-timeout", type=float, default=None, metavar="SECONDS",
        help="stop a case (one config in one precision) after this long and report it as failed, "
             "so one slow case leaves time for the others (default: no limit; not with --interleave)",
    )
    p.add_argument(
        "--in-process", action="store_true",
        help="CUDA: run every case in this process, one after the other (imports and cuDNN's "
             "autotuning paid once; the peaks are the allocator's, reset for each phase) instead "
             "of a fresh process a case; a failing case is reported and the run goes on",
    )
    p.add_argument("--output-json", metavar="FILE", help="write all results as JSON")
    p.add_argument(
        "--output-md", metavar="FILE", help="write the markdown table here (default: stdout)"
    )
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)  # internal: one case
    p.add_argument("opts", nargs=argparse.REMAINDER, default=[], help="config overrides KEY VALUE ..., every config")
    return p


# ----------------------------------------------------------------------------- one case
def run_case(spec: dict) -> dict:
    """Build one config's model and measure it (runs inside the worker process)."""
    from detectron2.modeling import build_model

    import aadet  # noqa: F401
    from aadet.analysis.params import count_parameters
    from aadet.benchmark.step_profile import profile_call
    from aadet.engine.compile import compile_kwargs, maybe_compile
    from aadet.engine.defaults import load_config

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    cfg = load_config(spec["config"], ["MODEL.DEVICE", str(device), *spec["opts"]])
    torch.manual_seed(spec["seed"])
    start = time.monotonic()
    model = maybe_compile(build_model(cfg).to(device), cfg)  # MODEL.COMPILE, as Trainer.build_model
    build_s = time.monotonic() - start
    data = torch.load(spec["batch_file"])
    num_classes = cfg.MODEL.RETINANET.NUM_CLASSES
    amp, amp_dtype = spec["amp"], spec["amp_dtype"]
    turns = TakeTurns.from_spec(spec)  # --interleave
    result = {
        "config": spec["config"],
        "amp": amp,
        "amp_dtype": amp_dtype,
        "params": count_parameters(model),
        "env": environment_info(device),
        "build_s": round(build_s, 2),
        "compile": compile_kwargs(cfg) if cfg.MODEL.COMPILE.ENABLED else None,
    }
    # wall_s of a phase: its warm-up and timed calls (on CUDA the warm-up compiles the kernels)

    if not spec["no_inference"]:
        inputs = detectron2_inputs(data, num_classes, with_instances=False)
        model.eval()

        def infer():
            with torch.no_grad(), autocast(device, amp_dtype, amp):
                model(inputs)

        start = time.monotonic()
        m = measure(infer, warmup=spec["warmup"], iters=spec["iters"], device=device, turns=turns)
        result["inference"] = dict(m, per_image_s=m["median_s"] / len(inputs),
                                   wall_s=round(time.monotonic() - start, 2))
        if spec.get("profile"):
            result["inference"]["profile"] = profile_call(infer, device)

    if not spec["no_train"]:
        step = TrainingStep(model, detectron2_inputs(data, num_classes, with_instances=True),
                            amp_dtype=amp_dtype if amp else None)
        start = time.monotonic()
        m = measure(step, warmup=spec["warmup"], iters=spec["iters"], device=device, turns=turns)
        result["train"] = dict(m, images_per_s=len(step.inputs) / m["median_s"],
                               wall_s=round(time.monotonic() - start, 2))
        if spec.get("profile"):
            result["train"]["profile"] = profile_call(step, device)
    return result


def run_case_here(spec: dict) -> dict:
    """:func:`run_case` in this process (``--in-process``): an exception is the case's result, as
    a worker's failure is (``{"spec", "error", "detail"}``), and the case's memory is released."""
    try:
        return run_case(spec)
    except Exception as e:  # noqa: BLE001 -- a failing case is a row of the table
        return {"spec": spec, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                "detail": traceback.format_exc()[-3000:]}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- report
#: ratio name -> the number compared, in a result (all ratios: result / baseline).
RATIO_METRICS = {
    "train_time": "train.median_s",
    "train_cpu_time": "train.cpu_median_s",
    "images_per_s": "train.images_per_s",
    "train_peak_mem": "train.peak_bytes",
    "inference_time": "inference.median_s",
    "inference_cpu_time": "inference.cpu_median_s",
    "inference_peak_mem": "inference.peak_bytes",
}


def add_ratios(results, baseline: str):
    """``ratios`` per result: to the baseline config's result with the same AMP mode."""
    base = index_results(results, key=lambda r: (r["config"], r["amp"]))
    for r in results:
        b = base.get((baseline, r["amp"]))
        if "error" not in r and b is not None:
            r["ratios"] = ratios(r, b, RATIO_METRICS)
    return results


def combine_case(same: List[dict]) -> dict:
    """One case's results of several rounds (each with its own ``ratios``) as one: the phases
    combined by :func:`~aadet.benchmark.timing.combine_rounds`, and ``ratio_ranges`` ``{metric: [min,
    max]}`` of the rounds' own ratios (each round's cases ran minutes apart, so a ratio within a
    round is the one least touched by a drifting machine). With
    :func:`~aadet.benchmark.timing.merge_rounds`, a case that failed in any round is reported by its
    first failure."""
    r = {k: v for k, v in same[0].items() if k != "ratios"}
    for phase in ("train", "inference"):
        if phase in r:
            r[phase] = combine_rounds([x[phase] for x in same])
    if "train" in r:
        per_image = same[0]["train"]["images_per_s"] * same[0]["train"]["median_s"]
        r["train"]["images_per_s"] = per_image / r["train"]["median_s"]
    r["ratio_ranges"] = {
        m: [min(v), max(v)]
        for m in RATIO_METRICS
        for v in [[x["ratios"][m] for x in same if x.get("ratios", {}).get(m) is not None]]
        if len(v) == len(same)
    }
    return r


def add_paired_spread(results: List[dict], baseline: str) -> List[dict]:
    """The train-time ratio of an interleaved run from its pairs: each timed iteration over the
    baseline's iteration of the same turn (the two ran seconds apart); ``ratios["train_time"]``
    is their median, ``ratio_ranges["train_time"]`` their 25 and 75 % quantiles."""
    base = index_results(results, key=lambda r: (r["config"], r["amp"]))
    for r in results:
        b = base.get((baseline, r["amp"]))
        if "error" in r or b is None or "train" not in r or "train" not in b:
            continue
        paired = [t / tb for t, tb in zip(r["train"]["times_s"], b["train"]["times_s"])]
        r["ratios"]["train_time"] = quantile(paired, 0.5)
        r.setdefault("ratio_ranges", {})["train_time"] = [quantile(paired, 0.25), quantile(paired, 0.75)]
    return results


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args_with_opts(build_parser(), argv)  # overrides after --configs / --size too
    if args.worker:  # one case, in its own process; CUDA OOM is reported in the table
        return worker_main(args.worker, run_case)

    if not args.configs:
        raise SystemExit(
            "give --configs FILE [FILE ...] (the first is the baseline unless --baseline)"
        )
    missing = [c for c in args.configs if not os.path.isfile(c)]
    if missing:
        raise SystemExit(f"config file(s) not found: {missing}")
    repeated = sorted({c for c in args.configs if args.configs.count(c) > 1})
    if repeated:
        raise SystemExit(f"--configs lists {repeated} more than once (ratios need one result each)")
    baseline = args.baseline or args.configs[0]
    if baseline not in args.configs:
        raise SystemExit(f"--baseline {baseline} must be one of --configs")
    if len(args.size) not in (1, 2) or min(args.size) < 32:
        raise SystemExit(f"--size takes S or H W (each >= 32); got {args.size}")
    if args.batch < 1:
        raise SystemExit(f"--batch must be >= 1; got {args.batch}")
    device, amp_dtype = command_device(args.device, args.amp_dtype)
    cuda = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    iters = args.iters if args.iters is not None else (30 if cuda else 5)
    if iters < 1 or warmup < 0:
        raise SystemExit(f"--iters must be >= 1 and --warmup >= 0; got {iters}, {warmup}")
    h, w = args.size[0], args.size[-1]
    amps = {"off": [False], "on": [True], "both": [False, True]}[args.amp]
    opts = list(args.opts) + compile_opts(args)

    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1; got {args.rounds}")
    if args.case_timeout is not None and (args.case_timeout <= 0 or args.interleave):
        raise SystemExit(f"--case-timeout must be > 0 and without --interleave; got {args.case_timeout}")
    if args.in_process and (not cuda or args.interleave or args.case_timeout is not None):
        raise SystemExit("--in-process measures CUDA cases (a CPU peak is the process' own), "
                         "without --interleave and --case-timeout")
    if args.profile and args.interleave:
        raise SystemExit("--profile takes one more call of each phase outside the turns of --interleave, "
                         "where it would run beside the other configs' timed calls: give one of them")
    if args.interleave and args.rounds > 1:
        raise SystemExit("give --interleave or --rounds N, not both (two ways to say how the "
                         "ratio spreads)")

    def make_report(results, partial=False):
        report = {
            "device": str(device),
            "size": [h, w],
            "batch": args.batch,
            "warmup": warmup,
            "iters": iters,
            "rounds": args.rounds,
            "interleave": args.interleave,
            "amp_dtype": amp_dtype if True in amps else None,
            "baseline": baseline,
            "opts": opts,
            "env": environment_info(device),
            # a partial report's peaks are its timed processes' (the memory pass comes last)
            "peak_memory": peak_memory_meaning(device, memory_pass=not partial),
            "results": results,
        }
        return dict(report, partial=True) if partial else report

    rounds = []
    with tempfile.TemporaryDirectory(prefix="aadet_bench_") as tmp:
        batch_file = os.path.join(tmp, "batch.pt")
        torch.save(make_batch(args.batch, h, w, args.seed), batch_file)
        for i in range(args.rounds):
            results, round_specs = [], []
            for amp in amps:
                specs = [
                    dict(
                        config=config,
                        device=str(device),
                        amp=amp,
                        amp_dtype=amp_dtype,
                        opts=opts,
                        seed=args.seed,
                        warmup=warmup,
                        iters=iters,
                        batch_file=batch_file,
                        threads=args.threads,
                        no_train=args.no_train,
                        no_inference=args.no_inference,
                        profile=args.profile,
                    )
                    for config in args.configs
                ]
                round_specs += specs
                tag = f" amp={amp_dtype if amp else 'off'}" + (
                    f" (round {i + 1}/{args.rounds})" if args.rounds > 1 else "")
                if args.interleave:
                    print(f"[benchmark] {len(specs)} configs interleaved{tag} ...", file=sys.stderr, flush=True)
                    phases = (not args.no_train) + (not args.no_inference)
                    rs = run_interleaved(__file__, specs, tmp, calls=phases * (warmup + iters))
                    results += [named_case(r, spec) for spec, r in zip(specs, rs)]
                else:
                    for spec in specs:
                        print(f"[benchmark] {spec['config']}{tag} ...", file=sys.stderr, flush=True)
                        start = time.monotonic()
                        if args.in_process:
                            r = named_case(run_case_here(spec), spec)
                        else:
                            r = named_case(run_case_in_subprocess(__file__, spec, tmp, timeout=args.case_timeout), spec)
                        results.append(r)
                        print(f"[benchmark]   {describe_case(r, time.monotonic() - start)}",
                              file=sys.stderr, flush=True)
                        if args.output_json and args.rounds == 1:
                            # the cases so far, so a run cut off (a time limit) keeps them
                            write_json(args.output_json, make_report(add_ratios(list(results), baseline), partial=True))
            rounds.append(add_ratios(results, baseline))
        results = merge_rounds(rounds, combine_case)
        if device.type == "cpu":  # the peaks from a memory pass (aadet/benchmark/timing.py)
            print(f"[benchmark] memory pass: {len(round_specs)} cases ...", file=sys.stderr, flush=True)
            results = memory_pass(__file__, results, round_specs, tmp, timeout=args.case_timeout,
                                  run=run_case_in_subprocess)
    results = add_ratios(results, baseline)
    if args.interleave:
        add_paired_spread(results, baseline)
    report = make_report(results)
    return write_report(report, render_model_table(report), args.output_json, args.output_md)


def named_case(result: dict, spec: dict) -> dict:
    """A case's result, named by its spec where it failed (a failure carries only its error; the
    report lists every case by config and precision)."""
    if "error" in result:
        result.update(config=spec["config"], amp=spec["amp"], amp_dtype=spec["amp_dtype"])
    return result


def describe_case(result: dict, seconds: float) -> str:
    """One progress line for a finished case: its wall time and where it went."""
    if "error" in result:
        return f"failed after {seconds:.0f} s: {result['error']}"
    parts = [f"build {result['build_s']:.0f} s"] + [
        f"{phase} {result[phase]['wall_s']:.0f} s (median {result[phase]['median_s'] * 1e3:.0f} ms)"
        for phase in ("inference", "train") if phase in result]
    return f"done in {seconds:.0f} s: " + ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
