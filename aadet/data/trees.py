"""The demo tree-crown dataset as the library sees it: split names, dataset names, paths, classes.

This is everything registration needs (:func:`aadet.data.register_trees`) and nothing more: no
download, no tiling, no file writing. The data is made by ``python datasets/prepare_trees.py``
(its logic, the source wheel, the split by source image, the tiling and clipping rule, lives in
``datasets/prepare_trees.py``), which takes these names and paths from here, so the tool and the
registration cannot disagree on where the data is.

Layout under the data root (``$AADET_DATASETS``, else ``$DETECTRON2_DATASETS``, else
``./datasets``)::

    <root>/trees/annotations/trees_train.json         COCO detection json of split "train"
    <root>/trees/annotations/trees_val.json, trees_test.json
    <root>/trees/{train,val,test}/*.png                images ("file_name" is relative to these)

Recipe choices are made on ``val``; ``test`` is reported, never tuned on (docs/demo_results.md).
"""

import os
from typing import Dict, Optional, Tuple

__all__ = [
    "SPLITS",
    "DATASET_DIR",
    "CATEGORIES",
    "THING_CLASSES",
    "default_root",
    "dataset_name",
    "json_relpath",
    "dataset_paths",
]

#: The splits, in order; the registered dataset names are ``trees_<split>``.
SPLITS: Tuple[str, ...] = ("train", "val", "test")
#: The dataset's folder under the data root.
DATASET_DIR = "trees"
#: COCO categories of the json files (one class).
CATEGORIES: Tuple[dict, ...] = ({"id": 1, "name": "Tree"},)
#: Detectron2's ``thing_classes`` metadata.
THING_CLASSES: Tuple[str, ...] = tuple(c["name"] for c in CATEGORIES)


def default_root() -> str:
    """The data root: ``$AADET_DATASETS``, else ``$DETECTRON2_DATASETS``, else ``./datasets``."""
    root = os.environ.get("AADET_DATASETS") or os.environ.get("DETECTRON2_DATASETS") or "datasets"
    return os.path.expanduser(root)


def dataset_name(split: str) -> str:
    """``"trees_<split>"``, the name registered in Detectron2's ``DatasetCatalog``."""
    if split not in SPLITS:
        raise ValueError(f"tree-crown split must be one of {SPLITS}, got {split!r}")
    return f"{DATASET_DIR}_{split}"


def json_relpath(split: str) -> str:
    """The split's COCO json, relative to ``<root>/trees``: ``annotations/trees_<split>.json``."""
    return os.path.join("annotations", f"{dataset_name(split)}.json")


def dataset_paths(root: Optional[str] = None) -> Dict[str, Tuple[str, str]]:
    """``{"trees_train": (json_file, image_root), "trees_val": ...}`` under ``root`` (absolute).

    ``root`` defaults to :func:`default_root`. Only computes paths; does not touch the disk.
    """
    root = os.path.abspath(
        os.path.expanduser(os.fspath(root if root is not None else default_root()))
    )
    base = os.path.join(root, DATASET_DIR)
    return {
        dataset_name(split): (os.path.join(base, json_relpath(split)), os.path.join(base, split))
        for split in SPLITS
    }
