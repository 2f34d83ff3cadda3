"""Every rank of a distributed run holds the same weights: checked where that can silently break.

DDP keeps the replicas equal only if they start equal. It broadcasts rank 0's parameters when it
wraps the model, but ``--resume`` (and ``MODEL.WEIGHTS``) load the checkpoint afterwards, on every
rank, from that machine's own filesystem: a machine that sees another ``OUTPUT_DIR`` (not shared, or
a stale copy) starts from other weights or at another iteration, and nothing fails; its replica
trains on, different, or the run hangs when one rank finishes early. So the trainer
(:class:`aadet.engine.Trainer`) checks, on runs of more than one process:

* after loading: every rank's start iteration and weights fingerprint are gathered and must be
  equal, else :class:`RanksDisagreeError` names the ranks and what to fix;
* after training: the fingerprints again; each rank logs the one it holds.

The fingerprint (:func:`weights_fingerprint`) is a SHA-1 of the parameters' names, dtypes, shapes
and bytes. Buffers are left out: some legitimately differ per rank (BatchNorm running statistics
without SyncBN, RetinaNet's loss normalizer).
"""
import hashlib
import logging
from collections import defaultdict

import torch
from detectron2.utils import comm

__all__ = ["RanksDisagreeError", "weights_fingerprint", "check_ranks_agree"]

logger = logging.getLogger(__name__)


class RanksDisagreeError(RuntimeError):
    """The processes of one run hold different training states."""


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-1 (hex) of ``model``'s parameters: names, dtypes, shapes and exact bytes."""
    h = hashlib.sha1()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(p.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_ranks_agree(what: str, value, hint: str = ""):
    """Gather ``value`` (picklable, comparable) from every rank; return it if all are equal.

    Every rank must call it (a collective). Raises :class:`RanksDisagreeError` on every rank,
    listing which ranks hold which value, followed by ``hint``.
    """
    values = comm.all_gather(value)
    if all(v == values[0] for v in values):
        return value
    ranks = defaultdict(list)
    for r, v in enumerate(values):
        ranks[repr(v)].append(r)
    listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}"
                        for v, rs in ranks.items())
    raise RanksDisagreeError(f"the {len(values)} ranks disagree on {what}: {listing}. {hint}".strip())
