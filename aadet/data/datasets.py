"""Registering COCO-format detection datasets with Detectron2 by name, in one line.

::

    from aadet.data import register_coco_detection
    register_coco_detection("my_train", "path/to/train.json", "path/to/train_images")
    # then DATASETS.TRAIN: ("my_train",)

:func:`register_trees` registers the built-in demo splits ``trees_train``, ``trees_val`` and ``trees_test`` (made
by ``python datasets/prepare_trees.py``; names and paths in :mod:`aadet.data.trees`);
``import aadet.data`` does it with the default data root, without touching the disk.

Both wrap what Detectron2's ``register_coco_instances`` does (a lazy ``load_coco_json`` loader and
the metadata ``json_file``, ``image_root``, ``evaluator_type="coco"``), and add checks: a missing
json, image folder or image file stops with a FileNotFoundError that names it and says how to make
it. ``python tools/check_dataset.py JSON IMAGE_ROOT`` checks a dataset thoroughly
(:func:`aadet.data.checks.check_coco_json`).

Without Python: the config key ``DATASETS.REGISTER_COCO`` lists ``[name, json_file, image_root]``
triples, which :func:`register_coco_from_config` registers (``aadet.engine.load_config``, used by
every tool, calls it before anything reads ``DATASETS.TRAIN`` / ``DATASETS.TEST``).
"""

import functools
import logging
import os
from typing import Dict, List, Optional

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets import load_coco_json

from . import trees

__all__ = ["register_coco_detection", "register_coco_entries", "register_coco_from_config", "register_trees"]

logger = logging.getLogger(__name__)

_COCO_HINT = (
    "write a COCO detection json there (https://cocodataset.org/#format-data) or pass the right "
    "path to register_coco_detection"
)


def _check_paths(name: str, json_file: str, image_root: str, hint: str) -> None:
    if not os.path.isfile(json_file):
        raise FileNotFoundError(
            f"dataset {name!r}: annotation file {json_file} does not exist; {hint}"
        )
    if not os.path.isdir(image_root):
        raise FileNotFoundError(
            f"dataset {name!r}: image folder {image_root} does not exist; {hint}"
        )


def _load(name: str, json_file: str, image_root: str, hint: str) -> List[dict]:
    """The registered loader: checks the paths, loads the json, checks every image file exists."""
    _check_paths(name, json_file, image_root, hint)
    dicts = load_coco_json(json_file, image_root, name)
    missing = [d["file_name"] for d in dicts if not os.path.isfile(d["file_name"])]
    if missing:
        raise FileNotFoundError(
            f"dataset {name!r}: {len(missing)} of {len(dicts)} images listed in {json_file} are "
            f"missing, first: {missing[0]}; {hint} (`python tools/check_dataset.py {json_file} "
            f"{image_root}` lists every problem)"
        )
    return dicts


def _register(name: str, json_file: str, image_root: str, metadata: dict, hint: str) -> None:
    DatasetCatalog.register(name, functools.partial(_load, name, json_file, image_root, hint))
    MetadataCatalog.get(name).set(
        json_file=json_file, image_root=image_root, evaluator_type="coco", **metadata
    )


def _registered_paths(name: str):
    """``(json_file, image_root)`` of a registered dataset, or None when ``name`` is free."""
    if name not in DatasetCatalog.list():
        return None
    meta = MetadataCatalog.get(name)
    return meta.get("json_file"), meta.get("image_root")


def _abspath(path) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def register_coco_detection(
    name: str, json_file, image_root, metadata: Optional[dict] = None
) -> None:
    """Register a COCO-format detection dataset (boxes) under ``name``, for any COCO json.

    Args:
        name: the dataset name for ``DATASETS.TRAIN`` / ``DATASETS.TEST``, e.g. ``"my_train"``.
        json_file: COCO detection json; ``file_name`` of each image is relative to ``image_root``.
        image_root: the image folder.
        metadata: extra metadata (optional); ``thing_classes`` is read from the json on load.

    Registering the same name with the same paths again does nothing.

    Raises:
        FileNotFoundError: ``json_file`` or ``image_root`` does not exist (checked now and again
            on ``DatasetCatalog.get``, which also checks that every listed image exists).
        ValueError: ``name`` is already registered with other paths.
    """
    json_file, image_root = _abspath(json_file), _abspath(image_root)
    existing = _registered_paths(name)
    if existing == (json_file, image_root):
        return
    if existing is not None:
        raise ValueError(
            f"dataset {name!r} is already registered with json_file={existing[0]}, "
            f"image_root={existing[1]}; choose another name, or call "
            f"DatasetCatalog.remove({name!r}) "
            f"and MetadataCatalog.remove({name!r}) first"
        )
    _check_paths(name, json_file, image_root, _COCO_HINT)
    _register(name, json_file, image_root, dict(metadata or {}), _COCO_HINT)


def register_trees(root=None) -> Dict[str, tuple]:
    """Register the demo splits ``trees_train``, ``trees_val``, ``trees_test`` under the data root ``root``.

    ``root`` defaults to :func:`aadet.data.trees.default_root` (``$AADET_DATASETS``, else
    ``$DETECTRON2_DATASETS``, else ``./datasets``). Lazy: the disk is read only by
    ``DatasetCatalog.get``, which raises FileNotFoundError with the command that makes the data
    (``python datasets/prepare_trees.py --root ROOT``) when it is missing. Registering again with
    the same root does nothing; with another root it replaces the earlier registration.

    Returns:
        ``{name: (json_file, image_root)}``.
    """
    root = _abspath(root if root is not None else trees.default_root())
    hint = f"run `python datasets/prepare_trees.py --root {root}` to make it"
    paths = trees.dataset_paths(root)
    for name, (json_file, image_root) in paths.items():
        existing = _registered_paths(name)
        if existing == (json_file, image_root):
            continue
        if existing is not None:
            logger.info(f"Re-registering {name} from {existing[0]} to {json_file}")
            DatasetCatalog.remove(name)
            MetadataCatalog.remove(name)
        _register(name, json_file, image_root, {"thing_classes": list(trees.THING_CLASSES)}, hint)
    return paths


_REGISTER_KEY = "DATASETS.REGISTER_COCO"


def register_coco_from_config(cfg) -> Dict[str, tuple]:
    """Register every ``[name, json_file, image_root]`` triple of ``cfg.DATASETS.REGISTER_COCO``
    (:func:`register_coco_entries`; a LazyConfig's ``dataloader.register_coco`` goes there too)."""
    return register_coco_entries(cfg.DATASETS.get("REGISTER_COCO", ()), _REGISTER_KEY)


def register_coco_entries(entries, key: str = _REGISTER_KEY) -> Dict[str, tuple]:
    """Register every ``[name, json_file, image_root]`` triple of ``entries``, the value of the
    config key ``key`` (named in the errors).

    The one place where such entries are checked. Relative paths are taken from the working
    directory. Registering the identical triple again does nothing (tools build their config more
    than once).

    Returns:
        ``{name: (json_file, image_root)}`` with absolute paths, in the key's order.

    Raises:
        aadet.config.ConfigValueError: an entry that is not a triple of non-empty strings, or a
            name listed twice; the message names the entry.
        FileNotFoundError: an entry's json file or image folder does not exist (names the entry).
        ValueError: an entry's name is already registered with other paths (names the entry).
    """
    from ..config import ConfigValueError

    if isinstance(entries, str) or not isinstance(entries, (list, tuple)):
        raise ConfigValueError(
            f"Config key {key} must be a list of [name, json_file, image_root] "
            f"triples; got {entries!r}."
        )
    out: Dict[str, tuple] = {}
    for i, entry in enumerate(entries):
        where = f"{key}[{i}] = {list(entry) if isinstance(entry, (list, tuple)) else entry!r}"
        if (
            not isinstance(entry, (list, tuple))
            or len(entry) != 3
            or not all(isinstance(v, str) and v for v in entry)
        ):
            raise ConfigValueError(
                f"{where}: each entry must be [name, json_file, image_root], three non-empty "
                f"strings; got {entry!r}."
            )
        name, json_file, image_root = entry
        if name in out:
            raise ConfigValueError(f"{where}: dataset name {name!r} is listed twice in {key}.")
        try:
            register_coco_detection(name, json_file, image_root)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from e
        out[name] = (_abspath(json_file), _abspath(image_root))
    return out
