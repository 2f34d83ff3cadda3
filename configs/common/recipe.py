"""The papers' training recipe (AA appendix A.1, as ``configs/Base-RetinaNet-Scratch.yaml``):
SGD at LR 0.04 for a batch of 64 (Detectron2 RetinaNet's 0.01 @ 16, linearly scaled), 150 epochs
with decays at epochs 100 and 133, 2000 warm-up iterations, seed 42. ``optimizer``,
``lr_multiplier`` and ``train`` for the COCO twins; the values not written are the YACS defaults
(``optim.py``, ``schedule.py``, ``train.py``)."""
from .optim import SGD as optimizer
from .schedule import lr_multiplier
from .train import train

optimizer.lr = 0.04
optimizer.weight_decay = 0.0001
lr_multiplier.warmup_factor = 0.001
train.update(
    epochs=150,  # converted to max_iter from the dataset size at start
    steps_epochs=[100, 133],  # RetinaNet recipe: decay at 2/3 and 8/9 of training
    warmup_iters=2000,
    checkpointer=dict(period=5000, max_to_keep=None),
    eval_period=20000,
    best_checkpoint_metric="bbox/AP",
    # A fixed seed makes runs repeatable and --resume continue the exact data stream
    # (aadet.data.resumable); -1 for a fresh random seed per run.
    seed=42,
)

__all__ = ["optimizer", "lr_multiplier", "train"]
