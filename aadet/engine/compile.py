"""``MODEL.COMPILE``: the model of training and evaluation run through ``torch.compile``.

:func:`maybe_compile` compiles the model *in place* with ``nn.Module.compile`` (not
``torch.compile(model)``, whose wrapper would prefix every ``state_dict`` key with
``_orig_mod.``): checkpoints written while training compiled load into uncompiled models (the
predictor, the export and visualization tools) and back, and the checkpointer, the moving average
and DDP see the same module as without compiling. Only the module's ``__call__`` is compiled
(what training, ``Trainer.test`` and the test-time-augmentation wrapper call); its methods called
directly (``model.inference(...)``) run eagerly.

``torch.compile`` is lazy: it compiles at the first call, i.e. in the first training iteration,
where a backend that cannot run (Inductor on CPU without a C++ compiler, on CUDA without Triton)
would fail deep inside the first step. So :func:`maybe_compile` first compiles and runs a one-line
function with the same settings on the model's device, and turns a failure into
:class:`CompileUnavailableError`, which names ``MODEL.COMPILE.ENABLED`` and how to turn it off.
There is no silent fallback to eager: a run asked to compile either compiles or stops at start.
"""
import logging

import torch
from torch import nn

__all__ = [
    "CompileUnavailableError",
    "add_compile_argument",
    "check_backend_runs",
    "compile_kwargs",
    "compile_opts",
    "maybe_compile",
]

logger = logging.getLogger(__name__)


class CompileUnavailableError(RuntimeError):
    """``MODEL.COMPILE.ENABLED`` but the backend cannot compile on this machine."""


def compile_kwargs(cfg) -> dict:
    """``torch.compile``'s keyword arguments from ``MODEL.COMPILE`` (``MODE "default"`` is
    torch's ``mode=None``)."""
    c = cfg.MODEL.COMPILE
    return {
        "backend": c.BACKEND,
        "mode": None if c.MODE == "default" else c.MODE,
        "dynamic": bool(c.DYNAMIC),
    }


def add_compile_argument(parser, runs: str) -> None:
    """A command's ``--compile`` flag: the same as ``MODEL.COMPILE.ENABLED True`` (:func:`compile_opts`).
    ``runs``: what it runs through ``torch.compile`` and when that compiles, for the help."""
    parser.add_argument(
        "--compile", action="store_true",
        help=f"run {runs} through torch.compile: the same as MODEL.COMPILE.ENABLED True "
             "(MODEL.COMPILE.BACKEND/MODE/DYNAMIC: aadet/config.py)",
    )


def compile_opts(args) -> list:
    """The config overrides ``--compile`` (:func:`add_compile_argument`) stands for."""
    return ["MODEL.COMPILE.ENABLED", "True"] if args.compile else []


def _probe(x):
    return x * 2 + 1


def check_backend_runs(cfg, device) -> None:
    """Compile and run a one-line function with ``MODEL.COMPILE``'s settings on ``device``.

    Raises:
        CompileUnavailableError: the backend failed, with its message, naming
            ``MODEL.COMPILE.ENABLED`` and how to turn it off.
    """
    kwargs = compile_kwargs(cfg)
    try:
        torch.compile(_probe, **kwargs)(torch.ones(4, device=device))
    except Exception as e:  # BackendCompilerFailed, InvalidCxxCompiler, ImportError, ...
        reason = (str(e).strip().splitlines() or [""])[0]  # the rest: torch's debugging hints
        raise CompileUnavailableError(
            f"MODEL.COMPILE.ENABLED is True but torch.compile(backend={kwargs['backend']!r}, "
            f"mode={cfg.MODEL.COMPILE.MODE!r}) cannot compile on {device}: "
            f"{type(e).__name__}: {reason} "
            "(Inductor needs a C++ compiler on CPU (torch._inductor.config.cpp.cxx, $CXX) and "
            "Triton on CUDA). To run uncompiled, drop --compile / set MODEL.COMPILE.ENABLED False; "
            "or pick another MODEL.COMPILE.BACKEND (\"aot_eager\" needs no compiler)."
        ) from e


def maybe_compile(model: nn.Module, cfg) -> nn.Module:
    """``model`` compiled in place with ``MODEL.COMPILE``'s settings when
    ``MODEL.COMPILE.ENABLED`` (``model.compile(backend=..., mode=..., dynamic=...)``), unchanged
    otherwise; returns ``model`` either way.

    Its ``state_dict`` keys stay those of the uncompiled model. Call it before wrapping the
    model in DDP (``Trainer.build_model`` does).

    Raises:
        CompileUnavailableError: the backend cannot run on the model's device
            (:func:`check_backend_runs`).
    """
    if not cfg.MODEL.COMPILE.ENABLED:
        return model
    if not hasattr(nn.Module, "compile"):  # torch 2.1 (setup.py's floor) has only torch.compile
        raise CompileUnavailableError(
            f"MODEL.COMPILE.ENABLED needs torch >= 2.2 (nn.Module.compile); this is torch "
            f"{torch.__version__}. Drop --compile / set MODEL.COMPILE.ENABLED False."
        )
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device(cfg.MODEL.DEVICE)
    check_backend_runs(cfg, device)
    kwargs = compile_kwargs(cfg)
    model.compile(**kwargs)
    logger.info(
        "MODEL.COMPILE: %s compiled with torch.compile(backend=%r, mode=%r, dynamic=%s); the "
        "first iterations and the first evaluation include the compile time",
        type(model).__name__, kwargs["backend"], cfg.MODEL.COMPILE.MODE, kwargs["dynamic"],
    )
    return model
