#!/usr/bin/env python
"""Training and inference speed and memory of aadet configs, as ratios to the conv baseline.

    # CPU (small sizes): the demo models, the first config is the baseline
    OMP_NUM_THREADS=1 python tools/benchmark.py --configs configs/Demo/trees_R_50_slim_FPN.yaml \\
        configs/Demo/trees_AA_R_50_slim_FPN.yaml configs/Demo/trees_SASA_R_26_slim_FPN.yaml \\
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
  the config's model); median over ``--iters`` after ``--warmup``; images/s = batch / median;
* **inference latency**: ``model.eval()`` forward of the batch under ``torch.no_grad()``,
  post-processing included; median per batch and per image;
* **peak memory** of each phase: CUDA ``max_memory_allocated``; CPU the process' resident-set
  high-water mark (see ``aadet/analysis/timing.py``), both absolute and above the state before
  the phase (weights and inputs already resident): the ratios use the latter;
* each as a **ratio to the baseline** (``--baseline``, default the first config) of the same run
  and AMP mode.

Each (config, AMP) case runs in a fresh process, so one model's allocator state cannot inflate
another's peak. AMP: float16 autocast with a GradScaler on CUDA (Detectron2's AMPTrainer),
bfloat16 autocast on CPU. On CPU the process CPU time per iteration is recorded next to wall
time: on a shared machine it is the steadier number (with ``OMP_NUM_THREADS=1`` it is the
compute time). Writes JSON (``--output-json``) and a markdown table (``--output-md``, or
stdout).
"""

import argparse
import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings(
    "ignore", category=FutureWarning
)  # torch.jit deprecation (detectron2, fvcore)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from aadet.analysis.timing import (  # noqa: E402
    PeakMemory,
    environment_info,
    markdown_table,
    run_case_in_subprocess,
    time_fn,
    write_report,
)

BOXES_PER_IMAGE = 8
NUM_CLASS_IDS = 1000  # class ids are drawn in [0, 1000) and taken modulo each model's NUM_CLASSES


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
        help="autocast: fp16 + GradScaler on CUDA, bf16 on CPU (default off)",
    )
    p.add_argument("--no-train", action="store_true", help="skip the training measurement")
    p.add_argument("--no-inference", action="store_true", help="skip the inference measurement")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every case")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic batch and the weights"
    )
    p.add_argument("--output-json", metavar="FILE", help="write all results as JSON")
    p.add_argument(
        "--output-md", metavar="FILE", help="write the markdown table here (default: stdout)"
    )
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)  # internal: one case
    p.add_argument(
        "opts",
        nargs=argparse.REMAINDER,
        default=[],
        help="config overrides KEY VALUE ..., applied to every config",
    )
    return p


# ----------------------------------------------------------------------------- synthetic batch
def make_batch(batch: int, height: int, width: int, seed: int):
    """``batch`` random BGR images ``[3, H, W]`` (float, 0-255) with ``BOXES_PER_IMAGE`` random
    boxes each (16 px to half the image side) and class ids in ``[0, NUM_CLASS_IDS)``."""
    g = torch.Generator().manual_seed(seed)
    images, boxes, classes = [], [], []
    for _ in range(batch):
        images.append(torch.randint(0, 256, (3, height, width), generator=g).float())
        hi = max(17, min(height, width) // 2)
        wh = torch.randint(16, hi, (BOXES_PER_IMAGE, 2), generator=g).float()
        x0 = torch.rand(BOXES_PER_IMAGE, generator=g) * (width - wh[:, 0])
        y0 = torch.rand(BOXES_PER_IMAGE, generator=g) * (height - wh[:, 1])
        boxes.append(torch.stack([x0, y0, x0 + wh[:, 0], y0 + wh[:, 1]], dim=1))
        classes.append(torch.randint(0, NUM_CLASS_IDS, (BOXES_PER_IMAGE,), generator=g))
    return {"images": images, "boxes": boxes, "classes": classes, "height": height, "width": width}


def _detectron2_inputs(data, num_classes: int, with_instances: bool):
    from detectron2.structures import Boxes, Instances

    out = []
    for img, b, c in zip(data["images"], data["boxes"], data["classes"]):
        d = {"image": img, "height": data["height"], "width": data["width"]}
        if with_instances:
            inst = Instances((data["height"], data["width"]))
            inst.gt_boxes = Boxes(b.clone())
            inst.gt_classes = c % num_classes
            d["instances"] = inst
        out.append(d)
    return out


# ----------------------------------------------------------------------------- one case
def run_case(spec: dict) -> dict:
    """Build one config's model and measure it (runs inside the worker process)."""
    from detectron2.modeling import build_model
    from detectron2.utils.events import EventStorage

    import aadet  # noqa: F401
    from aadet.analysis.params import count_parameters
    from aadet.engine.defaults import load_config

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    cfg = load_config(spec["config"], ["MODEL.DEVICE", str(device), *spec["opts"]])
    torch.manual_seed(spec["seed"])
    model = build_model(cfg).to(device)
    data = torch.load(spec["batch_file"])
    num_classes = cfg.MODEL.RETINANET.NUM_CLASSES
    amp = spec["amp"]
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    autocast = lambda: torch.autocast(device.type, dtype=amp_dtype, enabled=amp)  # noqa: E731
    result = {
        "config": spec["config"],
        "amp": amp,
        "params": count_parameters(model),
        "env": environment_info(device),
    }

    if not spec["no_inference"]:
        inputs = _detectron2_inputs(data, num_classes, with_instances=False)
        model.eval()

        def infer():
            with torch.no_grad(), autocast():
                model(inputs)

        with PeakMemory(device) as mem:
            t = time_fn(infer, warmup=spec["warmup"], iters=spec["iters"], device=device)
        result["inference"] = dict(
            t,
            peak_bytes=mem.peak_bytes,
            peak_abs_bytes=mem.peak_abs_bytes,
            peak_exact=mem.exact,
            per_image_s=t["median_s"] / len(inputs),
        )

    if not spec["no_train"]:
        inputs = _detectron2_inputs(data, num_classes, with_instances=True)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, weight_decay=1e-4)
        scaler = torch.amp.GradScaler("cuda", enabled=amp and device.type == "cuda")

        def step():
            with autocast():
                losses = model(inputs)
            loss = sum(losses.values())
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        with EventStorage(0), PeakMemory(device) as mem:  # RetinaNet's losses log to a storage
            t = time_fn(step, warmup=spec["warmup"], iters=spec["iters"], device=device)
        result["train"] = dict(
            t,
            peak_bytes=mem.peak_bytes,
            peak_abs_bytes=mem.peak_abs_bytes,
            peak_exact=mem.exact,
            images_per_s=len(inputs) / t["median_s"],
        )
    return result


# ----------------------------------------------------------------------------- report
def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def add_ratios(results, baseline: str):
    """``ratios`` per result: to the baseline config's result with the same AMP mode."""
    base = {(r["config"], r["amp"]): r for r in results if "error" not in r}
    for r in results:
        if "error" in r:
            continue
        b = base.get((baseline, r["amp"]))
        if b is None:
            continue
        rt = {}
        if "train" in r and "train" in b:
            rt["train_time"] = _ratio(r["train"]["median_s"], b["train"]["median_s"])
            rt["train_cpu_time"] = _ratio(r["train"]["cpu_median_s"], b["train"]["cpu_median_s"])
            rt["images_per_s"] = _ratio(r["train"]["images_per_s"], b["train"]["images_per_s"])
            rt["train_peak_mem"] = _ratio(r["train"]["peak_bytes"], b["train"]["peak_bytes"])
        if "inference" in r and "inference" in b:
            rt["inference_time"] = _ratio(r["inference"]["median_s"], b["inference"]["median_s"])
            rt["inference_cpu_time"] = _ratio(
                r["inference"]["cpu_median_s"], b["inference"]["cpu_median_s"]
            )
            rt["inference_peak_mem"] = _ratio(
                r["inference"]["peak_bytes"], b["inference"]["peak_bytes"]
            )
        r["ratios"] = rt
    return results


def _f(x, fmt):
    return "–" if x is None else format(x, fmt)


def render_markdown(report: dict) -> str:
    """The results as a markdown table (times in ms, memory in MiB, ratios to the baseline)."""
    cpu = report["device"].startswith("cpu")
    headers = [
        "Config",
        "AMP",
        "Params (M)",
        "Train ms/iter",
        "× base",
        "img/s",
        "Train peak MiB",
        "× base",
        "Infer ms/batch",
        "× base",
        "Infer peak MiB",
        "× base",
    ]
    if cpu:  # process CPU time: steadier than wall time on a shared machine
        headers[5:5] = ["Train CPU ms", "× base"]
        headers += ["Infer CPU ms", "× base"]
    rows = []
    for r in report["results"]:
        name = os.path.splitext(os.path.basename(r["config"]))[0]
        if "error" in r:
            rows.append(
                [f"`{name}`", "on" if r["amp"] else "off", "error: " + r["error"][:80]]
                + [""] * (len(headers) - 3)
            )
            continue
        tr, inf, rt = r.get("train", {}), r.get("inference", {}), r.get("ratios", {})
        row = [
            f"`{name}`",
            "on" if r["amp"] else "off",
            f"{r['params'] / 1e6:.2f}",
            _f(tr.get("median_s") and 1e3 * tr["median_s"], ".1f"),
            _f(rt.get("train_time"), ".2f"),
            _f(tr.get("images_per_s"), ".2f"),
            _f(tr.get("peak_bytes") and tr["peak_bytes"] / 2**20, ".0f"),
            _f(rt.get("train_peak_mem"), ".2f"),
            _f(inf.get("median_s") and 1e3 * inf["median_s"], ".1f"),
            _f(rt.get("inference_time"), ".2f"),
            _f(inf.get("peak_bytes") and inf["peak_bytes"] / 2**20, ".0f"),
            _f(rt.get("inference_peak_mem"), ".2f"),
        ]
        if cpu:
            row[5:5] = [
                _f(tr.get("cpu_median_s") and 1e3 * tr["cpu_median_s"], ".1f"),
                _f(rt.get("train_cpu_time"), ".2f"),
            ]
            row += [
                _f(inf.get("cpu_median_s") and 1e3 * inf["cpu_median_s"], ".1f"),
                _f(rt.get("inference_cpu_time"), ".2f"),
            ]
        rows.append(row)
    env = report["env"]
    head = (
        f"Device: {env['device_name']} ({report['device']}), torch {env['torch']}, "
        f"{env['torch_threads']} thread(s); input {report['size'][0]}x{report['size'][1]}, batch "
        f"{report['batch']}, median of {report['iters']} iterations after {report['warmup']} warm-up; "
        f"baseline `{os.path.splitext(os.path.basename(report['baseline']))[0]}`. Peak memory: "
        f"{'CUDA max allocated' if not cpu else 'process RSS high-water mark'} above the state "
        f"before the phase.\n\n"
    )
    return head + markdown_table(headers, rows, align="ll" + "r" * (len(headers) - 2))


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            spec = json.load(f)
        try:
            out = run_case(spec)
        except Exception as e:  # reported in the table; the run goes on with the other configs
            if spec["device"].startswith("cuda") and isinstance(e, torch.cuda.OutOfMemoryError):
                out = {
                    "config": spec["config"],
                    "amp": spec["amp"],
                    "error": f"CUDA out of memory: {e}"[:500],
                }
            else:
                raise
        print(json.dumps(out))
        return 0

    if not args.configs:
        raise SystemExit(
            "give --configs FILE [FILE ...] (the first is the baseline unless --baseline)"
        )
    missing = [c for c in args.configs if not os.path.isfile(c)]
    if missing:
        raise SystemExit(f"config file(s) not found: {missing}")
    baseline = args.baseline or args.configs[0]
    if baseline not in args.configs:
        raise SystemExit(f"--baseline {baseline} must be one of --configs")
    if len(args.size) not in (1, 2) or min(args.size) < 32:
        raise SystemExit(f"--size takes S or H W (each >= 32); got {args.size}")
    if args.batch < 1:
        raise SystemExit(f"--batch must be >= 1; got {args.batch}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    cuda = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    iters = args.iters if args.iters is not None else (30 if cuda else 5)
    if iters < 1 or warmup < 0:
        raise SystemExit(f"--iters must be >= 1 and --warmup >= 0; got {iters}, {warmup}")
    h, w = args.size[0], args.size[-1]
    amps = {"off": [False], "on": [True], "both": [False, True]}[args.amp]

    results = []
    with tempfile.TemporaryDirectory(prefix="aadet_bench_") as tmp:
        batch_file = os.path.join(tmp, "batch.pt")
        torch.save(make_batch(args.batch, h, w, args.seed), batch_file)
        for amp in amps:
            for config in args.configs:
                spec = dict(
                    config=config,
                    device=str(device),
                    amp=amp,
                    opts=list(args.opts),
                    seed=args.seed,
                    warmup=warmup,
                    iters=iters,
                    batch_file=batch_file,
                    threads=args.threads,
                    no_train=args.no_train,
                    no_inference=args.no_inference,
                )
                print(
                    f"[benchmark] {config} amp={'on' if amp else 'off'} ...",
                    file=sys.stderr,
                    flush=True,
                )
                r = run_case_in_subprocess(__file__, spec, tmp)
                if "error" in r:
                    r.update(config=config, amp=amp)
                results.append(r)
    add_ratios(results, baseline)
    report = {
        "device": str(device),
        "size": [h, w],
        "batch": args.batch,
        "warmup": warmup,
        "iters": iters,
        "baseline": baseline,
        "opts": list(args.opts),
        "env": environment_info(device),
        "results": results,
    }
    return write_report(report, render_markdown(report), args.output_json, args.output_md)


if __name__ == "__main__":
    sys.exit(main())
