"""How the attention layers of a model attend and learn: per-layer attention perplexity and the
gradient/weight ratios of the relative embeddings (plain PyTorch, no Detectron2 needed).

* Perplexity: ``exp(entropy)`` of a query's attention distribution, the effective number of keys
  it attends to, between 1 (one key) and the number of keys in its window (uniform attention).
  :func:`attention_perplexity` averages it over images, heads and (a deterministic subsample of)
  query pixels and reports the mean number of in-map keys of the same queries next to it:
  ``perplexity == keys`` means attention is still uniform (a local average pooling). Computed
  under ``torch.no_grad()``.
  Covered layers (:data:`ATTENTION_LAYER_TYPES`): SASA's :class:`~aadet.layers.LocalSelfAttention2d`
  (``k x k`` windows clipped to the map), AA's :class:`~aadet.layers.AugmentedConv2d` (global:
  every query sees the ``h * w`` keys of its attention grid), SASA's
  :class:`~aadet.layers.SpatiallyAwareAttentionStem` (the in-map pixels of the query's block) and
  HaloNet's :class:`~aadet.layers.HaloSelfAttention2d` (the in-map keys of the window of the
  query's block).
* :func:`relative_embedding_grad_ratios`: ``||grad|| / ||weight||`` of every attention layer's
  relative tables, query and value projections, as left by a backward pass: the relative
  step size an SGD step takes (times the learning rate).
* :class:`AttentionStatsCollector`: forward hooks that compute the perplexity of every attention
  layer on the input it gets in one forward pass of the whole model (what
  :class:`aadet.engine.hooks.AttentionStatsHook` writes to the training metrics).

The probabilities come from the layers' own computations: :meth:`LocalSelfAttention2d.queries_keys`
with :func:`~aadet.layers.functional.local_attention_probs_2d`,
:meth:`AugmentedConv2d.attention_maps`, :meth:`SpatiallyAwareAttentionStem.attention_probs` and
:meth:`HaloSelfAttention2d.queries_keys` with :func:`~aadet.layers.functional.halo_attention_probs_2d`.
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..layers import (
    RELATIVE_EMBEDDING_NAMES,
    AugmentedConv2d,
    HaloSelfAttention2d,
    LocalSelfAttention2d,
    SpatiallyAwareAttentionStem,
)
from ..layers.functional import block_padding_mask, halo_attention_probs_2d, local_attention_probs_2d
from ..utils.modules import unwrap_model

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "AttentionStats",
    "AttentionStatsCollector",
    "DEFAULT_MAX_QUERIES",
    "attention_layers",
    "attention_perplexity",
    "augmented_attention_perplexity",
    "halo_attention_perplexity",
    "local_attention_perplexity",
    "relative_embedding_grad_ratios",
    "stem_attention_perplexity",
]

#: The layer classes whose attention these statistics cover (subclasses included).
ATTENTION_LAYER_TYPES = (LocalSelfAttention2d, AugmentedConv2d, SpatiallyAwareAttentionStem, HaloSelfAttention2d)

#: Default cap on the query pixels evaluated per image and layer.
DEFAULT_MAX_QUERIES = 4096


@dataclass(frozen=True)
class AttentionStats:
    """Attention statistics of one layer on one input.

    Attributes:
        perplexity: mean over images, heads and the evaluated query pixels of
            ``exp(-sum_j p_j log p_j)`` (``0 log 0 = 0``), in ``[1, keys]`` per query.
        keys: mean over the same query pixels of the number of keys they can attend to (in-map
            keys of their window / block, or the whole attention grid for AA): the perplexity of
            uniform attention.
        queries: query pixels evaluated per image.
    """

    perplexity: float
    keys: float
    queries: int


def _spread(n: int, m: int) -> torch.Tensor:
    """``min(n, m)`` indices in ``[0, n)``, evenly spread (centres of ``m`` equal strata)."""
    if m >= n:
        return torch.arange(n)
    return ((torch.arange(m, dtype=torch.float64) + 0.5) * (n / m)).floor().long()


def _perplexities(probs: torch.Tensor, key_dims: Tuple[int, ...]) -> torch.Tensor:
    """Per-query ``exp(entropy)`` of ``probs`` over its ``key_dims`` (reduced); keys of
    probability 0 contribute 0 (``torch.special.entr(0) = 0``)."""
    return torch.special.entr(probs).sum(dim=key_dims).exp()


def _window_keys(n: int, r: int, idx: torch.Tensor) -> torch.Tensor:
    """In-map extent of the ``2r + 1`` window centred on each position ``idx`` of a side ``n``."""
    return (idx + r).clamp(max=n - 1) - (idx - r).clamp(min=0) + 1


@torch.no_grad()
def local_attention_perplexity(
    module: LocalSelfAttention2d, x: torch.Tensor, max_queries: int = DEFAULT_MAX_QUERIES
) -> AttentionStats:
    """Perplexity of a SASA layer's local attention on input ``x`` (see :class:`AttentionStats`).

    Queries and keys are the layer's own (:meth:`LocalSelfAttention2d.queries_keys`: sine
    encoding, head split, ``dkh ** -0.5`` scaling), the probabilities those of
    :func:`~aadet.layers.functional.local_attention_probs_2d` (windows clipped to the map: an
    interior query has ``k^2`` keys, a corner one ``(r + 1)^2``).

    Large maps are subsampled by whole rows: at most ``max(1, max_queries // W)`` query rows,
    evenly spread, each computed exactly on the band of rows its windows reach (``r`` above and
    below, clipped to the map, so the border masks are the map's).

    Args:
        module: the layer.
        x: ``[B, in_channels, H, W]`` its input.
        max_queries: cap on the query pixels per image (rounded to whole rows, at least one).
    """
    q, k = module.queries_keys(x)  # [B, Nh, H, W, dkh]
    h, w = q.shape[2:4]
    ks, r = module.kernel_size, module.kernel_size // 2
    rows = _spread(h, max(1, max_queries // w))

    def probs_of(lo: int, hi: int) -> torch.Tensor:  # [B, Nh, hi - lo, W, k, k]
        return local_attention_probs_2d(q[:, :, lo:hi], k[:, :, lo:hi], module.rel_h, module.rel_w, ks)

    if len(rows) == h:
        perplexity = _perplexities(probs_of(0, h), (-2, -1))  # [B, Nh, H, W]
    else:
        parts = []
        for y in rows.tolist():
            lo, hi = max(0, y - r), min(h, y + r + 1)
            parts.append(_perplexities(probs_of(lo, hi)[:, :, y - lo], (-2, -1)))  # [B, Nh, W]
        perplexity = torch.stack(parts, dim=2)  # [B, Nh, rows, W]
    keys = _window_keys(h, r, rows)[:, None] * _window_keys(w, r, torch.arange(w))[None, :]
    return AttentionStats(float(perplexity.mean()), float(keys.double().mean()), len(rows) * w)


@torch.no_grad()
def augmented_attention_perplexity(
    module: AugmentedConv2d, x: torch.Tensor, max_queries: int = DEFAULT_MAX_QUERIES
) -> AttentionStats:
    """Perplexity of an AA layer's global attention on input ``x`` (see :class:`AttentionStats`).

    The probabilities are :meth:`AugmentedConv2d.attention_maps` (the layer's pooling, position
    encoding, scaling and relative logits); every query sees all ``h * w`` positions of the
    attention grid (:meth:`AugmentedConv2d.attention_grid_size`). At most ``max_queries`` query
    positions, evenly spread over the grid in row-major order, are evaluated.

    Args:
        module: the layer.
        x: ``[B, in_channels, H, W]`` its input.
        max_queries: cap on the query positions per image.
    """
    h, w = module.attention_grid_size(x.shape[-2], x.shape[-1])
    flat = _spread(h * w, max_queries).to(x.device)
    query_yx = torch.stack([flat // w, flat % w], dim=1)  # [P, 2]
    probs = module.attention_maps(x, query_yx)  # [B, Nh, P, h, w]
    perplexity = _perplexities(probs, (-2, -1))
    return AttentionStats(float(perplexity.mean()), float(h * w), len(flat))


@torch.no_grad()
def stem_attention_perplexity(
    module: SpatiallyAwareAttentionStem, x: torch.Tensor, max_queries: int = DEFAULT_MAX_QUERIES
) -> AttentionStats:
    """Perplexity of the SASA attention stem's block attention on input ``x`` (see
    :class:`AttentionStats`): each in-map pixel attends to the in-map pixels of its
    ``b x b`` block (:meth:`SpatiallyAwareAttentionStem.attention_probs`).

    At most ``max(1, max_queries // b^2)`` blocks per image, evenly spread, are evaluated (blocks
    are independent, so this is exact); pixels outside the map are not counted as queries.

    Args:
        module: the stem.
        x: ``[B, in_channels, H, W]`` its input.
        max_queries: cap on the query pixels per image (rounded to whole blocks).
    """
    bsz, _, h, w = x.shape
    s = module.block_size
    per_image = -(-h // s) * -(-w // s)
    chosen = _spread(per_image, max(1, max_queries // (s * s)))  # [n] blocks of one image
    blocks = (torch.arange(bsz)[:, None] * per_image + chosen[None, :]).flatten().to(x.device)
    probs = module.attention_probs(x, blocks)  # [B * n, Nh, P, P]
    perplexity = _perplexities(probs, (-1,))  # [B * n, Nh, P]
    mask = block_padding_mask((h, w), s, x.device)  # [blocks, 1, 1, P], True outside the map
    if mask is None:
        valid = torch.ones(len(chosen), s * s, dtype=torch.bool, device=x.device)
    else:
        valid = ~mask.view(per_image, s * s)[chosen.to(x.device)]  # [n, P]
    keys = valid.sum(-1, keepdim=True).expand_as(valid)[valid]  # per in-map query pixel
    per_query = perplexity.view(bsz, len(chosen), -1, s * s)  # [B, n, Nh, P]
    per_query = per_query.permute(0, 2, 1, 3)[..., valid]  # [B, Nh, in-map queries]
    return AttentionStats(float(per_query.mean()), float(keys.double().mean()), int(valid.sum()))


@torch.no_grad()
def halo_attention_perplexity(
    module: HaloSelfAttention2d, x: torch.Tensor, max_queries: int = DEFAULT_MAX_QUERIES
) -> AttentionStats:
    """Perplexity of a HaloNet layer's blocked attention on input ``x`` (see
    :class:`AttentionStats`): query ``(y', x')`` (at pixel ``(s y', s x')``) attends to the
    in-map keys of its block's ``(b + 2h)^2`` window (:meth:`HaloSelfAttention2d.queries_keys`
    with :func:`~aadet.layers.functional.halo_attention_probs_2d`, keys outside the map at 0).

    Large maps are subsampled by whole query rows, at most ``max(1, max_queries // Wo)`` of them,
    evenly spread: each is computed on the band of key rows its block's window reaches, cut at
    block boundaries so the blocks, the halo and the map's border masks are the map's own.

    Args:
        module: the layer.
        x: ``[B, in_channels, H, W]`` its input.
        max_queries: cap on the query pixels per image (rounded to whole rows, at least one).
    """
    q, k = module.queries_keys(x)  # [B, Nh, Ho, Wo, dkh], [B, Nh, H, W, dkh]
    (ho, wo), (h, w) = q.shape[2:4], k.shape[2:4]
    b, hs, s = module.block_size, module.halo_size, module.stride
    rows = _spread(ho, max(1, max_queries // wo))

    def window(n: int, start: torch.Tensor) -> torch.Tensor:  # in-map keys of windows at start
        return (start + b + hs).clamp(max=n) - (start - hs).clamp(min=0)

    if len(rows) == ho:
        probs = halo_attention_probs_2d(q, k, module.rel_h, module.rel_w, b, hs, query_stride=s)
        perplexity = _perplexities(probs, (-2, -1))  # [B, Nh, Ho, Wo]
    else:
        parts = []
        for yo in rows.tolist():
            top = (s * yo) // b * b  # first row of the query's block
            # Key rows [lo, hi): lo on a block boundary (so the band's blocks are the map's) at
            # or above the window's top (clipped to the map), hi its bottom (clipped): the
            # window of row yo is the same in the band as in the map. lo / s is a query row.
            lo, hi = max(0, top - hs) // b * b, min(h, top + b + hs)
            band_q, band_k = q[:, :, lo // s:-(-hi // s)], k[:, :, lo:hi]
            probs = halo_attention_probs_2d(band_q, band_k, module.rel_h, module.rel_w, b, hs, query_stride=s)
            parts.append(_perplexities(probs[:, :, yo - lo // s], (-2, -1)))  # [B, Nh, Wo]
        perplexity = torch.stack(parts, dim=2)  # [B, Nh, rows, Wo]
    ys = (s * rows) // b * b
    xs = (s * torch.arange(wo)) // b * b
    keys = window(h, ys)[:, None] * window(w, xs)[None, :]
    return AttentionStats(float(perplexity.mean()), float(keys.double().mean()), len(rows) * wo)


_PERPLEXITY_FNS: Dict[type, Callable[..., AttentionStats]] = {
    LocalSelfAttention2d: local_attention_perplexity,
    AugmentedConv2d: augmented_attention_perplexity,
    SpatiallyAwareAttentionStem: stem_attention_perplexity,
    HaloSelfAttention2d: halo_attention_perplexity,
}


def attention_perplexity(
    module: nn.Module, x: torch.Tensor, max_queries: int = DEFAULT_MAX_QUERIES
) -> AttentionStats:
    """:func:`local_attention_perplexity`, :func:`augmented_attention_perplexity`,
    :func:`stem_attention_perplexity` or :func:`halo_attention_perplexity`, by the type of ``module`` (one of
    :data:`ATTENTION_LAYER_TYPES`); ``x [B, C, H, W]`` is its input."""
    for cls, fn in _PERPLEXITY_FNS.items():
        if isinstance(module, cls):
            return fn(module, x, max_queries)
    raise TypeError(
        f"attention_perplexity covers {[c.__name__ for c in ATTENTION_LAYER_TYPES]}; "
        f"got {type(module).__name__}"
    )


def attention_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """The attention layers of ``model`` (:data:`ATTENTION_LAYER_TYPES`) by module path, in
    ``named_modules`` order. A ``DistributedDataParallel`` / ``DataParallel`` wrapper is looked
    through, so the names are those of the bare model (no ``module.`` prefix)."""
    return {
        name: m for name, m in unwrap_model(model).named_modules()
        if isinstance(m, ATTENTION_LAYER_TYPES)
    }


# ---------------------------------------------------------------- gradient / weight ratios
def _projection_rows(module: nn.Module) -> Dict[str, Tuple[torch.Tensor, Optional[slice]]]:
    """``{"query" | "value": (weight parameter, output rows or None for all)}`` of a layer."""
    if isinstance(module, (LocalSelfAttention2d, HaloSelfAttention2d)):
        return {"query": (module.query.weight, None), "value": (module.value.weight, None)}
    if isinstance(module, AugmentedConv2d):  # one 1x1 conv, output rows k | q | v
        dk, dv = module.dk, module.dv
        w = module.qkv.weight
        return {"query": (w, slice(dk, 2 * dk)), "value": (w, slice(2 * dk, 2 * dk + dv))}
    if isinstance(module, SpatiallyAwareAttentionStem):
        return {"query": (module.query.weight, None), "value": (module.value_weight, None)}
    return {}


def _norms(weight: torch.Tensor, grad: torch.Tensor) -> Tuple[float, float]:
    """Squared norms ``(||grad||^2, ||weight||^2)`` in float64."""
    return float(grad.double().square().sum()), float(weight.double().square().sum())


def _table_norms(table: torch.Tensor) -> Tuple[float, float]:
    """Squared norms ``(||grad||^2, ||weight||^2)`` of a relative table ``[offsets, d]`` over the
    rows whose gradient is not exactly 0 (the offsets the input produced)."""
    grad = table.grad.reshape(table.shape[0], -1)
    used = grad.ne(0).any(dim=1)
    return _norms(table.detach().reshape(table.shape[0], -1)[used], grad[used])


def _ratio(grad_sq: float, weight_sq: float) -> float:
    if weight_sq > 0:
        return math.sqrt(grad_sq / weight_sq)
    return math.inf if grad_sq > 0 else 0.0


def relative_embedding_grad_ratios(model: nn.Module) -> Dict[str, float]:
    """``||grad|| / ||weight||`` of the attention layers' parameters, read from ``.grad``.

    For every layer of :func:`attention_layers` (keys ``"<layer path>/<name>"``):

    * ``rel_h``, ``rel_w``: each relative table, over the rows (offsets) whose gradient is not
      exactly 0: AA's tables are sized for ``MAX_INPUT_SIZE`` and an ``h x w`` map uses only
      their centre ``2h - 1`` / ``2w - 1`` rows (likewise a SASA window larger than the map), so
      the unused rows would only dilute the ratio;
    * ``rel``: both tables together (``sqrt(sum ||g||^2 / sum ||w||^2)`` over those rows);
    * ``query``, ``value``: the query and value projection weights for comparison
      (``LocalSelfAttention2d`` / ``HaloSelfAttention2d.query/value.weight``, the q / v output rows of
      ``AugmentedConv2d.qkv.weight``, ``SpatiallyAwareAttentionStem.query.weight`` /
      ``value_weight``).

    Parameters without ``.grad`` (frozen, not used, or before the first backward) are left out.
    A zero weight gives ``inf`` (0 for a zero gradient).
    """
    out: Dict[str, float] = {}
    for name, module in attention_layers(model).items():
        rel: List[Tuple[float, float]] = []
        for attr in RELATIVE_EMBEDDING_NAMES:
            table = getattr(module, attr, None)
            if table is not None and table.grad is not None:
                rel.append(_table_norms(table))
                out[f"{name}/{attr}"] = _ratio(*rel[-1])
        if rel:
            out[f"{name}/rel"] = _ratio(sum(g for g, _ in rel), sum(w for _, w in rel))
        for key, (weight, rows) in _projection_rows(module).items():
            if weight.grad is not None:
                rows = slice(None) if rows is None else rows
                out[f"{name}/{key}"] = _ratio(*_norms(weight.detach()[rows], weight.grad[rows]))
    return out


# ---------------------------------------------------------------- forward hooks
class AttentionStatsCollector:
    """Perplexity of every attention layer of a model on the input it receives in a forward pass.

    While active (:meth:`start` ... :meth:`stop`, or as a context manager) a forward hook on each
    layer of :func:`attention_layers` computes :func:`attention_perplexity` of the first
    ``images`` images of the layer's input (under ``torch.no_grad()``) at the layer's first call
    only (a layer called again in the same pass, such as the RetinaNet head's towers shared by
    the FPN levels, is measured on its first input: P3). Nothing is kept but the numbers::

        collector = AttentionStatsCollector(model)
        with collector:
            model(batch)
        collector.stats  # {"backbone.bottom_up.res2.0.conv2": AttentionStats(...), ...}

    Args:
        model: any ``nn.Module`` (a DDP wrapper is looked through).
        max_queries: per layer and image, see :func:`attention_perplexity`.
        images: how many images of the batch to evaluate (the first ones).
    """

    def __init__(self, model: nn.Module, max_queries: int = DEFAULT_MAX_QUERIES, images: int = 1):
        self.layers = attention_layers(model)
        self.max_queries = max_queries
        self.images = images
        self.stats: Dict[str, AttentionStats] = {}
        self._handles: List[torch.utils.hooks.RemovableHandle] = []

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._handles)

    def start(self) -> "AttentionStatsCollector":
        """Clear :attr:`stats` and install the hooks (if not installed)."""
        self.stats = {}
        if not self._handles:
            self._handles = [
                m.register_forward_hook(self._hook(name)) for name, m in self.layers.items()
            ]
        return self

    def stop(self) -> Dict[str, AttentionStats]:
        """Remove the hooks; returns :attr:`stats`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return self.stats

    def __enter__(self) -> "AttentionStatsCollector":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs, output) -> None:
            if name in self.stats:
                return
            x = inputs[0][: self.images].detach()
            self.stats[name] = attention_perplexity(module, x, self.max_queries)

        return hook
