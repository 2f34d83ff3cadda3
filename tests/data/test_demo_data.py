"""The demo dataset's registration (``aadet.data``: names, paths, lazy loading), one-line COCO
registration, and the dataset checker (``aadet.data.checks``, ``tools/check_dataset.py``).

The data comes from ``conftest.py``'s ``prepared`` / ``scratch`` (built from the pinned wheel
by the tool's code, whose tests are ``tests/datasets/test_prepare_trees.py``).
"""

import json
import os

import pytest
from PIL import Image

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.structures import BoxMode

from aadet.data import check_coco_json, register_coco_detection, register_trees, trees

from tests.helpers import load_tool


@pytest.fixture()
def restore_trees_registration():
    yield
    register_trees()  # back to the default root, as after `import aadet.data`


def test_default_root(monkeypatch):
    monkeypatch.delenv("AADET_DATASETS", raising=False)
    monkeypatch.delenv("DETECTRON2_DATASETS", raising=False)
    assert trees.default_root() == "datasets"
    monkeypatch.setenv("DETECTRON2_DATASETS", "/d2")
    assert trees.default_root() == "/d2"
    monkeypatch.setenv("AADET_DATASETS", "/aa")
    assert trees.default_root() == "/aa"


# ---------------------------------------------------------------- registration
def test_register_coco_detection_one_liner(prepared):
    json_file, image_root = prepared.splits["trees_val"]
    name = "aadet_test_trees_val"
    try:
        register_coco_detection(name, json_file, image_root)
        register_coco_detection(name, json_file, image_root)  # same paths again: no-op
        dicts = DatasetCatalog.get(name)
        assert len(dicts) == 12
        d = dicts[0]
        assert {"file_name", "height", "width", "image_id", "annotations"} <= set(d)
        assert os.path.isfile(d["file_name"]) and (d["height"], d["width"]) == (400, 400)
        a = d["annotations"][0]
        assert a["bbox_mode"] == BoxMode.XYWH_ABS and a["category_id"] == 0 and len(a["bbox"]) == 4
        assert sum(len(d["annotations"]) for d in dicts) == 414
        meta = MetadataCatalog.get(name)
        assert (
            meta.thing_classes == ["Tree"]
            and meta.evaluator_type == "coco"
            and meta.json_file == json_file
        )
        with pytest.raises(ValueError, match="already registered"):
            register_coco_detection(name, prepared.splits["trees_train"][0], image_root)
    finally:
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)


def test_register_coco_detection_missing_paths(prepared, tmp_path):
    json_file, image_root = prepared.splits["trees_val"]
    with pytest.raises(
        FileNotFoundError, match=f"annotation file {tmp_path}/no.json does not exist"
    ):
        register_coco_detection("aadet_test_missing", str(tmp_path / "no.json"), image_root)
    with pytest.raises(FileNotFoundError, match=f"image folder {tmp_path}/imgs does not exist"):
        register_coco_detection("aadet_test_missing", json_file, str(tmp_path / "imgs"))
    assert "aadet_test_missing" not in DatasetCatalog.list()


def test_missing_image_file_is_named_on_load(scratch):
    json_file, image_root = trees.dataset_paths(scratch)["trees_val"]
    victim = sorted(os.listdir(image_root))[3]
    os.remove(os.path.join(image_root, victim))
    name = "aadet_test_missing_image"
    register_coco_detection(name, json_file, image_root)
    try:
        with pytest.raises(
            FileNotFoundError, match=f"1 of 12 images .* missing, first: .*{victim}"
        ):
            DatasetCatalog.get(name)
    finally:
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)


def test_register_trees(prepared, tmp_path, restore_trees_registration):
    root = os.path.dirname(prepared.dataset_dir)
    assert register_trees(root) == prepared.splits
    register_trees(root)  # idempotent
    assert len(DatasetCatalog.get("trees_train")) == 62
    assert len(DatasetCatalog.get("trees_val")) == 12
    assert MetadataCatalog.get("trees_val").thing_classes == ["Tree"]

    missing = tmp_path / "nowhere"
    register_trees(str(missing))  # lazy: succeeds without data
    assert not missing.exists()
    with pytest.raises(FileNotFoundError) as e:
        DatasetCatalog.get("trees_train")
    msg = str(e.value)
    assert str(missing / "trees" / "annotations" / "trees_train.json") in msg
    assert f"python datasets/prepare_trees.py --root {missing}" in msg


def test_import_registers_default_names():
    assert {"trees_train", "trees_val", "trees_test"} <= set(DatasetCatalog.list())
    assert set(trees.dataset_paths()) == {"trees_train", "trees_val", "trees_test"}
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'val', 'test'\), got 'eval'"):
        trees.dataset_name("eval")


# ---------------------------------------------------------------- checks
def test_check_prepared_dataset_is_clean(prepared):
    for name, (json_file, image_root) in prepared.splits.items():
        assert check_coco_json(json_file, image_root) == [], name


def _write_synthetic(tmp_path):
    """A small dataset with one problem of each kind."""
    img = tmp_path / "images"
    img.mkdir()
    Image.new("RGB", (50, 40), (10, 20, 30)).save(img / "good.png")
    Image.new("L", (50, 40)).save(img / "gray.png")
    Image.new("RGBA", (50, 40)).save(img / "rgba.png")
    Image.new("RGB", (60, 40)).save(img / "wrong_size.png")
    (img / "corrupt.png").write_bytes(b"not an image at all")
    Image.new("RGB", (300, 300)).save(img / "full.png")
    data = (img / "full.png").read_bytes()
    (img / "truncated.png").write_bytes(data[: len(data) // 2])
    images = [
        {"id": 1, "file_name": "good.png", "height": 40, "width": 50},
        {"id": 2, "file_name": "gray.png", "height": 40, "width": 50},
        {"id": 3, "file_name": "rgba.png", "height": 40, "width": 50},
        {"id": 4, "file_name": "missing.png", "height": 40, "width": 50},
        {"id": 5, "file_name": "corrupt.png", "height": 40, "width": 50},
        {"id": 6, "file_name": "truncated.png", "height": 300, "width": 300},
        {"id": 7, "file_name": "wrong_size.png", "height": 40, "width": 50},
        {"id": 7, "file_name": "good.png", "height": 40, "width": 50},  # duplicate id
    ]

    def ann(aid, image_id, bbox, category_id=1, **kw):
        return {"id": aid, "image_id": image_id, "category_id": category_id, "bbox": bbox,
                "area": 1.0, "iscrowd": 0, **kw}  # fmt: skip

    annotations = [
        ann(1, 1, [1, 1, 10, 10]),  # fine
        ann(2, 1, [5, 5, 0, 10]),  # degenerate (w = 0)
        ann(3, 1, [45, 5, 10, 10]),  # out of image (x1 = 55 > 50 + 1)
        ann(4, 99, [1, 1, 5, 5]),  # unknown image id
        ann(5, 2, [1, 1, 5, 5], category_id=7),  # unknown category
        ann(5, 3, [1, 1, 5, 5]),  # duplicate annotation id
        ann(6, 3, [1, 1, -3, 5]),  # degenerate (w < 0)
        ann(7, 7, [49.5, 0, 1.4, 40.5]),  # within the 1 px tolerance: fine
    ]
    del annotations[-1]["area"]  # ... but no area
    coco = {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "Tree"}]}
    json_file = tmp_path / "ann.json"
    json_file.write_text(json.dumps(coco))
    return str(json_file), str(img)


def test_check_coco_json_finds_every_problem(tmp_path):
    json_file, image_root = _write_synthetic(tmp_path)
    problems = check_coco_json(json_file, image_root)
    lines = [str(p) for p in problems]
    errors = [line for line in lines if line.startswith("ERROR")]
    infos = [line for line in lines if line.startswith("INFO")]

    def has(lines, *parts):
        return any(all(part in line for part in parts) for line in lines)

    img = os.path.join(image_root, "")
    assert has(errors, img + "missing.png", "image id 4", "does not exist")
    assert has(errors, img + "corrupt.png", "cannot decode")
    assert has(errors, img + "truncated.png", "cannot decode")
    assert has(errors, img + "wrong_size.png", "50x40", "60x40")
    assert has(errors, json_file, "duplicate image id 7")
    assert has(errors, img + "good.png", "annotation id 2", "degenerate")
    assert has(errors, img + "rgba.png", "annotation id 6", "degenerate")
    assert has(errors, img + "good.png", "annotation id 3", "outside the 50x40 image")
    assert has(errors, json_file, "annotation id 4", "image_id 99")
    assert has(errors, img + "gray.png", "annotation id 5", "category_id 7")
    assert has(errors, json_file, "duplicate annotation id 5")
    assert has(errors, img + "wrong_size.png", "annotation id 7", "'area'")
    assert len(errors) == 12, "\n".join(errors)
    assert has(infos, img + "gray.png", "grayscale")
    assert has(infos, img + "rgba.png", "mode RGBA")
    for no_boxes in ("missing.png", "corrupt.png", "truncated.png"):
        assert has(infos, img + no_boxes, "no annotations")


def test_check_coco_json_bad_json_and_folder(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    (p,) = check_coco_json(str(bad), str(tmp_path))
    assert p.level == "error" and p.file == str(bad) and "cannot read it as JSON" in p.message
    (p,) = check_coco_json(str(tmp_path / "none.json"), str(tmp_path))
    assert "does not exist" in p.message
    json_file, _ = _write_synthetic(tmp_path)
    problems = check_coco_json(json_file, str(tmp_path / "no_images"))
    assert (
        str(problems[0]) == f"ERROR: {tmp_path / 'no_images'}: image folder does not exist "
        "(no image file is checked)"
    )


# ---------------------------------------------------------------- the tools
def test_check_dataset_cli(tmp_path, prepared, capsys):
    tool = load_tool("check_dataset")
    json_file, image_root = _write_synthetic(tmp_path)
    assert tool.main([json_file, image_root]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(check_coco_json(json_file, image_root))
    assert tool.main(list(prepared.splits["trees_val"])) == 0
