"""SASA's attentional RetinaNet head: local self-attention in the classification/box towers.

Paper: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019,
Section 4.2 / Table 2. :class:`AttentionRetinaNetHead` is Detectron2's ``RetinaNetHead`` with
every 3x3 convolution of ``cls_subnet`` and ``bbox_subnet`` replaced by a
:class:`~aadet.layers.local_attention.LocalSelfAttention2d` standing in for it
(:func:`~aadet.modeling.attention_layers.local_attention_for_conv`, keys read by
:func:`~aadet.modeling.attention_layers.sasa_layer_kwargs`, its window
``MODEL.SASA.HEAD_KERNEL_SIZE``); the towers' norms (incl. Detectron2's per-level
``CycleBatchNormList``) and ReLUs stay. Selected by ``MODEL.RETINANET.HEAD_NAME =
"AttentionRetinaNetHead"`` (meta-architecture ``AADetRetinaNet``).

The final prediction layers ``cls_score``/``bbox_pred`` stay 3x3 convolutions. That is what the
paper's parameter count implies: the attentional FPN and heads remove 3.9M parameters (Table 2,
25.9M -> 22.0M); the eight tower layers plus the FPN's three output layers remove 4.32M
(0.393M each), and turning the prediction layers into attention as well would remove another
1.16M (``cls_score`` 256 -> 9 x 80: 1.66M as a conv, 0.55M as attention; ``bbox_pred`` 0.06M),
far from the paper. They are also the layers whose outputs are per-anchor logits, where a
content-weighted average of neighbours has no obvious meaning.

Initialisation follows the head's convention where it makes sense: value projections
``N(0, 0.01)`` and biases 0 (as Detectron2 does for every tower conv), so the towers start as
small as the conv towers do; queries, keys and relative embeddings keep
``LocalSelfAttention2d``'s variance-preserving defaults (``N(0, 0.01)`` there would make every
window's softmax uniform and its gradients vanish). The classification prior bias of
``cls_score`` is untouched. Tower attention layers keep a bias, as the convolutions had one.
"""
import torch
from detectron2.config import configurable
from detectron2.modeling.meta_arch.retinanet import RetinaNetHead
from torch import nn

from ..layers.local_attention import ATTENTION_OPTIONS
from .attention_layers import local_attention_for_conv, sasa_layer_kwargs
from .meta_arch.retinanet import RETINANET_HEAD_REGISTRY

__all__ = ["AttentionRetinaNetHead"]


def _head_value_init(value: nn.Conv2d):
    """The head's tower init (Detectron2's RetinaNetHead): ``N(0, 0.01)``."""
    torch.nn.init.normal_(value.weight, mean=0, std=0.01)


@RETINANET_HEAD_REGISTRY.register()
class AttentionRetinaNetHead(RetinaNetHead):
    """``RetinaNetHead`` whose tower convs are local self-attention (prediction convs kept).

    Takes ``RetinaNetHead``'s arguments plus any of the attention options of
    :class:`~aadet.layers.LocalSelfAttention2d` (:data:`~aadet.layers.local_attention.ATTENTION_OPTIONS`:
    ``kernel_size``, ``num_heads``, ``positional_encoding``, ``block_size``, ``impl``, ...; the
    layer's defaults for those not given). ``forward(features)`` is unchanged: per level
    ``[B, C, Hi, Wi]`` -> ``(logits [B, A*K, Hi, Wi], bbox_reg [B, A*4, Hi, Wi])``.
    """

    @configurable
    def __init__(self, **kwargs):
        attention = {name: kwargs.pop(name) for name in ATTENTION_OPTIONS if name in kwargs}
        super().__init__(**kwargs)
        for tower in (self.cls_subnet, self.bbox_subnet):
            for i, layer in enumerate(tower):
                if isinstance(layer, nn.Conv2d):
                    # bias (if any) starts at 0, as LocalSelfAttention2d's does and the towers' do
                    tower[i] = local_attention_for_conv(layer, _head_value_init, **attention)

    @classmethod
    def from_config(cls, cfg, input_shape):
        ret = super().from_config(cfg, input_shape)
        ret.update(sasa_layer_kwargs(cfg), kernel_size=cfg.MODEL.SASA.HEAD_KERNEL_SIZE)
        return ret
