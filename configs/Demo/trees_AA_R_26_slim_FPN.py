# AA demo: the conv demo's backbone with the 3x3 convs of res3-res5 attention-augmented (AA paper:
# kappa = 2 nu = 0.2, relative position logits), 4 heads for its narrow layers.
from ..common.models.aa_retinanet import model
from ..common.trees import dataloader, lr_multiplier, optimizer, train, trees_model

trees_model(model)
model.backbone.bottom_up.max_input_size = 512  # the demo's tiles and test size
model.backbone.bottom_up.attention.num_heads = 4
train.output_dir = "output/demo_aa"
