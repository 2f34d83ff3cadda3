"""``model``: RetinaNet over the SASA-ResNet (``build_sasa_resnet_backbone``): every spatial 3x3 conv
of res2-res5 is 7x7 local self-attention (8 heads, relative row/column embeddings), conv stem, conv
FPN and head (SASA Table 2, "Conv-stem + Attention"). The values are ``MODEL.SASA.*``'s defaults
(aadet/config.py: the papers' values; the layer options are ``LocalSelfAttention2d``'s own
defaults, read by ``sasa_layer_kwargs``), written out so that each can be overridden.

The other rows of Table 2 apply, in a twin: ``attention_stem(model)`` (the spatially-aware
attention stem), ``attention_fpn(model)`` and ``attention_head(model)`` (SASA's attentional FPN
and RetinaNet head). Their attention options follow ``model.backbone.bottom_up.attention`` (as
``MODEL.SASA.*`` drives all of them), by interpolation; the head's window is its own
(``MODEL.SASA.HEAD_KERNEL_SIZE``).
"""
from detectron2.config import LazyCall as L

from aadet.engine import get_aadet_cfg
from aadet.layers import SpatiallyAwareAttentionStem
from aadet.modeling.attention_head import AttentionRetinaNetHead
from aadet.modeling.attention_layers import sasa_layer_kwargs
from aadet.modeling.backbone import build_sasa_resnet_backbone

from .retinanet import model

_d = get_aadet_cfg()  # aadet's defaults (aadet/config.py): the values' one home
_sa = _d.MODEL.SASA

model.backbone.bottom_up._target_ = build_sasa_resnet_backbone
model.backbone.bottom_up.update(
    attention_stages=list(_sa.STAGES),  # MODEL.SASA.STAGES: res2-res5
    # MODEL.SASA.{KERNEL_SIZE, NUM_HEADS, POSITIONAL_ENCODING, BLOCK_SIZE, IMPL, RECOMPUTE_ATTENTION}
    attention=sasa_layer_kwargs(_d),
)


def _follow_backbone(path: str) -> dict:
    """The backbone's attention options by interpolation, from the node at ``path`` below ``model``."""
    up = "." * (path.count(".") + 2)
    return {k: f"${{{up}backbone.bottom_up.attention.{k}}}" for k in sasa_layer_kwargs(_d)}


def attention_stem(model):
    """MODEL.SASA.STEM "attention": the spatially-aware attention stem (MODEL.SASA.STEM_*)."""
    model.backbone.bottom_up.stem = L(SpatiallyAwareAttentionStem)(
        in_channels=3,
        out_channels=_d.MODEL.RESNETS.STEM_OUT_CHANNELS,  # MODEL.RESNETS.STEM_OUT_CHANNELS
        block_size=_sa.STEM_BLOCK_SIZE,  # MODEL.SASA.STEM_BLOCK_SIZE
        num_heads=_sa.STEM_NUM_HEADS,  # MODEL.SASA.STEM_NUM_HEADS
        num_mixtures=_sa.STEM_MIXTURES,  # MODEL.SASA.STEM_MIXTURES
        # the stem has relative logits or none ("sine2d", a trunk ablation, keeps them relative)
        positional_encoding="relative",
        norm="${..norm}",
        impl=_sa.STEM_IMPL,  # MODEL.SASA.STEM_IMPL
    )
    return model


def attention_fpn(model):
    """MODEL.FPN.SPATIAL_LAYER "attention": the FPN's 3x3 output convs as local attention."""
    model.backbone.spatial_layer = "attention"
    model.backbone.spatial_layer_options = dict(
        top_block=_d.MODEL.FPN.ATTENTION_TOP_BLOCK,  # MODEL.FPN.ATTENTION_TOP_BLOCK
        **_follow_backbone("backbone.spatial_layer_options"),
    )
    return model


def attention_head(model):
    """MODEL.RETINANET.HEAD_NAME "AttentionRetinaNetHead": the towers' 3x3 convs as local attention."""
    model.head._target_ = AttentionRetinaNetHead
    model.head.update(_follow_backbone("head"), kernel_size=_sa.HEAD_KERNEL_SIZE)  # MODEL.SASA.HEAD_KERNEL_SIZE
    return model
