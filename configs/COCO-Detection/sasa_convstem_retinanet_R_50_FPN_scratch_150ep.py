# SASA Table 2, "Conv-stem + Attention" backbone with conv FPN and heads (25.9M, 173 GFLOPs,
# 36.8 mAP): every spatial 3x3 conv of res2-res5 is 7x7 local self-attention (8 heads, relative
# row/column embeddings): MODEL.SASA's defaults (configs/common/models/sasa_retinanet.py).
from ..common.data.recipe import dataloader
from ..common.models.sasa_retinanet import model
from ..common.recipe import lr_multiplier, optimizer, train

train.output_dir = "output/sasa_convstem_retinanet_R_50_FPN_scratch_150ep"
