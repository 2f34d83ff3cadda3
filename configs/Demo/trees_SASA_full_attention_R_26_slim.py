# All attention (SASA paper's fully attentional RetinaNet): the SASA demo with the spatially-aware
# attention stem, attentional FPN and attentional head. Batch 8 for 58 epochs (450 iterations): the
# YAML twin says why.
from ..common.models.sasa_retinanet import attention_fpn, attention_head, attention_stem
from .trees_SASA_R_26_slim_FPN import dataloader, lr_multiplier, model, optimizer, train

attention_head(attention_fpn(attention_stem(model)))
model.head.kernel_size = 3  # MODEL.SASA.HEAD_KERNEL_SIZE: the YAML twin says why
dataloader.train.total_batch_size = 8
train.update(epochs=58, steps_epochs=[44, 53])
train.output_dir = "output/demo_sasa_full"
