# SASA Table 2, fully attentional RetinaNet: attention stem, backbone, FPN and heads
# (22.0M, 110 GFLOPs, 36.6 mAP).
from ..common.models.sasa_retinanet import attention_stem
from .sasa_convstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep import (
    dataloader,
    lr_multiplier,
    model,
    optimizer,
    train,
)

attention_stem(model)
train.output_dir = "output/sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"
