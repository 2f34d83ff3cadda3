"""AA's global relative attention with its logits written out: the ``"materialized"`` route of
:data:`~aadet.layers.functional.logit_tables.LOGIT_TABLE_BACKENDS`, which SASA's blocked
``"materialized"`` route (:mod:`.sasa_blocked`) also calls.

Computes :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables`,
``softmax(q . k + sum_g T_g[..., i, idx_g[j]]) v``, as explicit logits, a float32 softmax (float64
for float64 inputs, autocast off) and the weighted sum, over chunks of queries (peak memory
``N * chunk * Lk``); under autograd each chunk is recomputed in backward (activation
checkpointing), so training memory is bounded too. Plain tensor ops only, so it exports.
"""
import torch
from torch.utils.checkpoint import checkpoint

from ..dispatch import is_exporting
from ..precision import compute_dtype

__all__ = ["materialized_attention_with_logit_tables"]


def _materialized_chunk(q, k, v, *tables_and_index):
    n = len(tables_and_index) // 2
    tables, key_index = tables_and_index[:n], tables_and_index[n:]
    ct = compute_dtype(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        logits = torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2))  # [N, Lq, Lk]
        for t, idx in zip(tables, key_index):
            logits = logits + t.to(ct).index_select(-1, idx.to(t.device))
        weights = torch.softmax(logits, dim=-1)
        out = torch.matmul(weights, v.to(ct))
    return out.to(v.dtype)


def materialized_attention_with_logit_tables(q, k, v, tables, key_index, *, query_chunk: int = 0):
    """Explicit float32 logits and softmax (``impl="materialized"``) on checked arguments (shapes
    as in :func:`~aadet.layers.functional.logit_tables.attention_with_logit_tables`),
    ``query_chunk`` queries at a time (0 = all): peak memory ``N * query_chunk * Lk``; under
    autograd each chunk is recomputed in backward, unless tracing/exporting (the chunks are then
    unrolled into the graph)."""
    lq, chunk = q.shape[-2], query_chunk
    if chunk <= 0 or chunk >= lq:
        return _materialized_chunk(q, k, v, *tables, *key_index)
    outs = []
    need_grad = torch.is_grad_enabled() and not is_exporting() and any(
        t.requires_grad for t in (q, k, v, *tables)
    )
    for s in range(0, lq, chunk):
        sl = slice(s, min(s + chunk, lq))
        args = (q[..., sl, :], k, v, *[t[..., sl, :] for t in tables], *key_index)
        if need_grad:
            outs.append(checkpoint(_materialized_chunk, *args, use_reentrant=False))
        else:
            outs.append(_materialized_chunk(*args))
    return torch.cat(outs, dim=-2)
