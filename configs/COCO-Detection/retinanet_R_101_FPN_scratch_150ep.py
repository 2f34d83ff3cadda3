# RetinaNet ResNet-101-FPN from scratch, 150 epochs (AA Table 4: 52.4M params, 243 GFLOPs, 38.5 mAP).
from .retinanet_R_50_FPN_scratch_150ep import dataloader, lr_multiplier, model, optimizer, train

model.backbone.bottom_up.depth = 101
train.output_dir = "output/retinanet_R_101_FPN_scratch_150ep"
