"""``model``: RetinaNet over CCNet's ResNet (``build_ccnet_resnet_backbone``): the conv ResNet with
one recurrent criss-cross attention module (RCCA) before the last block of res4, conv FPN and head.
The values are ``MODEL.CCNET.*``'s defaults (aadet/config.py; the module's options are
``RecurrentCrissCrossAttention``'s own defaults, read by ``criss_cross_options``), written out so
that each can be overridden.
"""
from aadet.engine import get_aadet_cfg
from aadet.modeling.backbone.ccnet_resnet import build_ccnet_resnet_backbone, criss_cross_options

from .retinanet import model

_d = get_aadet_cfg()  # aadet's defaults (aadet/config.py): the values' one home

model.backbone.bottom_up._target_ = build_ccnet_resnet_backbone
model.backbone.bottom_up.update(
    ccnet_stage=_d.MODEL.CCNET.STAGE,  # MODEL.CCNET.STAGE
    # MODEL.CCNET.{RESIDUAL, INTER_CHANNELS, RECURRENCE, NUM_HEADS, REDUCTION, BOTTLENECK_KERNEL_SIZE, IMPL}
    criss_cross=criss_cross_options(_d),
)
