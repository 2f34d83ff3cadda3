#!/usr/bin/env python
"""Layer micro-benchmarks of the AA, SASA and HaloNet attention and of SASA's attention stem,
against straightforward implementations and convolutions.

    OMP_NUM_THREADS=1 python dev/benchmark_layers.py --device cpu --output-json out/layers_cpu.json
    python dev/benchmark_layers.py --device cuda --batch 8 --iters 50 --output-json out/layers_cuda.json

Forward + backward time (median after warm-up) and peak memory (on CPU from a memory pass after
the timed rounds), every case in a fresh process
(timing, memory and AMP helpers: ``aadet/benchmark/timing.py``; ratios, markdown and JSON:
``aadet/benchmark/report.py``; both shared with ``tools/benchmark.py``; the tables:
``dev/aadet_dev/benchmark_tables.py``), at the res3 / res4 / res5
map sizes of a 640x640 image (80, 40, 20). ``--amp`` autocasts to ``--amp-dtype`` (default
float16 on CUDA, bfloat16 on CPU):

* **AA** (``--suite aa``), AA-R50 widths ``Fout = Fin`` = 128 / 256 / 512 at 80 / 40 / 20,
  kappa = 0.2, nu = 0.1, 8 heads, relative logits:

  - ``core``: :func:`aadet.layers.functional.relative_self_attention_2d` on ``q, k, v`` with the
    layer's depths (on CPU the C++ kernel ``cpp``, the CPU default, and the fused SDPA route
    ``fused``, which widens every head by ``H + W``; on CUDA ``auto``, i.e. fused SDPA, Triton
    and flex_attention; ``materialized``: our chunked float32 fallback, 1024 queries a chunk)
    against ``naive``: the full ``[B, Nh, HW, HW]`` logits plus
    the relative logits of the paper's Appendix A.3 (``rel_to_abs``, tiled to ``[HW, HW]``),
    softmax, weighted sum, all stored for backward;
  - ``layer``: one :class:`aadet.layers.AugmentedConv2d` (3x3, stride 1, attention at full
    resolution) with our core (on CPU: ``cpp`` and ``fused``) against the same layer running
    the naive core.

  (In AA-R50 itself res3's attention runs at half resolution, 40x40; the 80x80 case is a
  stress test.) Naive cases whose estimated memory exceeds ``--max-naive-gib`` are
  skipped and say so.

* **SASA** (``--suite sasa``): :class:`aadet.layers.LocalSelfAttention2d` (256 channels, k = 7,
  8 heads, relative; its routes ``impl="cpp"`` -- the C++ kernel, the CPU default --,
  ``cpp-recompute`` -- the same kernel with ``recompute_attention=True``, which recomputes the
  attention weights in backward instead of keeping them --, ``impl="neighborhood"`` -- offset by
  offset -- and ``impl="fused"`` -- blocked with halos through SDPA, the CUDA default) against
  a 3x3 convolution of the same width and against ``unfold``: the
  same attention written with ``F.unfold`` (every pixel's ``k x k`` keys and values copied,
  ``k^2 = 49`` times the map), out-of-map neighbours masked like ours.

* **HaloNet** (``--suite halo``): :class:`aadet.layers.HaloSelfAttention2d` (256 channels, b = 8,
  h = 3, 8 heads, relative; its routes ``cpp`` -- the C++ kernel, the CPU default --, ``bmm``,
  ``materialized`` and ``fused`` on CPU, ``fused`` and ``materialized`` on CUDA) against a 3x3
  convolution of the same width and against the SASA layer of the suite above (k = 7, its
  ``auto`` route) at that width (the target: the halo layer at or below the 3x3 conv).

* **Attention stem** (``--suite stem``): :class:`aadet.layers.SpatiallyAwareAttentionStem` at the
  all-attention demo's training shape (RGB in, 64 out, block 4, 1 head, 4 mixtures, no norm; by
  default batch 8 and a 256x256 input, the demo's training crop; ``--batch`` / ``--sizes``
  override, a size being the input's side) on each of its routes (``impl``: ``factorized``,
  ``projected`` and ``cpp`` -- the fused C++ kernel, what ``auto`` takes on CPU -- on CPU; the
  PyTorch routes ``factorized`` and ``projected`` on CUDA) against ``convstem``: the conv stem it
  replaces, Detectron2's ``BasicStem`` without its norm (7x7/2 conv, ReLU, 3x3/2 max pool, same
  channels and the same ``[B, 64, H/4, W/4]`` output). The input is an image: it needs no
  gradient, as in training. Not in ``--suite all`` (an image input at its own batch and sides).

Before timing, each naive implementation is checked against ours on a small float64 input.
"""

import argparse
import math
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402

from aadet_dev.benchmark_tables import render_layer_tables  # noqa: E402
from aadet.benchmark.report import (  # noqa: E402
    index_results,
    ratios,
    write_report,
)
from aadet.benchmark.step_profile import add_profile_argument, profile_call  # noqa: E402
from aadet.benchmark.timing import (  # noqa: E402
    add_amp_dtype_argument,
    autocast,
    check_amp_dtype,
    command_device,
    environment_info,
    measure,
    peak_memory_meaning,
    combine_rounds,
    merge_rounds,
    memory_pass,
    run_case_in_subprocess,
    worker_main,
)
from aadet.layers.attention_stem import STEM_ROUTES, SpatiallyAwareAttentionStem  # noqa: E402
from aadet.layers.augmented_conv import AugmentedConv2d, attention_depth  # noqa: E402
from aadet.layers.functional.reference import (  # noqa: E402
    local_self_attention_2d_unfold,
    paper_relative_self_attention_2d,
)
from aadet.layers.functional.relative_attention import relative_self_attention_2d  # noqa: E402
from aadet.layers.halo_attention import HaloSelfAttention2d  # noqa: E402
from aadet.layers.local_attention import LocalSelfAttention2d, merge_heads, split_heads  # noqa: E402

#: (map side, Fout) of AA-R50's res3 / res4 / res5 for a 640x640 image.
AA_SIZES = {80: 128, 40: 256, 20: 512}
SASA_CHANNELS = 256
NUM_HEADS = 8
#: The HaloNet suite: width, and HaloNet's block and halo (b = 8, h = 3).
HALO_CHANNELS, HALO_BLOCK, HALO_HALO = 256, 8, 3
#: The attention stem suite: the all-attention demo's stem (RGB -> 64, block 4, 1 head, 4 mixtures)
#: and its training batch and crop (``configs/Demo/trees_SASA_full_attention_R_26_slim.yaml``).
STEM_IN, STEM_OUT, STEM_BLOCK, STEM_HEADS, STEM_MIXTURES = 3, 64, 4, 1, 4
STEM_BATCH, STEM_SIZES = 8, (256,)
#: The stem's routes timed: every ``impl`` but ``"auto"`` on CPU; on CUDA the PyTorch ones (the C++
#: kernel is CPU-only).
STEM_CUDA_ROUTES = tuple(impl for impl in STEM_ROUTES if impl != "cpp")


# ----------------------------------------------------------------------------- naive references
def naive_relative_attention_2d(q, k, v, rel_h=None, rel_w=None, **_ignored):
    """The straightforward AA attention (paper Figure 8): full logits, relative logits tiled to
    ``[B, Nh, HW, HW]``, softmax, weighted sum
    (:func:`aadet.layers.functional.reference.paper_relative_self_attention_2d`). Same
    signature/shapes as :func:`relative_self_attention_2d` (``q`` already scaled)."""
    return paper_relative_self_attention_2d(q, k, v, rel_h, rel_w)


def naive_unfold_local_attention(layer: LocalSelfAttention2d, x):
    """:class:`LocalSelfAttention2d`'s forward (stride 1, no norm) with the ``F.unfold`` core
    :func:`aadet.layers.functional.reference.local_self_attention_2d_unfold`: keys and values
    of every pixel's ``k x k`` window copied, out-of-map neighbours masked out of the softmax."""
    nh, d = layer.num_heads, layer.head_channels
    q = split_heads(layer.query(x), nh) * d**-0.5  # [B, Nh, H, W, d]
    k, v = split_heads(layer.key(x), nh), split_heads(layer.value(x), nh)
    out = local_self_attention_2d_unfold(q, k, v, layer.rel_h, layer.rel_w, layer.kernel_size)
    return merge_heads(out)  # [B, C, H, W]


def check_references(dtype=torch.float64):
    """Max abs differences naive vs ours on small inputs (both must be ~1e-12 in float64)."""
    g = torch.Generator().manual_seed(0)
    b, nh, h, w, dk, dv = 2, 2, 5, 6, 4, 3
    q, k = (torch.randn(b, nh, h, w, dk, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, nh, h, w, dv, generator=g, dtype=dtype)
    rh = torch.randn(2 * h - 1, dk, generator=g, dtype=dtype)
    rw = torch.randn(2 * w - 1, dk, generator=g, dtype=dtype)
    aa = (
        (naive_relative_attention_2d(q, k, v, rh, rw) - relative_self_attention_2d(q, k, v, rh, rw))
        .abs()
        .max()
    )
    torch.manual_seed(0)
    layer = LocalSelfAttention2d(8, 8, kernel_size=5, num_heads=2, block_size=3).to(dtype)
    x = torch.randn(2, 8, 7, 9, dtype=dtype, generator=g)
    sasa = (naive_unfold_local_attention(layer, x) - layer(x)).abs().max()
    return {"aa_core": float(aa), "sasa_layer": float(sasa)}


def conv_stem(in_channels: int, out_channels: int) -> torch.nn.Module:
    """Detectron2's ``BasicStem`` without its norm, in plain torch: a 7x7/2 conv (padding 3, no
    bias), ReLU, a 3x3/2 max pool (padding 1): ``[B, in, H, W]`` -> ``[B, out, H/4, W/4]``."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(in_channels, out_channels, 7, stride=2, padding=3, bias=False),
        torch.nn.ReLU(inplace=True),
        torch.nn.MaxPool2d(3, stride=2, padding=1),
    )


# ----------------------------------------------------------------------------- cases
def aa_depths(fout: int):
    """``(dk, dv)`` of an AA layer with kappa 0.2, nu 0.1, 8 heads (e.g. 128 -> 24, 16)."""
    return attention_depth(0.2, fout, NUM_HEADS), attention_depth(0.1, fout, NUM_HEADS)


def naive_aa_bytes(batch: int, side: int) -> int:
    """Rough peak of the naive AA core: ~4 float32 ``[B, Nh, HW, HW]`` tensors live at once
    (measured on CPU: 3.9 GiB at 80x80, batch 1, i.e. 3.2 of them)."""
    return 4 * batch * NUM_HEADS * (side * side) ** 2 * 4


def plan_cases(suites, sizes, batch, max_naive_bytes, cuda=False):
    """The cases to measure; on CUDA also the Triton (and AA flex_attention) routes, and not the
    CPU-only C++ kernels of the stem and the HaloNet layer."""
    kernels = ("triton",) if cuda else ()  # SASA's GPU kernel
    cases = []
    for s in sizes:
        if "aa" in suites:
            if s not in AA_SIZES:
                raise SystemExit(
                    f"--sizes for the AA suite must be among {sorted(AA_SIZES)}; got {s}"
                )
            for kind in ("core", "layer"):
                if cuda:
                    impls = ("auto", "materialized", "naive", "triton", "flex") if kind == "core" \
                        else ("auto", "naive")
                else:  # the CPU routes by name: the C++ kernel ("auto" there) and SDPA
                    impls = ("cpp", "fused", "materialized", "naive") if kind == "core" \
                        else ("cpp", "fused", "naive")
                for impl in impls:
                    c = dict(suite="aa", kind=kind, impl=impl, side=s, channels=AA_SIZES[s])
                    need = naive_aa_bytes(batch, s)
                    if impl == "naive" and need > max_naive_bytes:
                        c["skipped"] = f"needs ~{need / 2 ** 30:.1f} GiB > --max-naive-gib"
                    cases.append(c)
        if "sasa" in suites:
            cpu_kernels = () if cuda else ("cpp", "cpp-recompute")
            for impl in ("neighborhood", "fused") + cpu_kernels + kernels + ("unfold", "conv3x3"):
                cases.append(
                    dict(suite="sasa", kind="layer", impl=impl, side=s, channels=SASA_CHANNELS)
                )
        if "halo" in suites:
            routes = ("fused", "materialized") if cuda else ("cpp", "bmm", "materialized", "fused")
            for impl in routes + ("sasa", "conv3x3"):
                cases.append(
                    dict(suite="halo", kind="layer", impl=impl, side=s, channels=HALO_CHANNELS)
                )
        if "stem" in suites:  # side: the input image's
            for impl in (STEM_CUDA_ROUTES if cuda else STEM_ROUTES) + ("convstem",):
                cases.append(dict(suite="stem", kind="layer", impl=impl, side=s, channels=STEM_OUT,
                                  in_channels=STEM_IN))
    return cases


def _make_work(case, batch, device, dtype):
    """The inputs and the fwd+bwd closure of one case."""
    torch.manual_seed(0)
    s, c = case["side"], case["channels"]
    if case["suite"] == "aa" and case["kind"] == "core":
        dk, dv = aa_depths(c)
        dkh, dvh = dk // NUM_HEADS, dv // NUM_HEADS
        leaf = lambda *shape: torch.randn(  # noqa: E731
            *shape, device=device, dtype=dtype, requires_grad=True
        )
        q = leaf(batch, NUM_HEADS, s, s, dkh)
        k, v = leaf(batch, NUM_HEADS, s, s, dkh), leaf(batch, NUM_HEADS, s, s, dvh)
        rh, rw = leaf(2 * s - 1, dkh), leaf(2 * s - 1, dkh)
        tensors = [q, k, v, rh, rw]
        if case["impl"] == "naive":
            fn = lambda: naive_relative_attention_2d(q, k, v, rh, rw)  # noqa: E731
        else:
            chunk = 1024 if case["impl"] == "materialized" else 0
            fn = lambda: relative_self_attention_2d(  # noqa: E731
                q, k, v, rh, rw, impl=case["impl"], query_chunk=chunk
            )
        params = []
    else:
        if case["suite"] == "stem":  # an image: no gradient wanted, as in training
            x = torch.randn(batch, case["in_channels"], s, s, device=device, dtype=dtype)
        else:
            x = torch.randn(batch, c, s, s, device=device, dtype=dtype, requires_grad=True)
        tensors = [x]
        if case["suite"] == "stem" and case["impl"] == "convstem":
            mod = conv_stem(case["in_channels"], c)
        elif case["suite"] == "stem":
            mod = SpatiallyAwareAttentionStem(
                case["in_channels"], c, block_size=STEM_BLOCK, num_heads=STEM_HEADS,
                num_mixtures=STEM_MIXTURES, norm="", impl=case["impl"],
            )
        elif case["suite"] == "aa":
            import aadet.layers.augmented_conv as aa_module

            impl = case["impl"] if case["impl"] in ("cpp", "fused") else "auto"
            mod = AugmentedConv2d(c, c, 3, kappa=0.2, nu=0.1, num_heads=NUM_HEADS, max_size=s, impl=impl)
            if case["impl"] == "naive":  # this process only runs this case: patching is contained
                aa_module.relative_self_attention_2d_unchecked = naive_relative_attention_2d
        elif case["impl"] == "conv3x3":
            mod = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        elif case["suite"] == "halo" and case["impl"] != "sasa":
            mod = HaloSelfAttention2d(
                c, c, block_size=HALO_BLOCK, halo_size=HALO_HALO, num_heads=NUM_HEADS, impl=case["impl"]
            )
        elif case["suite"] == "halo":  # the SASA layer at the same width, its default route
            mod = LocalSelfAttention2d(c, c, kernel_size=7, num_heads=NUM_HEADS)
        elif case["impl"] == "cpp-recompute":
            mod = LocalSelfAttention2d(
                c, c, kernel_size=7, num_heads=NUM_HEADS, impl="cpp", recompute_attention=True
            )
        else:
            impl = case["impl"] if case["impl"] in ("neighborhood", "fused", "cpp", "triton") else "auto"
            mod = LocalSelfAttention2d(c, c, kernel_size=7, num_heads=NUM_HEADS, impl=impl)
        mod = mod.to(device=device, dtype=dtype)
        params = list(mod.parameters())
        if case["suite"] == "sasa" and case["impl"] == "unfold":
            fn = lambda: naive_unfold_local_attention(mod, x)  # noqa: E731
        else:
            fn = lambda: mod(x)  # noqa: E731

    def step():
        for t in tensors + params:
            t.grad = None
        out = fn()
        out.float().sum().backward()

    return step


def failed_case(case: dict, result: dict) -> dict:
    """A worker's result; where it failed, the case with the error."""
    return dict(case, error=result["error"], detail=result.get("detail")) if "error" in result else result


def run_case(spec):
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    case = spec["case"]
    step = _make_work(case, spec["batch"], device, torch.float32)
    amp_dtype = check_amp_dtype(spec.get("amp_dtype"), device)

    def work():
        with autocast(device, amp_dtype, spec["amp"]):
            step()

    result = dict(case, **measure(work, warmup=spec["warmup"], iters=spec["iters"], device=device))
    if spec.get("profile"):
        result["profile"] = profile_call(work, device)
    return result


# ----------------------------------------------------------------------------- report
def _key(r):
    return (r["suite"], r["kind"], r["impl"], r["side"])


#: ratio name -> the number compared (result / reference).
RATIO_METRICS = {"time": "median_s", "cpu_time": "cpu_median_s", "peak_mem": "peak_bytes"}


def add_ratios(results):
    """AA: ratios to the naive case of the same kind and size; SASA: to the 3x3 conv and unfold;
    HaloNet: to the 3x3 conv and the SASA layer; the attention stem: to the conv stem."""
    by = index_results(results, key=_key)
    for r in results:
        if "median_s" not in r:
            continue
        refs = {
            "aa": {"naive": ("aa", r["kind"], "naive")},
            "sasa": {"conv3x3": ("sasa", "layer", "conv3x3"), "unfold": ("sasa", "layer", "unfold")},
            "halo": {"conv3x3": ("halo", "layer", "conv3x3"), "sasa": ("halo", "layer", "sasa")},
            "stem": {"convstem": ("stem", "layer", "convstem")},
        }[r["suite"]]
        r["ratios"] = {}
        for name, k in refs.items():
            ref = by.get((*k, r["side"]))
            if ref is not None:
                r["ratios"][name] = ratios(r, ref, RATIO_METRICS)
    return results


def not_measured(result: dict) -> bool:
    """A case skipped or failed: in any round, it is reported by its first such result."""
    return "error" in result or "skipped" in result


# ----------------------------------------------------------------------------- main
def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--suite",
        choices=("aa", "sasa", "halo", "stem", "all"),
        default="all",
        help="all: aa, sasa and halo (default); the stem runs alone, at its own batch and sides",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"batch (default 1, --suite stem {STEM_BATCH}; e.g. 8 on a GPU)",
    )
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="map sides (default 80 40 20); --suite stem: input sides (default "
        f"{' '.join(map(str, STEM_SIZES))})",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations (default 1 CPU, 10 CUDA)"
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed iterations (default 3 CPU, 30 CUDA)"
    )
    p.add_argument("--amp", action="store_true", help="autocast to --amp-dtype")
    add_amp_dtype_argument(p, " with --amp")
    p.add_argument(
        "--max-naive-gib",
        type=float,
        default=None,
        help="skip naive AA cases estimated above this (default 6 on CPU, none on CUDA)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every case")
    add_profile_argument(p, "each case")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every case this many times, round-robin over the cases, each time in a "
        "fresh process; a case's time is the median of its rounds' medians (default 1; 3 on a "
        "shared machine whose speed drifts, as tools/benchmark.py --rounds)",
    )
    p.add_argument("--output-json", metavar="FILE")
    p.add_argument("--output-md", metavar="FILE", help="markdown tables here (default: stdout)")
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    return p


def suites_sizes_batch(args):
    """The suites of ``--suite`` (``all``: aa, sasa and halo), the sizes and the batch: those
    given, else the defaults (80 40 20 and batch 1; the stem suite: :data:`STEM_SIZES`,
    :data:`STEM_BATCH`)."""
    suites = ("aa", "sasa", "halo") if args.suite == "all" else (args.suite,)
    stem = suites == ("stem",)
    sizes = args.sizes if args.sizes is not None else (list(STEM_SIZES) if stem else [80, 40, 20])
    batch = args.batch if args.batch is not None else (STEM_BATCH if stem else 1)
    return suites, sizes, batch


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:  # one case, in its own process; CUDA OOM is reported in the table
        return worker_main(args.worker, run_case)
    device, amp_dtype = command_device(args.device, args.amp_dtype)
    cuda = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    iters = args.iters if args.iters is not None else (30 if cuda else 3)
    max_gib = args.max_naive_gib if args.max_naive_gib is not None else (math.inf if cuda else 6.0)
    suites, sizes, batch = suites_sizes_batch(args)
    if len(set(sizes)) != len(sizes):
        raise SystemExit(f"--sizes lists a size more than once: {sizes}")
    with torch.no_grad():
        ref = check_references()
    if max(ref.values()) > 1e-9:
        raise SystemExit(f"naive references disagree with aadet's implementations: {ref}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1; got {args.rounds}")
    cases = plan_cases(suites, sizes, batch, max_gib * 2**30, cuda=cuda)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="aadet_layers_") as tmp:
        for i in range(args.rounds):
            results, specs = [], []
            for case in cases:
                if "skipped" in case:
                    results.append(case)
                    specs.append(None)
                    continue
                tag = f" (round {i + 1}/{args.rounds})" if args.rounds > 1 else ""
                print(f"[benchmark_layers] {case}{tag}", file=sys.stderr, flush=True)
                spec = dict(
                    case=case,
                    device=str(device),
                    batch=batch,
                    warmup=warmup,
                    iters=iters,
                    amp=args.amp,
                    amp_dtype=amp_dtype,
                    threads=args.threads,
                    profile=args.profile,
                )
                specs.append(spec)
                results.append(failed_case(case, run_case_in_subprocess(__file__, spec, tmp)))
            rounds.append(results)
        results = merge_rounds(rounds, combine_rounds, failed=not_measured)
        if device.type == "cpu":  # the peaks from a memory pass (aadet_dev/timing.py)
            print(f"[benchmark_layers] memory pass: {len(specs)} cases", file=sys.stderr, flush=True)
            results = memory_pass(__file__, results, specs, tmp, run=run_case_in_subprocess)
    add_ratios(results)
    report = dict(
        device=str(device),
        batch=batch,
        warmup=warmup,
        iters=iters,
        rounds=args.rounds,
        amp=args.amp,
        amp_dtype=amp_dtype if args.amp else None,
        env=environment_info(device),
        peak_memory=peak_memory_meaning(device),
        reference_check=ref,
        results=results,
    )
    return write_report(report, render_layer_tables(report), args.output_json, args.output_md)


if __name__ == "__main__":
    sys.exit(main())
