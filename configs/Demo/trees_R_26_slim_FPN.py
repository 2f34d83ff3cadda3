# The demo's main job (`make demo`; this is the twin of its .yaml): conv ResNet-26 RetinaNet from
# scratch, with box voting after NMS (TEST.BBOX_VOTE, not in the papers: the crowns are found but
# loosely placed).
from ..common.models.retinanet import model
from ..common.trees import dataloader, lr_multiplier, optimizer, train, trees_model

trees_model(model)
model.bbox_vote_thresh = 0.7  # TEST.BBOX_VOTE.ENABLED, VOTE_TH 0.7
train.output_dir = "output/demo"
