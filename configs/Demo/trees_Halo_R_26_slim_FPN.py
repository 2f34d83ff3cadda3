# HaloNet demo, mirroring trees_SASA_R_26_slim_FPN: conv stem, every spatial conv of the conv demo's
# ResNet-26 replaced by HaloNet's blocked local attention (MODEL.HALO's defaults); conv FPN and
# head; box voting as the conv demo. Every residual block starts as its shortcut, as the SASA demo's.
from ..common.models.halo_retinanet import model
from ..common.trees import dataloader, lr_multiplier, optimizer, train, trees_model

trees_model(model)
model.backbone.bottom_up.zero_init_residual = True
model.bbox_vote_thresh = 0.7  # TEST.BBOX_VOTE.ENABLED, VOTE_TH 0.7
train.output_dir = "output/demo_halo"
