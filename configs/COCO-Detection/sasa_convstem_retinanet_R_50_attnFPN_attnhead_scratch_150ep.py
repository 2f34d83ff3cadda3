# SASA Table 2, conv-stem attention backbone + attentional FPN and heads (22.0M, 111 GFLOPs,
# 36.6 mAP): FPN output 3x3 convs and both head towers' 3x3 convs are local self-attention.
from ..common.models.sasa_retinanet import attention_fpn, attention_head
from .sasa_convstem_retinanet_R_50_FPN_scratch_150ep import dataloader, lr_multiplier, model, optimizer, train

attention_head(attention_fpn(model))
train.output_dir = "output/sasa_convstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"
