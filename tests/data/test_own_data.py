"""Your own COCO data from the config alone: ``DATASETS.REGISTER_COCO`` (registered by
``aadet.engine.load_config``, so by every tool), from a YAML file and from the command line, with
errors that name the entry."""
import json
import os
import uuid

import pytest
from detectron2.data import DatasetCatalog, MetadataCatalog

import aadet  # noqa: F401
from aadet.config import ConfigValueError
from aadet.data.synthetic import make_coco_tiles
from aadet.engine import load_config

from tests.helpers import REPO, load_tool

DEMO = os.path.join(REPO, "configs", "Demo", "trees_R_26_slim_FPN.yaml")


@pytest.fixture(scope="module")
def tiles(tmp_path_factory):
    """8 + 4 synthetic 128 px tiles: ``(root, {name: (json, image_root)})``."""
    root = str(tmp_path_factory.mktemp("cells"))
    return root, make_coco_tiles(root, num_train=8, num_val=4, seed=1)


def _unique(prefix="own"):
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _user_config(path, entries, train, test, num_classes=1):
    """A user's whole config: _BASE_ + REGISTER_COCO + datasets + class count."""
    with open(path, "w") as f:
        f.write(
            f'_BASE_: "{DEMO}"\n'
            "DATASETS:\n"
            f"  REGISTER_COCO: {json.dumps([list(e) for e in entries])}\n"
            f'  TRAIN: ["{train}"]\n'
            f'  TEST: ["{test}"]\n'
            "MODEL:\n"
            "  RETINANET:\n"
            f"    NUM_CLASSES: {num_classes}\n"
        )
    return str(path)


def test_yaml_key_registers_datasets_for_every_tool(tiles, tmp_path):
    root, paths = tiles
    tr, va = _unique(), _unique()
    entries = [(tr, *paths["cells_train"]), (va, *paths["cells_val"])]
    cfg_file = _user_config(tmp_path / "cells.yaml", entries, tr, va)
    cfg = load_config(cfg_file)
    assert cfg.DATASETS.TRAIN == (tr,) and cfg.DATASETS.TEST == (va,)
    assert len(DatasetCatalog.get(tr)) == 8 and len(DatasetCatalog.get(va)) == 4
    n_boxes = sum(len(d["annotations"]) for d in DatasetCatalog.get(tr))
    with open(paths["cells_train"][0]) as f:
        assert n_boxes == len(json.load(f)["annotations"])
    assert MetadataCatalog.get(tr).thing_classes == ["cell"]
    assert MetadataCatalog.get(va).json_file == os.path.abspath(paths["cells_val"][0])
    # tools build their config more than once: the identical triple again is a no-op
    load_config(cfg_file)
    load_config(cfg_file, ["SOLVER.BASE_LR", "0.01"])
    assert len(DatasetCatalog.get(tr)) == 8


def test_a_tool_uses_a_dataset_named_only_in_the_config(tiles, tmp_path):
    visualize_data = load_tool("visualize_data")

    _, paths = tiles
    tr = _unique()
    cfg_file = _user_config(tmp_path / "c.yaml", [(tr, *paths["cells_train"])], tr, tr)
    written = visualize_data.main(["--config-file", cfg_file, "--output", str(tmp_path / "v"),
                                   "-n", "2", "--source", "annotation"])
    assert len(written) == 2 and all(os.path.isfile(p) for p in written)


def test_command_line_list_of_lists(tiles):
    """yacs parses ``"[['a', 'b', 'c'], ...]"`` from opts with literal_eval into a tuple of lists."""
    _, paths = tiles
    tr, va = _unique(), _unique()
    (jt, it), (jv, iv) = paths["cells_train"], paths["cells_val"]
    opt = f"[['{tr}', '{jt}', '{it}'], ['{va}', '{jv}', '{iv}']]"
    cfg = load_config(DEMO, ["DATASETS.REGISTER_COCO", opt, "DATASETS.TRAIN", f"('{tr}',)",
                             "DATASETS.TEST", f"('{va}',)"])
    assert [list(e) for e in cfg.DATASETS.REGISTER_COCO] == [[tr, jt, it], [va, jv, iv]]
    assert len(DatasetCatalog.get(tr)) == 8 and len(DatasetCatalog.get(va)) == 4


def test_relative_paths_are_from_the_working_directory(tiles, monkeypatch):
    root, _ = tiles
    monkeypatch.chdir(root)
    name = _unique()
    load_config(DEMO, ["DATASETS.REGISTER_COCO", f"[['{name}', 'cells_val.json', 'images']]"])
    assert MetadataCatalog.get(name).json_file == os.path.join(root, "cells_val.json")
    assert len(DatasetCatalog.get(name)) == 4


@pytest.mark.parametrize(
    "entry, error, needle",
    [
        ("[['{n}', '{root}/nope.json', '{root}/images']]", FileNotFoundError, r"REGISTER_COCO\[0\].*nope\.json"),
        ("[['{n}', '{root}/cells_val.json', '{root}/no_images']]", FileNotFoundError, r"REGISTER_COCO\[0\].*no_images"),
        ("[['{n}', '{root}/cells_val.json']]", ConfigValueError,
         r"REGISTER_COCO\[0\].*\[name, json_file, image_root\]"),
        ("[['{n}', '{root}/cells_val.json', '']]", ConfigValueError, r"REGISTER_COCO\[0\].*non-empty"),
        ("[['{n}', '{root}/cells_val.json', '{root}/images'], ['{n}', '{root}/cells_train.json', '{root}/images']]",
         ConfigValueError, r"REGISTER_COCO\[1\].*listed twice"),
        ("[['trees_val', '{root}/cells_val.json', '{root}/images']]", ValueError,
         r"REGISTER_COCO\[0\].*trees_val.*already registered"),
        ("['{n}', '{root}/cells_val.json', '{root}/images']", ConfigValueError,
         r"REGISTER_COCO\[0\] = '.*'.*three non-empty strings"),
    ],
)
def test_bad_entries_name_the_entry(tiles, entry, error, needle):
    root, _ = tiles
    with pytest.raises(error, match=needle):
        load_config(DEMO, ["DATASETS.REGISTER_COCO", entry.format(n=_unique(), root=root)])


def test_a_name_clash_with_other_paths_is_an_error_not_a_silent_switch(tiles, tmp_path):
    root, paths = tiles
    name = _unique()
    load_config(DEMO, ["DATASETS.REGISTER_COCO", f"[['{name}', '{root}/cells_val.json', '{root}/images']]"])
    with pytest.raises(ValueError, match=rf"REGISTER_COCO\[0\].*{name}.*already registered"):
        load_config(DEMO, ["DATASETS.REGISTER_COCO",
                           f"[['{name}', '{root}/cells_train.json', '{root}/images']]"])
    assert MetadataCatalog.get(name).json_file == os.path.join(root, "cells_val.json")
