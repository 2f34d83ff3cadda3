"""``dataloader``: the tree-crown demo's data (``configs/Demo/Base-Trees.yaml``): the recipe scaled
to 400x400 tiles (the longer side in [320, 480], 256x256 crops, every tile mirrored), photometric
jitter, test at 448, evaluated on ``trees_val`` and ``trees_test``."""
from aadet.engine import get_aadet_cfg

from .recipe import dataloader

_ph = get_aadet_cfg().INPUT.PHOTOMETRIC  # aadet's defaults (aadet/config.py): the values' one home

dataloader.train.dataset.names = ["trees_train"]
dataloader.train.mapper.augmentations.update(
    long_side_range=[320, 480],
    crop_size=256,
    flip_prob=1.0,  # the papers: 0.5; every tile mirrored (val faces the other way)
    brightness=list(_ph.BRIGHTNESS),  # INPUT.PHOTOMETRIC.ENABLED: val is another image, other light
    contrast=list(_ph.CONTRAST),
)
dataloader.train.total_batch_size = 4
dataloader.train.num_workers = 1
dataloader.test.dataset.names = ["trees_val", "trees_test"]  # choices on val; test reported
dataloader.test.mapper.augmentations[0].update(short_edge_length=448, max_size=448)
