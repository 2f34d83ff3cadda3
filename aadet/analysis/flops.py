"""FLOP counting for aadet models: fvcore for convolutions, the papers' formulas for attention.

fvcore's ``FlopCountAnalysis`` traces a model and counts the ops it has handlers for. It has none
for ``scaled_dot_product_attention`` (where our attention runs), and what it does see inside an
attention layer (the matmuls building relative-logit tables, the one-hot einsums moving them to
window coordinates, a halo window's extra keys) is implementation, not the work the papers
count. So attention layers are counted *at module level*, by formula:

Convention
----------
* **Unit**: multiply-accumulates (MACs, fvcore's "flop"). The papers' FLOPs are 2 per MAC
  (:attr:`FlopReport.paper_gflops`): the conv RetinaNet R50 at 640x640 counts 95.1 GMACs =
  190.3 GFLOPs here, 182 in both papers (``docs/model_table.md`` lists every config).
* **Counted**: convolutions (bias not counted), linear/matmul/bmm/einsum ops, and attention as
  below. **Not counted**: norms, activations, elementwise adds, pooling, upsampling, softmax,
  pre-processing, anchors and post-processing: :func:`detector_flops` traces the network from
  the normalized image tensor to the head's outputs.
* **Attention layers** (:class:`~aadet.layers.AugmentedConv2d`,
  :class:`~aadet.layers.LocalSelfAttention2d`, :class:`~aadet.layers.HaloSelfAttention2d`,
  :class:`~aadet.layers.SpatiallyAwareAttentionStem`, :class:`~aadet.layers.CrissCrossAttention2d`):
  their child ``nn.Conv2d`` modules
  (q/k/v projections, AA's output projection and conv branch) are counted by fvcore like any
  convolution. Every other op inside the layer is replaced by the algorithmic count of
  :func:`attention_flops`, per call (a head layer shared by five levels counts five times): the
  layer's own ``flop_count`` (where its formula is written and explained), restricted to its
  ``ATTENTION_FLOP_COMPONENTS``. In short: AA each query against all ``h w`` keys of its grid,
  the SASA layer each query against its ``k x k`` neighbours (as for a zero-padded convolution),
  the HaloNet layer each query against its block's whole ``(b + 2h)^2`` window,
  the stem its ``b x b`` block plus its value mixture and projections, CCNet's criss-cross
  block each pixel against the ``H + W - 1`` pixels of its column and row.

* **Overhead** (reported separately, never in the totals): the extra multiply-adds of our
  implementation's fused (CUDA) path -- blocked queries and halo windows (SASA), the position
  tables appended to ``q`` and the one-hot indicators appended to ``k`` (AA), the offset table
  matmuls; for the stem the extra work of the route it takes. The CPU routes of the SASA layer
  and of AA (C++ kernels) have none. Estimated by each layer's ``implementation_flop_count``
  (:func:`attention_overhead_flops`).
"""

import dataclasses
import math
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from fvcore.nn import FlopCountAnalysis
from torch import nn

from ..layers.attention_stem import SpatiallyAwareAttentionStem
from ..layers.augmented_conv import AugmentedConv2d
from ..layers.criss_cross import CrissCrossAttention2d
from ..layers.halo_attention import HaloSelfAttention2d
from ..layers.local_attention import LocalSelfAttention2d

__all__ = [
    "ATTENTION_TYPES",
    "FlopReport",
    "attention_flops",
    "attention_overhead_flops",
    "count_flops",
    "detector_flops",
    "flop_breakdown",
    "DetectorNetwork",
]

#: The layers counted by formula (an instance nested in another is counted by the outer one).
ATTENTION_TYPES = (
    AugmentedConv2d, LocalSelfAttention2d, HaloSelfAttention2d, SpatiallyAwareAttentionStem, CrissCrossAttention2d
)

# Ops that fvcore would warn about and that this convention does not count (see the module
# docstring): norms, elementwise arithmetic, pooling, upsampling, softmax, post-processing.
_NOT_COUNTED_OPS = (
    "aten::add",
    "aten::add_",
    "aten::sub",
    "aten::sub_",
    "aten::rsub",
    "aten::mul",
    "aten::mul_",
    "aten::div",
    "aten::div_",
    "aten::neg",
    "aten::reciprocal",
    "aten::sqrt",
    "aten::exp",
    "aten::log2",
    "aten::sigmoid",
    "aten::sigmoid_",
    "aten::softmax",
    "aten::log_softmax",
    "aten::batch_norm",
    "aten::group_norm",
    "aten::layer_norm",
    "aten::instance_norm",
    "aten::max_pool2d",
    "aten::avg_pool2d",
    "aten::adaptive_avg_pool2d",
    "aten::upsample_nearest2d",
    "aten::upsample_bilinear2d",
    "aten::pad",
    "aten::one_hot",
    "aten::where",
    "aten::repeat",
    "aten::repeat_interleave",
    "aten::unfold",
    "aten::sum",
    "aten::mean",
    "aten::lt",
    "aten::le",
    "aten::ne",
    "aten::argmax",
    "aten::argsort",
    "aten::sort",
    "aten::topk",
    "aten::meshgrid",
    "aten::nonzero_numpy",
    "aten::index_select",
    "aten::linspace",
    "aten::sin",
    "aten::cos",
    "aten::pow",
    "aten::cumsum",
    "aten::scatter",
    "aten::fill_",
    "aten::zero_",
    "aten::clone",
    "aten::view_as",
    "aten::abs",
    "aten::lift_fresh",
    "aten::alias",
    "aten::frobenius_norm",
    "aten::linalg_vector_norm",
    "torchvision::nms",
)

# Names under which a trace records scaled dot-product attention (public op and CPU/CUDA
# kernels). Counted wherever they appear outside the attention layers (which are counted by
# formula instead): ``Lq * Lk * (d + dv)`` per batch element and head.
_SDPA_OPS = (
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_attention_math",
)


def _shape(value) -> List[int]:
    return list(value.type().sizes())


def sdpa_flop_jit(inputs, outputs) -> int:
    """fvcore handle for SDPA: ``q [*, Lq, d]``, ``k [*, Lk, d]``, ``v [*, Lk, dv]`` ->
    ``prod(*) * Lq * Lk * (d + dv)`` MACs (logits and weighted sum)."""
    q, k, v = _shape(inputs[0]), _shape(inputs[1]), _shape(inputs[2])
    batch = math.prod(q[:-2])
    return int(batch * q[-2] * k[-2] * (q[-1] + v[-1]))


# ----------------------------------------------------------------------------- formulas
def _batch_and_hw(module: nn.Module, input_shape: Sequence[int], caller: str):
    if len(input_shape) != 4:
        raise ValueError(f"input_shape must be [B, C, H, W]; got {tuple(input_shape)}")
    if not isinstance(module, ATTENTION_TYPES):
        raise TypeError(
            f"{caller} counts {[t.__name__ for t in ATTENTION_TYPES]}; got {type(module).__name__}"
        )
    b, _, h, w = (int(v) for v in input_shape)
    return b, (h, w)


def attention_flops(module: nn.Module, input_shape: Sequence[int]) -> Dict[str, int]:
    """Algorithmic attention MACs of one call of an attention layer (see the module docstring).

    The layer's ``flop_count`` restricted to its ``ATTENTION_FLOP_COMPONENTS`` (its child
    convolutions are counted by fvcore). Args: ``module`` one of :data:`ATTENTION_TYPES`;
    ``input_shape`` ``[B, C, H, W]`` of its input. Returns the components and their ``"total"``.
    """
    batch, hw = _batch_and_hw(module, input_shape, "attention_flops")
    counts = module.flop_count(hw, batch=batch)
    out = {key: counts[key] for key in module.ATTENTION_FLOP_COMPONENTS}
    out["total"] = sum(out.values())
    return out


def attention_overhead_flops(module: nn.Module, input_shape: Sequence[int]) -> int:
    """MACs our fused implementation does beyond :func:`attention_flops` (an estimate): the
    layer's ``implementation_flop_count`` minus the formula, at least 0."""
    batch, hw = _batch_and_hw(module, input_shape, "attention_overhead_flops")
    implemented = module.implementation_flop_count(hw, batch=batch)
    return max(0, implemented - attention_flops(module, input_shape)["total"])


# ----------------------------------------------------------------------------- counting
@dataclasses.dataclass
class FlopReport:
    """MACs of one traced forward (see the module docstring for the convention).

    Attributes:
        total: all counted MACs.
        by_module: corrected MACs per module name (fvcore's names, ``""`` = the whole model),
            attention counted by formula.
        attention: MACs of the attention formulas (included in ``total``).
        attention_by_component: e.g. ``{"content_logits": ..., "weighted_sum": ...}``.
        overhead: extra MACs of our implementation (not included in ``total``).
        unsupported_ops: ops fvcore could not count outside attention layers, with their
            number of occurrences (should be empty for aadet models).
        attention_calls: ``(module name, input shape)`` of every attention-layer call.
        input_size: ``(H, W)`` of the traced image where known (:func:`detector_flops`).
    """

    total: int
    by_module: Dict[str, int]
    attention: int
    attention_by_component: Dict[str, int]
    overhead: int
    unsupported_ops: Dict[str, int]
    attention_calls: List[Tuple[str, Tuple[int, ...]]]
    input_size: Optional[Tuple[int, int]] = None

    @property
    def gmacs(self) -> float:
        """Total in 1e9 multiply-adds (fvcore's "GFLOPs")."""
        return self.total / 1e9

    @property
    def paper_gflops(self) -> float:
        """Total in the papers' GFLOPs: 2 per multiply-add."""
        return 2 * self.total / 1e9

    def module_total(self, name: str) -> int:
        """Corrected MACs of module ``name`` and its descendants."""
        return self.by_module.get(name, 0)


def _outermost_attention_modules(model: nn.Module) -> Dict[str, nn.Module]:
    found: Dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, ATTENTION_TYPES):
            continue
        if any(p == "" or name.startswith(p + ".") for p in found):
            continue
        found[name] = mod
    return found


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _self_and_ancestors(name: str) -> List[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b", "a.b.c"]``; ``""`` -> ``[""]``."""
    if not name:
        return [""]
    parts = name.split(".")
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def _is_counted_child(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Conv2d)


def count_flops(model: nn.Module, inputs, *, warn_unsupported: bool = False) -> FlopReport:
    """Trace ``model(*inputs)`` with fvcore and count MACs with attention by formula.

    Args:
        model: any module (in eval mode for a deterministic trace); attention layers anywhere.
        inputs: a tensor or a tuple of tensors, as for ``FlopCountAnalysis``.
        warn_unsupported: let fvcore log the ops it skipped.

    Returns:
        :class:`FlopReport`.
    """
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    attn_modules = _outermost_attention_modules(model)
    calls: List[Tuple[str, Tuple[int, ...]]] = []
    handles = []
    for name, mod in attn_modules.items():

        def hook(_mod, args, _name=name):
            calls.append((_name, tuple(int(s) for s in args[0].shape)))

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        fca = FlopCountAnalysis(model, inputs)
        fca.set_op_handle(**{op: None for op in _NOT_COUNTED_OPS})
        fca.set_op_handle(**{op: sdpa_flop_jit for op in _SDPA_OPS})
        fca.unsupported_ops_warnings(warn_unsupported)
        fca.uncalled_modules_warnings(False)
        fca.tracer_warnings("none")
        with torch.no_grad():
            raw = dict(fca.by_module())
        unsupported_all = fca.unsupported_ops("")
        unsupported_inside = Counter()
        for name in attn_modules:
            unsupported_inside.update(fca.unsupported_ops(name))
    finally:
        for h in handles:
            h.remove()

    by_module = dict(raw)
    attention_total = 0
    components: Counter = Counter()
    overhead = 0
    for name, shape in calls:
        mod = attn_modules[name]
        f = attention_flops(mod, shape)
        attention_total += f["total"]
        components.update({k: v for k, v in f.items() if k != "total"})
        overhead += attention_overhead_flops(mod, shape)
    # Replace what fvcore saw inside each attention layer (minus its child convs) by the formula.
    for name, mod in attn_modules.items():
        kept = sum(
            raw.get(_join(name, c), 0)
            for c, child in mod.named_children()
            if _is_counted_child(child)
        )
        formula = sum(attention_flops(mod, s)["total"] for n, s in calls if n == name)
        delta = formula + kept - raw.get(name, 0)
        for anc in _self_and_ancestors(name):
            if anc in by_module:
                by_module[anc] += delta
    # Unsupported ops outside attention layers (inside them nothing fvcore saw is kept).
    unsupported = {
        k: c - unsupported_inside[k]
        for k, c in unsupported_all.items()
        if c > unsupported_inside[k]
    }
    return FlopReport(
        total=int(by_module.get("", 0)),
        by_module={k: int(v) for k, v in by_module.items()},
        attention=int(attention_total),
        attention_by_component=dict(components),
        overhead=int(overhead),
        unsupported_ops=unsupported,
        attention_calls=calls,
    )


class DetectorNetwork(nn.Module):
    """The network of a one-stage detector as a tensor function: ``head(backbone(x))``.

    ``x [B, 3, H, W]`` (already normalized) -> the head's outputs for ``in_features``. Module
    names under it are the detector's (``backbone.bottom_up.res3.0.conv2``, ``head.*``).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        for attr in ("backbone", "head", "head_in_features"):
            if not hasattr(model, attr):
                raise TypeError(
                    f"DetectorNetwork needs a RetinaNet-like model with .backbone, .head and "
                    f".head_in_features; {type(model).__name__} has no .{attr}"
                )
        self.backbone = model.backbone
        self.head = model.head
        self.in_features = list(model.head_in_features)

    def forward(self, x):
        features = self.backbone(x)
        return self.head([features[f] for f in self.in_features])


def detector_flops(
    model: nn.Module, height: int = 640, width: int = 640, batch: int = 1
) -> FlopReport:
    """:func:`count_flops` of a RetinaNet-like detector's network at ``height x width``.

    The image is random (FLOPs do not depend on its values); pre-processing, anchors and
    post-processing are not part of the network and are not counted. Like Detectron2's
    pre-processing, the input is padded to a multiple of ``backbone.size_divisibility`` (400 ->
    416 for an FPN); :attr:`FlopReport.input_size` is the padded size. ``by_module`` names:
    ``backbone.bottom_up`` (ResNet), ``backbone`` (ResNet + FPN), ``head``.
    """
    net = DetectorNetwork(model).eval()
    device = next(model.parameters()).device
    div = max(1, int(getattr(model.backbone, "size_divisibility", 1) or 1))
    h, w = -(-height // div) * div, -(-width // div) * div
    x = torch.randn(batch, 3, h, w, device=device)
    report = count_flops(net, (x,))
    report.input_size = (h, w)
    return report


def flop_breakdown(report: FlopReport) -> Dict[str, int]:
    """``{"backbone", "fpn", "head", "total"}`` MACs of a :func:`detector_flops` report."""
    backbone = report.module_total("backbone.bottom_up")
    return {
        "backbone": backbone,
        "fpn": report.module_total("backbone") - backbone,
        "head": report.module_total("head"),
        "total": report.total,
    }
