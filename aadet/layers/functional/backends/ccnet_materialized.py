"""CCNet's criss-cross attention with its logits written out: the ``"materialized"`` route of
:data:`~aadet.layers.functional.criss_cross.CRISS_CROSS_BACKENDS`.

Computes :func:`~aadet.layers.functional.criss_cross.criss_cross_attention_2d` as two 1D
products, the column logits ``q[i, j] . k[a, j]`` (``[.., H, W, H]``, the pixel's own column)
and the row logits ``q[i, j] . k[i, c]`` (``[.., H, W, W]``, its own row); the row part's entry
``c = j`` -- the pixel itself, already in the column part -- is set to ``-inf``, so the pixel is
counted once; one softmax over the ``H + W`` entries (``H + W - 1`` keys); then the two weighted
sums of the values. Autograd differentiates it (saving the ``H + W`` probabilities per query).

Arithmetic in float32 with autocast off, or float64 for float64 inputs; output in ``v``'s dtype.
Plain differentiable tensor ops only, so it exports (TorchScript, ONNX opset 17).
"""
import torch

from ..precision import compute_dtype

__all__ = ["criss_cross_logits", "materialized_criss_cross_attention"]


def criss_cross_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[B, Nh, H, W, H + W]`` logits of every pixel over its column (the first ``H`` entries,
    key ``(a, j)`` at ``a``) and its row (the last ``W``, key ``(i, c)`` at ``H + c``, the pixel's
    own ``c = j`` at ``-inf``), in ``q``'s dtype (the caller casts); ``q, k [B, Nh, H, W, d]``."""
    w = q.shape[3]
    col = torch.einsum("bnijd,bnajd->bnija", q, k)  # [B, Nh, H, W, H]: keys (a, j)
    row = torch.einsum("bnijd,bnicd->bnijc", q, k)  # [B, Nh, H, W, W]: keys (i, c)
    cols = torch.arange(w, device=q.device)
    itself = cols[:, None] == cols[None, :]  # [W (j), W (c)]: c = j, counted in the column part
    row = row.masked_fill(itself, float("-inf"))
    return torch.cat([col, row], dim=-1)


def materialized_criss_cross_attention(q, k, v):
    """Explicit logits and one softmax over the criss-cross (``impl="materialized"``) on checked
    arguments: ``q, k [B, Nh, H, W, d]`` (``q`` already scaled), ``v [B, Nh, H, W, dv]`` ->
    ``[B, Nh, H, W, dv]``."""
    h = q.shape[2]
    ct = compute_dtype(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        probs = torch.softmax(criss_cross_logits(q.to(ct), k.to(ct)), dim=-1)  # [B, Nh, H, W, H + W]
        vc = v.to(ct)
        out = torch.einsum("bnija,bnajd->bnijd", probs[..., :h], vc)  # the column (a, j)
        out = out + torch.einsum("bnijc,bnicd->bnijd", probs[..., h:], vc)  # the row (i, c)
    return out.to(v.dtype)
