"""How the public functions pick an implementation: the export rule and lazily imported routes.

Every public function of this package takes ``impl`` (one of its ``*_IMPLS`` tuple, derived from
its registry of implementations; checked by :func:`~.checks.check_impl`) and resolves ``"auto"``
by the rules in its own module. Those rules share one: while a model is being traced or exported
(:func:`is_exporting`), ``"auto"`` takes a route made only of plain differentiable tensor ops --
no custom ``torch.autograd.Function`` (traced as an opaque ``prim::PythonOp``) and no
``scaled_dot_product_attention`` -- so the graph exports to ONNX at opset 17.
"""
import importlib
from typing import Callable

import torch

__all__ = ["is_exporting", "lazy_backend"]


def is_exporting() -> bool:
    """True while ``torch.jit.trace``, ``torch.onnx.export`` or ``torch.export`` records the model."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return True
    is_exp = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exp()) if is_exp is not None else False


def lazy_backend(module: str, name: str, *, drop=()) -> Callable[..., torch.Tensor]:
    """An implementation that imports ``aadet.layers.functional.<module>`` on first call
    (``module`` relative to this package, e.g. ``"backends.sasa_triton"``).

    Kernel modules (Triton, flex_attention) are imported only when their route runs: ``import
    aadet`` stays fast, works without Triton, and Triton's interpreter mode (``TRITON_INTERPRET``,
    read when Triton is first imported) stays the caller's choice. ``drop`` names keyword arguments
    of the registry's calling convention that this implementation does not take.
    """

    def backend(*args, **kwargs):
        for key in drop:
            kwargs.pop(key, None)
        fn = getattr(importlib.import_module(f"{__package__}.{module}"), name)
        return fn(*args, **kwargs)

    backend.__name__ = backend.__qualname__ = name
    backend.__doc__ = f"``{module}.{name}`` (imported on first call)."
    return backend
