"""The tree-crown demo (``configs/Demo/Base-Trees.yaml``): small RetinaNets from scratch on 2 CPU
cores, the papers' recipe scaled to the data. ``dataloader`` (``data/trees.py``), ``optimizer``
(AdamW), ``lr_multiplier`` and ``train`` (54 epochs of 62 tiles / 4), and :func:`trees_model`,
which makes any of the ``models/*.py`` the demo's ResNet-26 at a quarter of ResNet-50's widths.
Every recipe choice was made on trees_val (docs/demo_results.md)."""
from detectron2.layers import ShapeSpec

from .data.trees import dataloader
from .optim import AdamW as optimizer
from .recipe import lr_multiplier, train

optimizer.lr = 0.002
optimizer.weight_decay = 0.05
train.update(
    epochs=54,  # 62 tiles / 4 -> 837 iterations
    steps_epochs=[41, 49],  # decay at 3/4 and 9/10 of training
    warmup_iters=50,
    checkpointer=dict(period=100000, max_to_keep=None),
    eval_period=0,  # evaluated once at the end
)


def trees_model(model):
    """The demo's RetinaNet: ResNet-26 slim (GN), a 64-channel FPN P3-P5, a 2-conv GN head, one
    class, anchors for crowns of 10-100 px, GIoU loss."""
    model.backbone.bottom_up.update(
        depth=26,  # [1, 2, 4, 1] bottleneck blocks (SASA paper's ResNet-26)
        width_per_group=32,  # bottlenecks 32..256: half of ResNet-50's
        res2_out_channels=64,  # block outputs 64..512: a quarter of ResNet-50's
        norm="GN",  # val's choice over BN: a batch of 4 is below the ~8 images BN needs
        zero_init_residual=False,  # Detectron2's init for the conv and AA demos (SASA, HaloNet: on)
    )
    model.backbone.update(out_channels=64, norm="GN", p6p7_source=None)  # P3-P5: no P6/P7
    model.head.update(
        input_shape=[ShapeSpec(channels=64)] * 3,
        num_anchors=3,
        conv_dims=[64, 64],
        norm="GN",  # the head is shared by P3-P5: one BN would mix their statistics
    )
    model.anchor_generator.update(
        sizes=[[16, 20, 25], [32, 40, 50], [64, 80, 101]],  # crowns are 10-100 px
        aspect_ratios=[[1.0]],
        strides=[8, 16, 32],
    )
    model.update(
        num_classes=1,
        head_in_features=["p3", "p4", "p5"],
        box_reg_loss_type="giou",
        test_topk_candidates=300,
    )
    return model


__all__ = ["dataloader", "optimizer", "lr_multiplier", "train", "trees_model"]
