"""The precision every attention computation of this package keeps, defined once.

Logits, softmax and weighted sums are computed in the *compute dtype* of the inputs: float32, or
float64 for float64 inputs (the references and exactness tests), with autocast off, so that
half-precision inputs (autocast) lose nothing in the softmax. A custom autograd Function returns
its output in ``v``'s dtype and each input's gradient in that input's own dtype.
"""
from typing import Optional, Tuple

import torch

__all__ = ["compute_dtype", "grads_in_input_dtypes", "input_dtypes"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def input_dtypes(*tensors: Optional[torch.Tensor]) -> Tuple[Optional[torch.dtype], ...]:
    """The dtype of each input (None for an absent one): what a Function's forward records as
    ``ctx.dtypes`` for :func:`grads_in_input_dtypes`."""
    return tuple(None if t is None else t.dtype for t in tensors)


def grads_in_input_dtypes(ctx, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """A Function's gradients of its first ``len(grads)`` inputs, each in its input's dtype
    (``ctx.dtypes``) where ``ctx.needs_input_grad`` asks for it, else None."""
    return tuple(
        g.to(dtype) if need and g is not None else None
        for g, dtype, need in zip(grads, ctx.dtypes, ctx.needs_input_grad)
    )
