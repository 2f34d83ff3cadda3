# Conv baseline of both papers: RetinaNet ResNet-50-FPN from scratch, 150 epochs
# (AA Table 4: 33.4M params, 182 GFLOPs, 36.8 mAP; SASA Table 2: 36.5 mAP). Twin of the .yaml.
from ..common.data.recipe import dataloader
from ..common.models.retinanet import model
from ..common.recipe import lr_multiplier, optimizer, train

train.output_dir = "output/retinanet_R_50_FPN_scratch_150ep"
