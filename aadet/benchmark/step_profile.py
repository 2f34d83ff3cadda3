"""Where one call (a training step) spends its device time: one call under ``torch.profiler``,
summed by operator and by kind of work. ``tools/benchmark.py --profile`` records it for every
case, so a speed ratio comes with what bounds it.

:func:`profile_call` returns (times in milliseconds)::

    {"device": "cuda",
     "profiled_ms": 61.0,       # wall time of the profiled call (the profiler's overhead included)
     "device_ms": 48.2,         # the operators' self time on the device, summed
     "device_events": 1830,     # kernels and copies run on the device (None on a CPU)
     "categories": {"attention": 12.1, "conv": 20.3, ..., "unattributed": 0.1},  # device_ms by kind
     "top": [{"op": "aten::cudnn_convolution", "ms": 9.1, "calls": 53, "category": "conv"}, ...],
     "host_syncs": {"aten::_local_scalar_dense": 12, "cudaStreamSynchronize": 14},  # SYNC_OPS called
     "host_ops": 3202}          # operators the host dispatched (profile_call only)

"Device" is the GPU on CUDA and the CPU on a CPU. On CUDA ``device_ms`` is the time of the
kernels, copies and memsets themselves (the profile's device events), and each operator's share
its self CUDA time (the kernels it launched itself, not those of the operators it called); device
time no operator claims is ``"unattributed"``. On a CPU both are the operators' self CPU time.
Set beside the step's timed median (which ran without the profiler), ``device_ms`` says how busy the GPU was:
far below the median, the step waits on the host (Python, launches), not on the kernels; the
host's waits for the device (``host_syncs``: ``.item()``, ``nonzero``, synchronizing copies) each
stop it from queueing work ahead. ``host_ops`` counts the operators the host dispatched (ATen
operators not called by another: those autograd, Python and the launches cost host time for),
which is what such a step's time follows.

An autograd ``Function`` of aadet's routes (``_TritonLocalAttention``, ``_RowColAttention``,
``_HaloBmm``, ...) is an operator of its own name in forward and ``<name>Backward`` in backward;
Triton kernels launched inside it are its self time.
"""
import time
from typing import Callable, Dict, List

import torch

__all__ = [
    "CATEGORIES", "SYNC_OPS", "UNATTRIBUTED", "add_profile_argument", "category_of", "count_host_ops",
    "profile_call", "summarize_events",
]

#: Kinds of work, in the order an operator's name is matched (case-insensitive substrings; the
#: first that matches names its category; none: ``"other"``, elementwise ops, reductions, the
#: optimizer's): attention (SDPA's kernels, flex, aadet's attention Functions), convolutions,
#: matrix products, norms, and the copies and layout changes around them.
CATEGORIES = (
    ("attention", ("attention", "halo", "stemcpp", "flex")),
    ("conv", ("conv",)),
    ("matmul", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                "aten::einsum", "gemm")),
    ("norm", ("norm",)),
    ("copy", ("copy", "aten::cat", "contiguous", "clone", "pad", "gather", "scatter", "index", "unfold",
              "im2col", "col2im", "aten::stack", "aten::fill_", "aten::zero_")),
)
OTHER = "other"
#: Device time of kernels no operator launched (on CUDA; 0 on a CPU).
UNATTRIBUTED = "unattributed"
#: Operators and CUDA runtime calls that make the host wait for the device: ``.item()`` /
#: ``bool(tensor)`` (``_local_scalar_dense``, inside ``aten::item``), ``nonzero`` (its output
#: size), synchronizing copies and explicit synchronizations.
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def category_of(op: str) -> str:
    """The :data:`CATEGORIES` name of an operator's name, or ``"other"``."""
    name = op.lower()
    for category, patterns in CATEGORIES:
        if any(p.lower() in name for p in patterns):
            return category
    return OTHER


def _self_ms(event, on_device: bool) -> float:
    if not on_device:
        return event.self_cpu_time_total / 1e3
    us = getattr(event, "self_device_time_total", None)
    if us is None:  # older torch
        us = getattr(event, "self_cuda_time_total", 0)
    return us / 1e3


def profile_call(fn: Callable[[], object], device="cpu", top: int = 15) -> Dict[str, object]:
    """One call of ``fn`` under ``torch.profiler`` on ``device`` (see the module docstring for the
    result). Run it after warm-up calls: a first call's compiling and autotuning would be in it."""
    device = torch.device(device)
    on_device = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if on_device:
            torch.cuda.synchronize(device)
    profiled_ms = 1e3 * (time.perf_counter() - start)
    return dict(summarize_events(prof.key_averages(), on_device, top), device=device.type,
                profiled_ms=round(profiled_ms, 3), host_ops=count_host_ops(prof.events()))


def count_host_ops(events) -> int:
    """The ATen operators among a profile's ``events()`` that no other ATen operator called: one
    per operator the host dispatched (a composite one's own calls are not counted again)."""

    def top_level(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in events if e.name.startswith("aten::") and top_level(e))


def summarize_events(events, on_device: bool, top: int = 15) -> Dict[str, object]:
    """:func:`profile_call`'s result (less ``device`` and ``profiled_ms``) from a profile's
    ``key_averages()``: rows of operators (``device_type`` CPU) and, on CUDA, of the device's own
    events (kernels, copies), each carrying the same time once: the device time is summed over the
    latter, the kinds of work over the former."""
    cpu = torch.autograd.DeviceType.CPU
    ops: List[dict] = []
    syncs: Dict[str, int] = {}
    device_ms, device_events = 0.0, 0
    for e in events:
        if e.key in SYNC_OPS:
            syncs[e.key] = syncs.get(e.key, 0) + e.count
        if on_device and getattr(e, "device_type", cpu) != cpu:  # a kernel, copy or memset itself
            device_ms += _self_ms(e, True)
            device_events += e.count
            continue
        ms = _self_ms(e, on_device)
        if ms > 0:
            ops.append({"op": e.key, "ms": ms, "calls": e.count, "category": category_of(e.key)})
    ops.sort(key=lambda r: -r["ms"])
    categories = {name: 0.0 for name, _ in CATEGORIES}
    categories[OTHER] = categories[UNATTRIBUTED] = 0.0
    for r in ops:
        categories[r["category"]] += r["ms"]
    attributed = sum(r["ms"] for r in ops)
    if on_device:
        categories[UNATTRIBUTED] = max(0.0, device_ms - attributed)
    else:
        device_ms = attributed
    return {
        "device_ms": round(device_ms, 3),
        "device_events": device_events if on_device else None,
        "categories": {k: round(v, 3) for k, v in categories.items()},
        "top": [dict(r, ms=round(r["ms"], 3)) for r in ops[:top]],
        "host_syncs": syncs,
    }


def add_profile_argument(parser, timed: str) -> None:
    """A benchmark's ``--profile`` flag; ``timed``: what it times (``"each phase"``, ``"each
    case"``), for the help."""
    parser.add_argument(
        "--profile", action="store_true",
        help=f"after the timed calls of {timed}, one more under torch.profiler: its device time by "
             "operator and kind of work (aadet/benchmark/step_profile.py), in the JSON",
    )
