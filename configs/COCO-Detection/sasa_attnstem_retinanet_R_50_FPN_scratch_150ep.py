# SASA Table 2, "Full Attention" backbone (spatially-aware attention stem) with conv FPN and heads
# (25.9M, 173 GFLOPs, 36.2 mAP).
from ..common.models.sasa_retinanet import attention_stem
from .sasa_convstem_retinanet_R_50_FPN_scratch_150ep import dataloader, lr_multiplier, model, optimizer, train

attention_stem(model)
train.output_dir = "output/sasa_attnstem_retinanet_R_50_FPN_scratch_150ep"
