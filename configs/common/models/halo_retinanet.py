"""``model``: RetinaNet over the HaloNet-ResNet (``build_halo_resnet_backbone``): every spatial 3x3
conv of res2-res5 is HaloNet's blocked local attention (b x b query blocks sharing a (b + 2h)^2
window, relative row/column embeddings; strided blocks downsample by attention), conv stem, conv
FPN and head. The values are ``MODEL.HALO.*``'s defaults (aadet/config.py; the layer options are
``HaloSelfAttention2d``'s own defaults, read by ``halo_layer_kwargs``), written out so that each can
be overridden.
"""
from aadet.engine import get_aadet_cfg
from aadet.modeling.attention_layers import halo_layer_kwargs
from aadet.modeling.backbone import build_halo_resnet_backbone

from .retinanet import model

_d = get_aadet_cfg()  # aadet's defaults (aadet/config.py): the values' one home

model.backbone.bottom_up._target_ = build_halo_resnet_backbone
model.backbone.bottom_up.update(
    attention_stages=list(_d.MODEL.HALO.STAGES),  # MODEL.HALO.STAGES
    # MODEL.HALO.{BLOCK_SIZE, HALO_SIZE, NUM_HEADS, POSITIONAL_ENCODING, IMPL}
    attention=halo_layer_kwargs(_d),
)
