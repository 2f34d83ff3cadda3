# AA-ResNet-50 RetinaNet from scratch, 150 epochs (AA paper Table 4: 33.1M params, 182 GFLOPs,
# 38.2 mAP). 3x3 convs of every res3-res5 block augmented, kappa = 2 nu = 0.2, 8 heads, 2D relative
# position logits, attention downsampled (3x3/2 avg pool + bilinear) only in res3: MODEL.AA's
# defaults (configs/common/models/aa_retinanet.py).
from ..common.data.recipe import dataloader
from ..common.models.aa_retinanet import model
from ..common.recipe import lr_multiplier, optimizer, train

train.output_dir = "output/aa_retinanet_R_50_FPN_scratch_150ep"
