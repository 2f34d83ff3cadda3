"""How the public functions pick an implementation: route registries, the export rule and
lazily imported routes.

Every public function of this package takes ``impl``: ``"auto"`` or the name of a :class:`Route`
in its :class:`RouteRegistry` (SASA's ``LOCAL_ATTENTION_BACKENDS``, the logit tables'
``LOGIT_TABLE_BACKENDS``). The registry is the one list of routes: the allowed ``impl`` values
(:meth:`RouteRegistry.impls`), the routes that export (:meth:`RouteRegistry.exportable`), the
error messages and the generated route lists in the docs (:meth:`RouteRegistry.describe`) are
all read from it when they are needed, so a route registered later appears in every one of them.

``"auto"`` is resolved by the rule in each front end's module. Those rules share one: while a
model is being traced or exported (:func:`is_exporting`), ``"auto"`` takes a route made only of
plain differentiable tensor ops -- no custom ``torch.autograd.Function`` (traced as an opaque
``prim::PythonOp``) and no ``scaled_dot_product_attention`` -- so the graph exports to ONNX at
opset 17. Such routes are flagged ``exports=True``.
"""
import functools
import importlib
import importlib.util
from typing import Callable, Dict, NamedTuple, Tuple

import torch

from .checks import ErrorFactory, argument_error, check_one_of

__all__ = ["AUTO", "Route", "RouteRegistry", "is_exporting", "lazy_backend"]

#: The ``impl`` value that lets the front end pick the route (every registry accepts it).
AUTO = "auto"


class Route(NamedTuple):
    """One implementation in a :class:`RouteRegistry`.

    Attributes:
        fn: the implementation, on checked arguments, in its registry's calling convention.
        summary: what it is and where it runs, in one line (generated docs and messages).
        exports: it traces into plain tensor ops (TorchScript, ONNX opset 17), so a model whose
            config names it can be exported (:mod:`aadet.export`).
        cuda: it runs on CUDA tensors (the C++ CPU kernels do not).
        blocked: it tiles queries and takes the ``block_size`` keyword (SASA's blocked routes).
        recompute: it takes the ``recompute`` keyword and, given True, keeps no attention
            weights for backward but recomputes them there (SASA's C++ kernel; Triton's kernels,
            which always do, drop the keyword).
        requires: modules it imports when it runs (e.g. ``("triton",)``): ``"auto"`` takes it only
            where they can be imported (:meth:`usable`).
    """

    fn: Callable[..., torch.Tensor]
    summary: str
    exports: bool = False
    cuda: bool = True
    blocked: bool = False
    recompute: bool = False
    requires: Tuple[str, ...] = ()

    def usable(self) -> bool:
        """Every module of :attr:`requires` can be imported here (found, not imported)."""
        return all(_importable(module) for module in self.requires)


@functools.lru_cache(maxsize=None)
def _importable(module: str) -> bool:
    """``module`` is found on this Python's path (looked up once a process: :meth:`Route.usable`
    is asked on every ``"auto"`` call on CUDA)."""
    return importlib.util.find_spec(module) is not None


class RouteRegistry(Dict[str, Route]):
    """``impl`` name -> :class:`Route`: the routes of one public function, in the order listed.

    ``"auto"`` is not a route: :meth:`impls` adds it in front. Adding a route is one file under
    ``backends/`` and one entry in the registry's definition.
    """

    def __init__(self, what: str, routes: Dict[str, Route]):
        super().__init__(routes)
        self.what = what  # e.g. "SASA local attention", for messages

    def impls(self) -> Tuple[str, ...]:
        """The allowed values of ``impl``: ``"auto"``, then every route."""
        return (AUTO,) + tuple(self)

    def exportable(self) -> Tuple[str, ...]:
        """The ``impl`` values a traced or exported model may hold: ``"auto"`` (it takes an
        exporting route while exporting) and the routes flagged ``exports``."""
        return (AUTO,) + tuple(name for name, route in self.items() if route.exports)

    def recomputing(self) -> Tuple[str, ...]:
        """The ``impl`` values that may be asked to recompute the attention weights in backward:
        ``"auto"`` (the route it takes does, where it can) and the routes flagged ``recompute``."""
        return (AUTO,) + tuple(name for name, route in self.items() if route.recompute)

    def check(self, impl, name: str = "impl", error: ErrorFactory = argument_error) -> None:
        """``impl`` is one of :meth:`impls` (the message lists them)."""
        check_one_of(impl, self.impls(), name, error)

    def describe(self, indent: str = "") -> str:
        """One line per route, ``* ``name``: summary``."""
        return "\n".join(f"{indent}* ``{name}``: {route.summary}" for name, route in self.items())

    def document(self, doc: str, name: str) -> str:
        """A front end's module docstring ``doc`` followed by its routes (:meth:`describe`), the
        registry being the module's ``name``."""
        return f"{doc}\nThe routes (generated from :data:`{name}`):\n\n{self.describe()}\n"


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
