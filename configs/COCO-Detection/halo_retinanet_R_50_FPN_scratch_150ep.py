# HaloNet's blocked local attention at the SASA backbone config's placement
# (sasa_convstem_retinanet_R_50_FPN_scratch_150ep): every spatial 3x3 conv of res2-res5 is halo
# attention (MODEL.HALO's defaults, HaloNet's b 8, h 3, 8 heads, relative row/column embeddings);
# conv stem, FPN and heads.
from ..common.data.recipe import dataloader
from ..common.models.halo_retinanet import model
from ..common.recipe import lr_multiplier, optimizer, train

train.output_dir = "output/halo_retinanet_R_50_FPN_scratch_150ep"
