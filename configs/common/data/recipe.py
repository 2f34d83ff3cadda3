"""``dataloader``: the papers' RetinaNet data recipe on COCO 2017 (AA appendix A.1, as
``configs/Base-RetinaNet-Scratch.yaml``): the longer side jittered in [512, 768], a 640x640
crop/pad, flip 0.5 (``aadet.data.augmentation.recipe_augmentation``), on the resumable stream
that ``--resume`` continues exactly (``aadet.data.resumable``); test at 640; COCO box AP.

Values not written here are the YACS defaults (``_d``, key in the comment); those written are the
recipe's (Base-RetinaNet-Scratch.yaml). ``dataloader.test.dataset.names`` may list several splits:
each is evaluated (as ``DATASETS.TEST``). ``dataloader.register_coco``: your own COCO-format data,
``[name, json_file, image_root]`` triples (as ``DATASETS.REGISTER_COCO``; docs/own_data.md).
"""
import detectron2.data.transforms as T
from detectron2.config import LazyCall as L
from detectron2.data import DatasetMapper, build_detection_test_loader, get_detection_dataset_dicts
from detectron2.evaluation import COCOEvaluator
from omegaconf import OmegaConf

from aadet.data.augmentation import recipe_augmentation
from aadet.data.resumable import build_resumable_train_loader
from aadet.engine import get_aadet_cfg

_d = get_aadet_cfg()  # Detectron2's and aadet's defaults (aadet/config.py): the values' one home
_sj = _d.INPUT.SCALE_JITTER

dataloader = OmegaConf.create()
dataloader.register_coco = list(_d.DATASETS.REGISTER_COCO)  # DATASETS.REGISTER_COCO

dataloader.train = L(build_resumable_train_loader)(
    dataset=L(get_detection_dataset_dicts)(
        names=["coco_2017_train"],
        filter_empty=_d.DATALOADER.FILTER_EMPTY_ANNOTATIONS,  # DATALOADER.FILTER_EMPTY_ANNOTATIONS
    ),
    mapper=L(DatasetMapper)(
        is_train=True,
        augmentations=L(recipe_augmentation)(
            long_side_range=list(_sj.LONG_SIDE_RANGE),  # INPUT.SCALE_JITTER.LONG_SIDE_RANGE: [512, 768]
            crop_size=_sj.CROP_SIZE,  # INPUT.SCALE_JITTER.CROP_SIZE: 640
            flip_prob=_sj.FLIP_PROB,  # INPUT.SCALE_JITTER.FLIP_PROB: 0.5
            pad_value=_sj.PAD_VALUE,  # INPUT.SCALE_JITTER.PAD_VALUE
            brightness=None,  # INPUT.PHOTOMETRIC (off): set both ranges to turn it on
            contrast=None,
        ),
        image_format=_d.INPUT.FORMAT,  # INPUT.FORMAT
        use_instance_mask=False,
    ),
    total_batch_size=64,  # SOLVER.IMS_PER_BATCH of the recipe
    seed="${train.seed}",  # the stream's seed: SEED
    aspect_ratio_grouping=_d.DATALOADER.ASPECT_RATIO_GROUPING,  # DATALOADER.ASPECT_RATIO_GROUPING
    num_workers=4,  # DATALOADER.NUM_WORKERS of the recipe
)

dataloader.test = L(build_detection_test_loader)(
    dataset=L(get_detection_dataset_dicts)(names=["coco_2017_val"], filter_empty=False),
    mapper=L(DatasetMapper)(
        is_train=False,
        augmentations=[
            # INPUT.MIN_SIZE_TEST / MAX_SIZE_TEST of the recipe: the longer side is 640
            L(T.ResizeShortestEdge)(short_edge_length=640, max_size=640, sample_style="choice"),
        ],
        image_format="${...train.mapper.image_format}",
    ),
    num_workers="${..train.num_workers}",
)

# COCO box AP (Detectron2's compiled evaluator), as aadet.engine.Trainer.build_evaluator
dataloader.evaluator = L(COCOEvaluator)(
    dataset_name="${..test.dataset.names}",
    tasks=("bbox",),
    distributed=True,
    use_fast_impl=True,
)
