# AA-ResNet-101 RetinaNet from scratch, 150 epochs (AA paper Table 4: 51.7M params, 245 GFLOPs, 39.2 mAP).
from .aa_retinanet_R_50_FPN_scratch_150ep import dataloader, lr_multiplier, model, optimizer, train

model.backbone.bottom_up.depth = 101
train.output_dir = "output/aa_retinanet_R_101_FPN_scratch_150ep"
