"""What the Triton kernels (SASA's :mod:`.sasa_triton`, AA's :mod:`.aa_triton`) share: whether
triton imports, whether it runs under its interpreter, the decorator of that mode and the input
dtypes the kernels take. Imported with them only, never by ``import aadet``; it imports without
triton (then :data:`TRITON_AVAILABLE` is False).

Triton decides compiled or interpreted when it is first imported: with ``TRITON_INTERPRET=1`` set
before then it decorates its own library (``tl.sum``, ``tl.zeros``, ...) as interpreted
functions, and the kernels must be too (the two modes do not mix in one process), so
:data:`TRITON_INTERPRETED` is fixed for the process and :func:`jit` follows it. Compiled, the
kernels run on CUDA; interpreted, on CPU tensors (exact and slow: for tests).
"""
import torch

try:  # Triton is optional: the other routes need none.
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = tl = None
    TRITON_AVAILABLE = False

__all__ = ["TRITON_AVAILABLE", "TRITON_DTYPES", "TRITON_INTERPRETED", "jit", "tl", "triton"]

#: The dtypes of ``q, k, v`` the kernels take (their arithmetic is float32).
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Whether triton was imported under its interpreter (``TRITON_INTERPRET=1`` when triton was first
#: imported): its own library functions are then interpreted functions.
TRITON_INTERPRETED = TRITON_AVAILABLE and type(tl.zeros).__name__ == "InterpretedFunction"


def jit(fn):
    """``triton.jit`` in the mode triton itself was imported in."""
    if TRITON_INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)
