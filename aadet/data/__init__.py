"""Datasets: one-line COCO detection registration, the demo tree-crown dataset, dataset checks.

Importing this package registers ``trees_train``, ``trees_val`` and ``trees_test`` under the default data root
(``$AADET_DATASETS``, else ``$DETECTRON2_DATASETS``, else ``./datasets``) without touching the
disk; make the data with ``python datasets/prepare_trees.py`` and call :func:`register_trees` with
another root if you used ``--root``. The dataset's names, paths and class are
:mod:`aadet.data.trees`; the preparation code (download, tiling) is the tool's
(``datasets/prepare_trees.py``), not this package's.
"""

from .checks import Problem, check_coco_json  # noqa: F401
from .datasets import register_coco_detection, register_trees  # noqa: F401

register_trees()
