# SASA demo: conv stem, every spatial conv of the conv demo's ResNet-26 replaced by 7x7 local
# self-attention (8 heads, relative row/column embeddings); conv FPN and head; box voting as the conv
# demo. Every residual block starts as its shortcut (the last GN's scale at 0, as the papers' TF-TPU
# ResNet does): from scratch the attention windows otherwise stay a blur.
from ..common.models.sasa_retinanet import model
from ..common.trees import dataloader, lr_multiplier, optimizer, train, trees_model

trees_model(model)
model.backbone.bottom_up.zero_init_residual = True
model.bbox_vote_thresh = 0.7  # TEST.BBOX_VOTE.ENABLED, VOTE_TH 0.7
train.output_dir = "output/demo_sasa"
