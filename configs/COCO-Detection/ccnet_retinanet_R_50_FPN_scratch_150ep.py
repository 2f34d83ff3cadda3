# CCNet's recurrent criss-cross attention in the backbone as its COCO experiment places it: one
# RCCA module (MODEL.CCNET's defaults: R 2, 1 head, q/k at C/8, attending in C/4 channels) before
# the last block of res4; the rest is the conv R50 RetinaNet.
from ..common.data.recipe import dataloader
from ..common.models.ccnet_retinanet import model
from ..common.recipe import lr_multiplier, optimizer, train

train.output_dir = "output/ccnet_retinanet_R_50_FPN_scratch_150ep"
