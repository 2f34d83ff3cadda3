# CCNet demo: the conv demo with one RCCA module (MODEL.CCNET's defaults) before the last block of
# res4, the ResNet's GN in its convs; conv FPN and head; box voting as the conv demo.
from ..common.models.ccnet_retinanet import model
from ..common.trees import dataloader, lr_multiplier, optimizer, train, trees_model

trees_model(model)
model.bbox_vote_thresh = 0.7  # TEST.BBOX_VOTE.ENABLED, VOTE_TH 0.7
train.output_dir = "output/demo_ccnet"
