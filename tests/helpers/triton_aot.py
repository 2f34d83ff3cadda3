"""Ahead-of-time compilation of aadet's Triton kernels for an H100 (sm_90), on a machine without
a GPU: the helper of the kernels' compile tests (``tests/layers/test_triton_local_attention.py`` for
SASA, ``tests/layers/test_aa_kernels.py`` for AA).

Triton's interpreter (the CPU tests of the kernels) runs a kernel's Python; it does not
type-check it as the compiler does (loop-carried types, constexpr branches, casts, the operand
types of ``tl.dot``), so a kernel can pass every CPU test and still fail to compile on the GPU.
Here the launch code itself runs on CPU tensors with the kernels replaced by recorders
(:func:`recorded_launches`): each launch it would make is kept with its arguments, constants and
options, and :func:`compile_launches` compiles it to a cubin for sm_90 with Triton's bundled LLVM
and ptxas (``triton.compile`` of a ``triton.compiler.ASTSource``, target
``GPUTarget("cuda", 90, 32)``: Triton 3.6 and 3.8 both have them). The signature is the one
Triton's JIT would build for that launch: pointer types from the tensors' dtypes, integers equal
to 1 folded into constants, 16-byte aligned pointers and multiples of 16 marked divisible by 16.

Which launches: :func:`config_attention_layers` builds every config of ``configs/`` on the meta
device (no memory, no initialization) and lists its attention layers' head counts, head widths,
kernel sizes and positional terms; the test files turn those into the launch code's inputs.
"""
import contextlib
import glob
import os
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, NamedTuple, Tuple

import torch

from tests.helpers import REPO

#: ``GPUTarget`` of an H100: CUDA compute capability 9.0, 32 threads a warp.
H100 = ("cuda", 90, 32)
#: Triton's pointer type names of the tensor dtypes the kernels take.
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                 torch.int32: "*i32", torch.int64: "*i64"}
#: Launch keywords that are compile options, not kernel arguments.
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def nvidia_backend_available() -> bool:
    """Whether this Triton can compile for CUDA (its ``nvidia`` backend: bundled LLVM, ptxas)."""
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


class Launch(NamedTuple):
    """One kernel launch: the ``JITFunction`` and what it was called with."""

    kernel: object
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a ``JITFunction``: ``kernel[grid](*args, **kwargs)`` only records."""

    def __init__(self, kernel, launches: List[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(self.kernel, args, kwargs))

        return launch


@contextlib.contextmanager
def recorded_launches(namespace, names: Iterable[str]):
    """Within the block, the kernels ``namespace.<name>`` (a module) or ``namespace[name]`` (a
    dict) record their launches instead of running; yields the list they are recorded in."""
    launches: List[Launch] = []
    is_dict = isinstance(namespace, dict)
    saved = {}
    for name in names:
        saved[name] = namespace[name] if is_dict else getattr(namespace, name)
        recorder = _Recorder(saved[name], launches)
        if is_dict:
            namespace[name] = recorder
        else:
            setattr(namespace, name, recorder)
    try:
        yield launches
    finally:
        for name, kernel in saved.items():
            if is_dict:
                namespace[name] = kernel
            else:
                setattr(namespace, name, kernel)


def _bind(launch: Launch) -> Tuple[dict, dict]:
    """``({argument: value}, {option: value})`` of a launch, in the kernel's argument order."""
    names = list(launch.kernel.arg_names)
    if len(launch.args) > len(names):
        raise TypeError(f"{launch.kernel.__name__}: {len(launch.args)} arguments for {len(names)} parameters")
    bound = dict(zip(names, launch.args))
    options = {}
    for key, value in launch.kwargs.items():
        if key in names:
            bound[key] = value
        elif key in OPTIONS:
            options[key] = value
        else:
            raise TypeError(f"{launch.kernel.__name__}: unknown launch keyword {key!r}")
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"{launch.kernel.__name__}: launched without {missing}")
    return {n: bound[n] for n in names}, options


def specialization(launch: Launch) -> Tuple[dict, dict, dict, dict]:
    """``(signature, constexprs, attrs, options)`` Triton's JIT compiles for this launch.

    As ``triton.runtime.jit`` specializes: ``tl.constexpr`` parameters and integers equal to 1
    become constants; tensors are pointers to their dtype, integers ``i32`` (``i64`` past 2^31);
    16-byte aligned pointers and integers divisible by 16 get ``tt.divisibility = 16``.
    """
    bound, options = _bind(launch)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(bound, launch.kernel.params)):
        value = bound[name]
        divisible = False
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            if value.dtype not in POINTER_TYPES:
                raise TypeError(f"{launch.kernel.__name__}: {name} has dtype {value.dtype}")
            signature[name] = POINTER_TYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif type(value) is int:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            divisible = value % 16 == 0
        else:
            raise TypeError(f"{launch.kernel.__name__}: {name}={value!r} is neither a tensor, an int "
                            "nor a constexpr")
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def describe(launch: Launch) -> str:
    """``kernel(Q=*bf16, ..., BLOCK_P=64, ...) num_warps=4``: what a compile failure names."""
    signature, constexprs, _, options = specialization(launch)
    types = ", ".join(f"{n}={t}" for n, t in signature.items() if t != "constexpr" and t.startswith("*"))
    consts = ", ".join(f"{n}={v}" for n, v in constexprs.items() if n.isupper() and not n.islower())
    opts = " ".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{launch.kernel.__name__}({types}; {consts}) {opts}".rstrip()


def _key(launch: Launch):
    signature, constexprs, attrs, options = specialization(launch)
    return (launch.kernel.__name__, tuple(signature.items()), tuple(sorted(constexprs.items(), key=str)),
            tuple(sorted(attrs)), tuple(sorted(options.items())))


def distinct(launches: Iterable[Launch]) -> List[Launch]:
    """The launches that compile to different binaries (one of each), in order."""
    seen, out = set(), []
    for launch in launches:
        key = _key(launch)
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def compile_for_h100(launch: Launch):
    """The launch compiled to a cubin for sm_90 (``triton.compile``'s result)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialization(launch)
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*H100), options=options)


def compile_launches(launches: Iterable[Launch]) -> Tuple[int, List[str]]:
    """Compile every distinct launch for sm_90; ``(number compiled, failures)``, one line per
    failing launch (kernel, types, constants and the compiler's first lines), so that a test can
    report every failing combination at once."""
    todo = distinct(launches)
    failures = []
    for launch in todo:
        try:
            compiled = compile_for_h100(launch)
            if len(compiled.asm.get("cubin", b"")) < 1000:
                raise RuntimeError(f"no cubin ({sorted(compiled.asm)})")
        except Exception as e:  # noqa: BLE001  (each failure is reported, the others still compile)
            lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
            # Triton's CompilationError: "at LINE:COL:", the kernel's source, "^", then the error
            msg = " | ".join(lines[:1] + lines[-3:] if len(lines) > 4 else lines)[:600]
            failures.append(f"{describe(launch)}: {type(e).__name__}: {msg}")
    return len(todo), failures


# ----------------------------------------------------------------------------- what configs run
def all_configs() -> List[str]:
    """Every config under ``configs/`` except the ``Base-*`` files, relative to the repository."""
    paths = glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)
    return sorted(os.path.relpath(p, REPO) for p in paths if not os.path.basename(p).startswith("Base-"))


def config_attention_layers(configs=None) -> Dict[str, Dict[tuple, List[str]]]:
    """The attention layers of every config (default :func:`all_configs`), built on the meta device.

    Returns:
        ``{"sasa": {(num_heads, head_channels, kernel_size, relative): [config, ...]},
        "aa": {(num_heads, dkh, dvh, relative): [config, ...]},
        "halo": {(num_heads, head_channels, block_size, halo_size, stride, relative): [config, ...]}}``:
        each distinct layer shape with the configs that have it (``relative``: the layer adds
        relative position logits).
    """
    from detectron2.modeling import build_model

    import aadet  # noqa: F401  (registers the models)
    from aadet.engine import load_config
    from aadet.layers.augmented_conv import AugmentedConv2d
    from aadet.layers.halo_attention import HaloSelfAttention2d
    from aadet.layers.local_attention import LocalSelfAttention2d

    found: Dict[str, Dict[tuple, List[str]]] = {"sasa": defaultdict(list), "aa": defaultdict(list),
                                                "halo": defaultdict(list)}
    for config in configs or all_configs():
        cfg = load_config(os.path.join(REPO, config), ["MODEL.DEVICE", "meta"])
        with torch.device("meta"):
            model = build_model(cfg)
        layers = set()
        for m in model.modules():
            if isinstance(m, LocalSelfAttention2d):
                layers.add(("sasa", (m.num_heads, m.head_channels, m.kernel_size, m.rel_h is not None)))
            elif isinstance(m, AugmentedConv2d):
                layers.add(("aa", (m.num_heads, m.dkh, m.dvh, m.rel_h is not None)))
            elif isinstance(m, HaloSelfAttention2d):
                layers.add(("halo", (m.num_heads, m.head_channels, m.block_size, m.halo_size, m.stride,
                                     m.rel_h is not None)))
        for kind, spec in sorted(layers):
            found[kind][spec].append(config)
    return {kind: dict(specs) for kind, specs in found.items()}


def run_recorded(namespace, names, fn: Callable[[], None]) -> List[Launch]:
    """The launches of the kernels ``names`` of ``namespace`` while ``fn()`` runs."""
    with recorded_launches(namespace, names) as launches:
        fn()
    return list(launches)


def assert_compile(launches):
    """Compile every recorded launch for sm_90; fail listing each variant that does not compile.
    Returns how many variants compiled."""
    n, failures = compile_launches(launches)
    assert not failures, f"{len(failures)} of {n} kernel variants do not compile for sm_90:\n" + "\n".join(failures)
    return n
