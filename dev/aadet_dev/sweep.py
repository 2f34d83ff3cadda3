"""The production-shape sweep: every attention layer of the configs at the configs' own size, each
CUDA route of its family and the 3x3 convolution it stands beside, forward + backward in float32
and under bf16 and fp16 autocast. One JSON row per (layer shape, route, precision): whether the
output and every gradient are finite, the agreement with the float64 brute force of
:mod:`aadet.layers.functional.reference` on a sample of query pixels, time and peak memory.

* Shapes (:func:`collect_layers`): each config is built and run forward once at its size (its
  test size, ``INPUT.MAX_SIZE_TEST`` square: 640 for COCO) with hooks on its attention layers;
  a layer's shape is its type, its settings (``extra_repr``) and its input ``[C, H, W]``; the
  sweep's batch is the configs' training batch a device (``--batch``, 8). Layers of the same
  shape are measured once, under every config that has them.
* Routes (:func:`routes_of`): the routes of the layer's registry that run on CUDA
  (``Route.cuda``); the stem's :data:`~aadet.layers.attention_stem.STEM_ROUTES` but its C++
  kernel; and ``"conv3x3"``, a 3x3 convolution from the layer's input to its output shape (the
  layer it stands in for, the yardstick of time and memory).
* Agreement (:class:`Capture`): during the measured forward, the arguments and the output of the
  layer's functional core are kept for image 0; :func:`reference_error` runs the brute force on
  :data:`SAMPLE_QUERIES` query pixels of it in float64 and gives ``||out - ref|| / ||ref||``,
  held to :data:`TOLERANCE` of the precision (CCNet's block as built: its ``gamma`` is 0, so its
  output is its input and the attention's gradients are zero; the core's output is checked). The
  stem's core has no functional front end: its
  reference is the same layer in float64 on the CPU (the ``projected`` route, which the CPU tests
  hold to its brute force).
* Bisection (:func:`bisect_sdpa`): a case that is not finite or not within tolerance is run again
  under each SDPA backend alone (``torch.nn.attention.sdpa_kernel``); the row names the backends
  under which it fails (routes that call no SDPA fail or pass alike under all of them).

:func:`run_sweep` takes the cases in order, appends each row to a JSON-lines file as soon as it is
measured (a run cut at its budget keeps what it finished; a second run skips the rows it finds)
and stops before a case that would not fit the budget's rest.
"""
import contextlib
import copy
import json
import math
import os
import re
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from aadet.layers import attention_stem as stem_module
from aadet.layers import augmented_conv as aa_module
from aadet.layers import criss_cross as cc_module
from aadet.layers import halo_attention as halo_module
from aadet.layers import local_attention as sasa_module
from aadet.layers.functional import (
    CRISS_CROSS_BACKENDS,
    HALO_ATTENTION_BACKENDS,
    LOCAL_ATTENTION_BACKENDS,
    LOGIT_TABLE_BACKENDS,
    reference,
)

__all__ = [
    "PRECISIONS",
    "TOLERANCE",
    "SAMPLE_QUERIES",
    "LayerShape",
    "ReferenceCache",
    "collect_layers",
    "routes_of",
    "plan_cases",
    "Capture",
    "reference_error",
    "run_case",
    "bisect_sdpa",
    "run_sweep",
]

#: The precisions of a case: float32, and autocast to bf16 and to fp16 (parameters in float32).
PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: ``||out - ref|| / ||ref||`` a route may reach on the sample, by precision: float32 with TF32
#: matrix products (10 mantissa bits) in some kernels, fp16 (10 bits) and bf16 (7 bits) operands;
#: a route wrong at a border, a block or a head is off by O(1). tests/layers/test_cuda.py holds
#: the layers to the same limits at the tests' small shapes.
TOLERANCE = {"fp32": 2e-3, "fp16": 5e-3, "bf16": 2e-2}
#: Query pixels of image 0 that the brute force checks, every head.
SAMPLE_QUERIES = 128
CONV = "conv3x3"

#: Layer type -> (family, registry of its routes or None, the module that calls the functional core,
#: the name of that core in the module). The stem calls no registered front end.
FAMILIES = {
    aa_module.AugmentedConv2d: ("aa", LOGIT_TABLE_BACKENDS, aa_module, "relative_self_attention_2d_unchecked"),
    sasa_module.LocalSelfAttention2d: ("sasa", LOCAL_ATTENTION_BACKENDS, sasa_module,
                                       "local_self_attention_2d_unchecked"),
    halo_module.HaloSelfAttention2d: ("halonet", HALO_ATTENTION_BACKENDS, halo_module, "halo_attention_2d_unchecked"),
    cc_module.CrissCrossAttention2d: ("ccnet", CRISS_CROSS_BACKENDS, cc_module, "criss_cross_attention_2d_unchecked"),
    stem_module.SpatiallyAwareAttentionStem: ("stem", None, None, None),
}


class LayerShape(dict):
    """One attention layer shape: ``key`` (its identity), ``family``, ``type``, ``settings``
    (``extra_repr``), ``input`` ``[C, H, W]``, ``output`` ``[C, H, W]``, ``stride``, ``configs``
    (every config that has it, with the layer's name in each) and, not serialized, ``module`` (the
    first such layer, with its weights as built)."""

    def row(self) -> dict:
        return {k: v for k, v in self.items() if k != "module"}


def _entry(module: nn.Module) -> Optional[tuple]:
    """The :data:`FAMILIES` entry of ``module`` (its class or a subclass, e.g. AA's layer with its
    norm), or None."""
    for cls, entry in FAMILIES.items():
        if isinstance(module, cls):
            return entry
    return None


def _family(module: nn.Module) -> Optional[str]:
    entry = _entry(module)
    return entry[0] if entry else None


def collect_layers(configs: Sequence[str], *, size: Optional[int] = None, device="cpu",
                   opts: Sequence[str] = ()) -> List[LayerShape]:
    """Every attention layer shape of ``configs`` (YAML files), in the order first met: each config
    built (seed 0) and run forward once on one ``size x size`` image (default: the config's
    ``INPUT.MAX_SIZE_TEST``) in eval mode with forward hooks on its attention layers."""
    from detectron2.modeling import build_model

    from aadet.engine import load_config

    shapes: Dict[str, LayerShape] = {}
    for config in configs:
        cfg = load_config(config, ["MODEL.DEVICE", str(device), *opts])
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        side = size or cfg.INPUT.MAX_SIZE_TEST
        hooks, seen = [], []
        for name, module in model.named_modules():
            family = _family(module)
            if family is None:
                continue

            def hook(mod, inputs, output, name=name, family=family):
                seen.append((name, family, mod, tuple(inputs[0].shape[1:]), tuple(output.shape[1:])))

            hooks.append(module.register_forward_hook(hook))
        image = torch.rand(3, side, side, device=device) * 255
        with torch.no_grad():
            model([{"image": image, "height": side, "width": side}])
        for h in hooks:
            h.remove()
        for name, family, mod, cin, cout in seen:
            key = f"{type(mod).__name__}({shape_settings(mod)}) {list(cin)}"
            if key not in shapes:
                shapes[key] = LayerShape(
                    key=key, family=family, type=type(mod).__name__, settings=shape_settings(mod),
                    input=list(cin), output=list(cout), stride=_stride(cin, cout), configs=[],
                    module=copy.deepcopy(mod).cpu(),
                )
            where = f"{os.path.splitext(os.path.basename(config))[0]}:{name}"
            if where not in shapes[key]["configs"]:  # a layer called again (CCNet's shared block)
                shapes[key]["configs"].append(where)
        del model
    return list(shapes.values())


#: Settings that do not change what a layer computes at a shape or how fast: the route (the sweep
#: sets it), a bias, the largest map the relative tables are sized for, the recompute mode.
_NOT_SHAPE = re.compile(r",? ?\b(impl|bias|max_size|recompute_attention|clip_distances)=[^,]*")


def shape_settings(module: nn.Module) -> str:
    """The module's ``extra_repr`` less the settings of :data:`_NOT_SHAPE`."""
    return _NOT_SHAPE.sub("", module.extra_repr()).strip(", ")


def _stride(cin: Sequence[int], cout: Sequence[int]) -> int:
    return max(1, round(cin[-1] / cout[-1]))


def routes_of(shape: LayerShape, device: str = "cuda") -> Tuple[str, ...]:
    """The routes a shape is measured with on ``device``, then :data:`CONV`: on CUDA its family's
    routes flagged ``cuda``; elsewhere (a CPU dry run) every route, those that need CUDA or Triton's
    compiler giving rows that say so."""
    registry = _entry(shape["module"])[1]
    if registry is not None:
        routes = tuple(n for n, r in registry.items() if r.cuda or device != "cuda")
    else:  # the stem: its PyTorch routes (the C++ kernel is CPU-only)
        routes = tuple(r for r in stem_module.STEM_ROUTES if r != "cpp" or device != "cuda")
    return routes + (CONV,)


def plan_cases(shapes: Sequence[LayerShape], device: str = "cuda",
               precisions: Sequence[str] = PRECISIONS) -> List[Tuple[int, str, str]]:
    """``(shape index, route, precision)`` of every case: shape by shape in the precisions the
    targets are defined in (:data:`~aadet_dev.gpu_report.PROTOCOL`), then shape by shape in the
    others (fp16), so that a sweep cut at its budget has covered every shape in the first."""
    from .gpu_report import PROTOCOL

    first = [p for p in precisions if p in PROTOCOL.precisions]
    passes = (first, [p for p in precisions if p not in first])
    return [(i, route, p) for ps in passes for i, s in enumerate(shapes) for p in ps
            for route in routes_of(s, device)]


def case_id(shape: LayerShape, route: str, precision: str) -> str:
    return f"{shape['key']} | {route} | {precision}"


# ----------------------------------------------------------------------------- agreement
class Capture:
    """While active, the layer's functional core keeps its arguments and output of image 0 (the
    module-level name the layer calls is wrapped, then restored)."""

    def __init__(self, layer: nn.Module):
        _family_name, _registry, self.module, self.name = _entry(layer)
        self.args = self.out = None

    def __enter__(self):
        if self.module is None:
            return self
        self.original = getattr(self.module, self.name)

        def wrapped(*args, **kwargs):
            out = self.original(*args, **kwargs)
            self.args = [(a[:1] if a.dim() == 5 else a).detach() if torch.is_tensor(a) else a for a in args]
            self.kwargs = kwargs
            self.out = out[:1].detach()
            return out

        setattr(self.module, self.name, wrapped)
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            setattr(self.module, self.name, self.original)


def sample_queries(h: int, w: int, n: int = SAMPLE_QUERIES, seed: int = 0) -> List[Tuple[int, int]]:
    """``n`` query pixels of an ``h x w`` output grid: its four corners (borders are where routes
    go wrong) and the rest drawn at random (fixed seed)."""
    corners = {(0, 0), (0, w - 1), (h - 1, 0), (h - 1, w - 1)}
    g = torch.Generator().manual_seed(seed)
    rest = torch.randperm(h * w, generator=g)[: max(0, n - len(corners))].tolist()
    return sorted(corners | {(i // w, i % w) for i in rest})[:n]


class ReferenceCache:
    """The float64 brute force of the last core arguments seen, reused while they are equal: the
    routes of one shape and precision call the core with the same ``q, k, v`` (the projections
    come before the route), and the brute force on the CPU costs seconds where a case's steps
    cost milliseconds (the sweep at 3a55981 on an H200: 2-6 s of a SASA case's wall time)."""

    def __init__(self):
        self.args = self.ref = None

    def get(self, args, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        tensors = [a for a in args if torch.is_tensor(a)]
        same = self.args is not None and len(tensors) == len(self.args) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(tensors, self.args))
        if not same:
            self.args, self.ref = tensors, compute()
        return self.ref


def reference_error(layer: nn.Module, capture: Capture, cache: Optional[ReferenceCache] = None) -> Optional[float]:
    """``||out - ref|| / ||ref||`` of the captured core output on :func:`sample_queries`, against
    the float64 brute force of :mod:`~aadet.layers.functional.reference` (None where nothing was
    captured; ``cache`` reuses the brute force of equal arguments)."""
    if capture.out is None:
        return None
    a = [x.double().cpu() if torch.is_tensor(x) else x for x in capture.args]
    out = capture.out.double().cpu()  # [1, Nh, Ho, Wo, dv]
    queries = sample_queries(out.shape[2], out.shape[3])
    ref = (cache or ReferenceCache()).get(a, lambda: _brute_force(layer, a, queries))
    got = torch.stack([out[:, :, y, x] for y, x in queries], dim=2)  # [1, Nh, n, dv]
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def _brute_force(layer: nn.Module, a: list, queries) -> torch.Tensor:
    """The float64 reference of ``layer``'s core on the arguments ``a`` at ``queries``."""
    q, k, v = a[:3]
    if isinstance(layer, cc_module.CrissCrossAttention2d):
        return reference.criss_cross_attention_2d_reference(q, k, v, queries=queries)
    rel_h, rel_w = a[3:5]
    if isinstance(layer, aa_module.AugmentedConv2d):
        ref = reference.relative_self_attention_2d_reference(q, k, v, rel_h, rel_w, queries=queries)
    elif isinstance(layer, halo_module.HaloSelfAttention2d):
        block, halo, stride = a[5], a[6], a[7]
        ref = reference.halo_attention_2d_reference(q, k, v, rel_h, rel_w, block, halo, stride, queries=queries)
    else:
        ref = reference.local_self_attention_2d_reference(q, k, v, rel_h, rel_w, a[5], queries=queries)
    return ref


def _stem_reference_error(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> float:
    """The stem against itself in float64 on the CPU (its ``projected`` route), image 0."""
    ref_layer = copy.deepcopy(layer).double().cpu()
    ref_layer.impl = "projected"
    with torch.no_grad():
        ref = ref_layer(x[:1].detach().double().cpu())
    got = out[:1].detach().double().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- one case
def _conv_like(shape: LayerShape) -> nn.Module:
    c_in, c_out = shape["input"][0], shape["output"][0]
    return nn.Conv2d(c_in, c_out, 3, stride=shape["stride"], padding=1)


def _finite(t: Optional[torch.Tensor]) -> bool:
    return t is None or bool(torch.isfinite(t).all())


def run_case(shape: LayerShape, route: str, precision: str, *, batch: int, device="cuda",
             iters: int = 3, warmup: int = 1, check: bool = True, seed: int = 0,
             cache: Optional[ReferenceCache] = None) -> dict:
    """Forward + backward of ``shape``'s layer by ``route`` on a ``[batch, C, H, W]`` input in
    ``precision``: finite output and gradients, the reference error (``check``), median time of
    ``iters`` steps after ``warmup``, and the peak memory above the state before the first step
    (CUDA: ``max_memory_allocated``; elsewhere not measured)."""
    device = torch.device(device)
    torch.manual_seed(seed)
    if route == CONV:
        layer = _conv_like(shape)
    else:
        layer = copy.deepcopy(shape["module"])
        layer.impl = route
        registry = _entry(layer)[1]
        if getattr(layer, "recompute_attention", False) and route not in registry.recomputing():
            layer.recompute_attention = False  # a config's recompute mode, where the route has one
    layer = layer.to(device).train()
    x = torch.randn(batch, *shape["input"], device=device, requires_grad=True)
    dtype = AUTOCAST[precision]
    row = {"case": case_id(shape, route, precision), "key": shape["key"], "family": shape["family"],
           "route": route, "precision": precision, "batch": batch, "input": shape["input"],
           "output": shape["output"]}

    def step(capture=None):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            with capture if capture is not None else contextlib.nullcontext():
                out = layer(x)
        out.float().square().mean().backward()
        return out

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    capture = Capture(layer) if route != CONV and check else None
    out = step(capture)
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    row["finite_output"] = _finite(out)
    row["finite_grads"] = all(_finite(g) for g in grads)
    if check and route != CONV:
        if shape["family"] == "stem":
            row["error"] = _stem_reference_error(layer, x, out)
        else:
            row["error"] = reference_error(layer, capture, cache)
        row["tolerance"] = TOLERANCE[precision]
        err = row["error"]
        row["agrees"] = err is not None and math.isfinite(err) and err <= TOLERANCE[precision]
    for _ in range(max(0, warmup - 1)):
        step()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    row["time_s"] = sorted(times)[len(times) // 2] if times else None
    row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base if cuda else None
    row["ok"] = row["finite_output"] and row["finite_grads"] and row.get("agrees", True)
    return row


#: The SDPA backends a failing case is run under, one at a time (names of ``SDPBackend``).
SDPA_BACKENDS = ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION")


def bisect_sdpa(run: Callable[[], dict], backends: Iterable[str] = SDPA_BACKENDS) -> Dict[str, str]:
    """``{backend: "ok" | "fails" | "unavailable: ..."}``: ``run()`` (a case, returning its row)
    under each SDPA backend alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name in backends:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                row = run()
            out[name] = "ok" if row["ok"] else "fails"
        except RuntimeError as e:  # e.g. "No available kernel" for this input under this backend
            out[name] = f"unavailable: {str(e).splitlines()[0][:120]}"
    return out


# ----------------------------------------------------------------------------- the sweep
def read_rows(path: str) -> List[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_sweep(shapes: Sequence[LayerShape], out_path: str, *, batch: int, device="cuda",
              seconds: float = float("inf"), iters: int = 3, warmup: int = 1,
              precisions: Sequence[str] = PRECISIONS, case_seconds: float = 0.0,
              log=print) -> dict:
    """Every case of :func:`plan_cases` not yet in ``out_path`` (JSON lines), appended as measured,
    until ``seconds`` run out (a case is not started with less than ``case_seconds`` left: the
    slowest one so far, at least the given value). Returns ``{"done", "skipped", "left",
    "failed"}`` counts of this run."""
    done = {r["case"] for r in read_rows(out_path)}
    cases = plan_cases(shapes, device, precisions)
    t0 = time.perf_counter()
    slowest = case_seconds
    counts = {"done": 0, "skipped": 0, "left": 0, "failed": 0}
    cache = ReferenceCache()
    for n, (i, route, precision) in enumerate(cases):
        shape = shapes[i]
        cid = case_id(shape, route, precision)
        if cid in done:
            counts["skipped"] += 1
            continue
        if seconds - (time.perf_counter() - t0) < slowest:
            counts["left"] = sum(1 for j, r, p in cases[n:] if case_id(shapes[j], r, p) not in done)
            log(f"[sweep] budget spent: {counts['left']} cases left for the next run")
            break
        c0 = time.perf_counter()
        try:
            row = run_case(shape, route, precision, batch=batch, device=device, iters=iters, warmup=warmup,
                           cache=cache)
            if not row["ok"] and route != CONV:
                row["sdpa_backends"] = bisect_sdpa(lambda: run_case(
                    shape, route, precision, batch=batch, device=device, iters=0, warmup=0))
        except Exception as e:  # noqa: BLE001 -- an error is a result of the case (OOM, no kernel)
            row = {"case": cid, "key": shape["key"], "family": shape["family"], "route": route,
                   "precision": precision, "batch": batch, "ok": False,
                   "exception": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        finally:
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        row["wall_s"] = round(time.perf_counter() - c0, 2)
        slowest = max(slowest, row["wall_s"])
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        counts["done"] += 1
        counts["failed"] += not row["ok"]
        log(f"[sweep] {n + 1}/{len(cases)} {cid}: "
            + ("ok" if row["ok"] else "FAILED") + f" {row.get('time_s') or 0:.4f} s ({row['wall_s']} s)")
    return counts
