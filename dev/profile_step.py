#!/usr/bin/env python
"""Where one training step of a model spends its time: the figures behind BENCHMARKS.md's
"what bounds the misses", from one command.

    OMP_NUM_THREADS=1 python dev/profile_step.py --configs configs/Demo/trees_R_26_slim_FPN.yaml \\
        configs/Demo/trees_AA_R_26_slim_FPN.yaml configs/Demo/trees_SASA_R_26_slim_FPN.yaml \\
        configs/Demo/trees_SASA_full_attention_R_26_slim.yaml configs/Demo/trees_Halo_R_26_slim_FPN.yaml \\
        --output-json docs/runs/benchmarks/profile_demo_cpu.json

For each config, on the synthetic batch of ``tools/benchmark.py`` (same size, batch and seed
defaults as its demo run: 400x400, batch 2) and the same training step (forward with losses,
backward, SGD step: ``aadet/benchmark/training_step.py``), after ``--warmup`` steps:

* ``step_ms``: the median wall time of ``--iters`` steps;
* ``forward_ms``: one step's forward time per part, by module hooks: each stage of the backbone's
  bottom-up network (stem, res2-res5), the rest of the backbone (FPN, P6/P7) and the head;
  ``losses_backward_and_step_ms`` is the rest of that step (anchor matching and losses,
  backward, SGD step);
* ``ops``: one step under ``torch.profiler``, the ``--top`` operators by self CPU time. An
  autograd Function (the C++ attention kernels: ``_CppLocalAttention``, ``_CppRowColAttention``)
  shows as its name in forward and ``<name>Backward`` in backward.

Configs run one after the other in this process (a profile, not a ratio target: those are
``dev/benchmark_cpu.py``'s). Run it on an otherwise idle machine.
"""
import argparse
import os
import shlex
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.jit deprecation (detectron2, fvcore)

import torch  # noqa: E402

from aadet.benchmark.report import write_json  # noqa: E402
from aadet.utils.collect_env import git_commit, machine_description  # noqa: E402
from aadet.benchmark.synthetic_batch import detectron2_inputs, make_batch  # noqa: E402
from aadet.benchmark.timing import measure  # noqa: E402
from aadet.benchmark.training_step import TrainingStep  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parts(model):
    """``{name: module}``: the bottom-up stages, the whole backbone and the head."""
    backbone = model.backbone
    bottom_up = getattr(backbone, "bottom_up", None)
    parts = {}
    if bottom_up is not None:
        parts.update({f"backbone.bottom_up.{n}": m for n, m in bottom_up.named_children()})
        parts["backbone.bottom_up"] = bottom_up
    parts["backbone"] = backbone
    parts["head"] = model.head
    return parts


class _ForwardTimer:
    """Forward wall time of modules, by pre- and post-forward hooks (seconds, summed over calls)."""

    def __init__(self, modules):
        self.seconds = {n: 0.0 for n in modules}
        self._start = {}
        self._handles = []
        for name, m in modules.items():
            self._handles.append(m.register_forward_pre_hook(self._pre(name)))
            self._handles.append(m.register_forward_hook(self._post(name)))

    def _pre(self, name):
        def hook(module, inputs):
            self._start[name] = time.perf_counter()
        return hook

    def _post(self, name):
        def hook(module, inputs, output):
            self.seconds[name] += time.perf_counter() - self._start.pop(name)
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def profile_config(config, opts, data, *, warmup, iters, top, seed):
    from detectron2.modeling import build_model

    import aadet  # noqa: F401
    from aadet.engine.defaults import load_config

    cfg = load_config(config, ["MODEL.DEVICE", "cpu", *opts])
    torch.manual_seed(seed)
    model = build_model(cfg)
    step = TrainingStep(model, detectron2_inputs(data, cfg.MODEL.RETINANET.NUM_CLASSES, with_instances=True))
    timing = measure(step, warmup=warmup, iters=iters)
    timer = _ForwardTimer(_parts(model))
    t0 = time.perf_counter()
    step()
    total = time.perf_counter() - t0
    timer.remove()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    fwd = timer.seconds
    forward_ms = {n: round(s * 1e3, 1) for n, s in fwd.items() if not n.endswith(("bottom_up", "backbone"))}
    if "backbone.bottom_up" in fwd:
        forward_ms["backbone without bottom_up (FPN, P6/P7)"] = round(
            (fwd["backbone"] - fwd["backbone.bottom_up"]) * 1e3, 1)
    forward_total = fwd["backbone"] + fwd["head"]
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "config": os.path.relpath(os.path.abspath(config), REPO),
        "step_ms": round(timing["median_s"] * 1e3, 1),
        "profiled_step_ms": round(total * 1e3, 1),
        "forward_ms": forward_ms,
        "forward_backbone_and_head_ms": round(forward_total * 1e3, 1),
        "losses_backward_and_step_ms": round((total - forward_total) * 1e3, 1),
        "ops_self_cpu_total_ms": round(sum(e.self_cpu_time_total for e in events) / 1e3, 1),
        "ops": [{"name": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1)}
                for e in events[:top]],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", required=True, metavar="FILE")
    p.add_argument("--size", type=int, default=400, help="square input side (default 400)")
    p.add_argument("--batch", type=int, default=2, help="images per step (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="timed steps for step_ms (default 3)")
    p.add_argument("--top", type=int, default=25, help="operators listed per config (default 25)")
    p.add_argument("--seed", type=int, default=0, help="of the synthetic batch and the weights")
    p.add_argument("--output-json", metavar="FILE")
    p.add_argument("opts", nargs=argparse.REMAINDER, default=[], help="config overrides for every config")
    args = p.parse_args(argv)
    for c in args.configs:
        if not os.path.isfile(c):
            p.error(f"config file not found: {c}")
    if args.size < 32 or args.batch < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--size >= 32, --batch >= 1, --iters >= 1 and --warmup >= 0")
    torch.set_num_threads(args.threads)
    data = make_batch(args.batch, args.size, args.size, args.seed)
    checkout = git_commit(REPO)  # the code measured, before the report changes the tree
    results = []
    for config in args.configs:
        r = profile_config(config, args.opts, data, warmup=args.warmup, iters=args.iters,
                           top=args.top, seed=args.seed)
        print(f"{r['config']}: step {r['step_ms']} ms; forward {r['forward_ms']}", flush=True)
        results.append(r)
    report = {
        "command": " ".join(shlex.quote(a) for a in ["python", "dev/profile_step.py", *(argv or sys.argv[1:])]),
        "size": args.size,
        "batch": args.batch,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": machine_description(),
        **checkout,
        "results": results,
    }
    if args.output_json:
        write_json(args.output_json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
