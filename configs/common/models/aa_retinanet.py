"""``model``: RetinaNet over the AA-ResNet (``build_aa_resnet_backbone``): the conv model of
``retinanet.py`` whose res3-res5 3x3 convs are attention augmented (AA paper: kappa = 2 nu = 0.2,
8 heads, relative logits, attention downsampled in res3). The values are ``MODEL.AA.*``'s defaults
(aadet/config.py: the papers' values; the layer options are ``AugmentedConv2d``'s own defaults,
read by ``aa_layer_kwargs``), written out so that each can be overridden."""
from aadet.engine import get_aadet_cfg
from aadet.modeling.attention_layers import aa_layer_kwargs
from aadet.modeling.backbone import build_aa_resnet_backbone

from .retinanet import model

_d = get_aadet_cfg()  # aadet's defaults (aadet/config.py): the values' one home
_aa = _d.MODEL.AA

model.backbone.bottom_up._target_ = build_aa_resnet_backbone
model.backbone.bottom_up.update(
    aa_stages=list(_aa.STAGES),  # MODEL.AA.STAGES: res3, res4, res5
    downsample_stages=list(_aa.DOWNSAMPLE_STAGES),  # MODEL.AA.DOWNSAMPLE_STAGES: res3
    max_input_size=_aa.MAX_INPUT_SIZE,  # MODEL.AA.MAX_INPUT_SIZE: covers the 640 crop and test size
    # MODEL.AA.{KAPPA, NU, NUM_HEADS, POSITIONAL_ENCODING, CLIP_DISTANCES, MIN_DK_PER_HEAD, IMPL}
    attention=aa_layer_kwargs(_d),
)
