"""SASA's attentional FPN: the FPN's spatial convolutions become local self-attention.

Paper: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019,
Section 4.2 / Table 2 ("Attention" FPN and detection heads). The FPN's spatial layers are the
3x3 output convolutions after each top-down merge (``fpn_output{stage}``) and RetinaNet's
stride-2 3x3 convolutions making P6/P7 (``top_block.p6/p7`` of ``LastLevelP6P7``). Following
Section 3.1, each becomes a :class:`~aadet.layers.local_attention.LocalSelfAttention2d` (a strided one is
attention followed by 2x2 average pooling). The lateral 1x1 convolutions stay.

Which of them are replaced (``MODEL.FPN.SPATIAL_LAYER = "attention"``): the output convolutions
only; P6/P7 stay convolutional. This is the choice that reproduces the paper's parameter count
(Table 2: attentional FPN + heads remove 3.9M parameters, 25.9M -> 22.0M): replacing the three
output convolutions and the eight tower convolutions of the head removes 4.32M, replacing P6/P7
as well would remove 5.11M (each 256->256 3x3 conv -> attention removes 0.393M). (The other
ten-layer split -- P6/P7 and the towers as attention, the output convolutions kept -- removes
3.93M, the paper's figure to the digit, but leaves the FPN proper convolutional.) The plain
function :func:`convert_fpn_to_attention` replaces P6/P7 too when asked (``top_block=True``,
``MODEL.FPN.ATTENTION_TOP_BLOCK``).

Detectron2's ``FPN`` keeps Python lists ``output_convs``/``lateral_convs`` that alias its
registered ``fpn_output{k}``/``fpn_lateral{k}`` modules; a replacement updates both. Each new layer
is :func:`~aadet.modeling.attention_layers.local_attention_for_conv` of the old convolution (its
norm, activation, bias), its value projection initialised like the FPN's convolutions
(``c2_xavier_fill``), queries/keys with ``LocalSelfAttention2d``'s default.
"""
import fvcore.nn.weight_init as weight_init
from detectron2.config import configurable
from detectron2.modeling.backbone.fpn import FPN, LastLevelP6P7

from ..attention_layers import local_attention_for_conv, sasa_layer_kwargs
from .fpn import FPN_SPATIAL_LAYER_REGISTRY

__all__ = ["convert_fpn_to_attention"]


def _replace_aliases(seq, old, new):
    for i, m in enumerate(seq):
        if m is old:
            seq[i] = new


def _attention_fpn_from_config(cfg, fpn: FPN):
    """``MODEL.FPN.ATTENTION_TOP_BLOCK`` and the ``MODEL.SASA`` layer keys
    (:func:`~aadet.modeling.attention_layers.sasa_layer_kwargs`)."""
    return dict(fpn=fpn, top_block=cfg.MODEL.FPN.ATTENTION_TOP_BLOCK, **sasa_layer_kwargs(cfg))


@FPN_SPATIAL_LAYER_REGISTRY.register("attention")
@configurable(from_config=_attention_fpn_from_config)
def convert_fpn_to_attention(fpn: FPN, *, top_block: bool = False, **attention) -> FPN:
    """Replace ``fpn``'s 3x3 output convs, and its P6/P7 convs if ``top_block``, in place:
    ``MODEL.FPN.SPATIAL_LAYER = "attention"``, SASA's attentional FPN (called as ``(cfg, fpn)``,
    its arguments come from ``MODEL.FPN.ATTENTION_TOP_BLOCK`` and the ``MODEL.SASA`` layer keys).

    Returns ``fpn``. ``top_block=True`` requires a ``LastLevelP6P7`` (or no top block at all);
    another top block (e.g. ``LastLevelMaxPool``) has no convolution and is left alone.
    ``attention``: options of the :class:`~aadet.layers.LocalSelfAttention2d` layers
    (``kernel_size``, ``num_heads``, ``positional_encoding``, ``block_size``, ``impl``, ...;
    the layer's defaults for those not given).
    """
    for name, module in list(fpn.named_children()):
        if not name.startswith("fpn_output"):
            continue
        new = local_attention_for_conv(module, weight_init.c2_xavier_fill, **attention)
        setattr(fpn, name, new)
        _replace_aliases(fpn.output_convs, module, new)
    if top_block and isinstance(fpn.top_block, LastLevelP6P7):
        for name in ("p6", "p7"):
            old = getattr(fpn.top_block, name)
            new = local_attention_for_conv(old, weight_init.c2_xavier_fill, **attention)
            setattr(fpn.top_block, name, new)
    return fpn
