"""Tests of the demo tree-crown dataset (made by ``aadet.data.prepare_trees``, registered by
``aadet.data``), COCO registration and the dataset checker.

The pinned ``deepforest==2.1.0`` wheel is found at ``$AADET_DEMO_WHEEL``, else
``./datasets/.cache/``, else downloaded once with pip into pytest's cache (``.pytest_cache``).
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from PIL import Image

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.structures import BoxMode

from aadet.data import check_coco_json, register_coco_detection, register_trees, trees
from aadet.data import prepare_trees as demo_trees
from aadet.data.prepare_trees import SOURCES, WHEEL_DATA_DIR, WHEEL_NAME

from tests.helpers import REPO, load_tool

VAL_STEM = "2019_YELL_2_541000_4977000_image_crop"
TEST_STEM = "SOAP_061"
EXPECTED_SOURCES = {  # stem: (width, height, boxes)
    "2019_YELL_2_528000_4978000_image_crop2": (2299, 2472, 574),
    VAL_STEM: (1249, 1035, 279),
    "OSBS_029": (400, 400, 61),
    TEST_STEM: (400, 400, 37),
}
COUNTS = {  # dataset: tiles and boxes of the prepared data
    "trees_train": {"images": 62, "boxes": 1067},
    "trees_val": {"images": 12, "boxes": 414},
    "trees_test": {"images": 1, "boxes": 37},
}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def sources(wheel):
    with zipfile.ZipFile(wheel) as z:
        return {
            stem: demo_trees.parse_voc_xml(z.read(f"{WHEEL_DATA_DIR}{stem}.xml"), source=stem)
            for stem in EXPECTED_SOURCES
        }


@pytest.fixture(scope="session")
def prepared(wheel, tmp_path_factory):
    """A complete build, shared: tests must not change it (copy it with ``scratch``)."""
    return demo_trees.prepare(str(tmp_path_factory.mktemp("data")), wheel=wheel)


@pytest.fixture()
def scratch(prepared, tmp_path):
    """A private copy of the prepared data root, for tests that damage it."""
    root = tmp_path / "root"
    shutil.copytree(os.path.dirname(prepared.dataset_dir), root)
    return str(root)


@pytest.fixture()
def restore_trees_registration():
    yield
    register_trees()  # back to the default root, as after `import aadet.data`


def _load_json(path):
    with open(path) as f:
        return json.load(f)


def _split_json(prepared, split):
    json_file, image_root = prepared.splits[f"trees_{split}"]
    return _load_json(json_file), image_root


def _tmp_dirs(root):
    return [
        n for n in os.listdir(root) if n.startswith(".trees.tmp-") or n.startswith(".trees.old-")
    ]


# ---------------------------------------------------------------- pure functions
def test_sources_in_wheel(sources):
    for stem, (w, h, n) in EXPECTED_SOURCES.items():
        ann = sources[stem]
        assert (ann.width, ann.height, len(ann.boxes)) == (w, h, n), stem
        # SOAP_061 labels its crowns "Dead" / "Alive"; all are the one class Tree
        assert set(ann.labels) == ({"Dead", "Alive"} if stem == TEST_STEM else {"Tree"}), stem
        assert (ann.boxes[:, 2] > ann.boxes[:, 0]).all() and (
            ann.boxes[:, 3] > ann.boxes[:, 1]
        ).all()


def test_parse_voc_xml_errors(tmp_path):
    good = b"<annotation><size><width>10</width><height>8</height></size>%s</annotation>"
    obj = (
        b"<object><name>Tree</name><bndbox><xmin>%s</xmin><ymin>1</ymin>"
        b"<xmax>%s</xmax><ymax>5</ymax></bndbox></object>"
    )
    ann = demo_trees.parse_voc_xml(good % (obj % (b"1", b"4")))
    np.testing.assert_array_equal(ann.boxes, [[1, 1, 4, 5]])
    path = tmp_path / "a.xml"
    path.write_bytes(good % (obj % (b"4", b"4")))
    with pytest.raises(ValueError, match=r"a\.xml: <object> #0 .*empty box"):
        demo_trees.parse_voc_xml(str(path))
    with pytest.raises(ValueError, match=r"x\.xml: <object> #0 <bndbox> <xmin> is 'abc'"):
        demo_trees.parse_voc_xml(good % (obj % (b"abc", b"4")), source="x.xml")
    with pytest.raises(ValueError, match=r"outside the 10x8 image"):
        demo_trees.parse_voc_xml(good % (obj % (b"1", b"40")))
    with pytest.raises(ValueError, match=r"no <size>"):
        demo_trees.parse_voc_xml(b"<annotation></annotation>")
    with pytest.raises(ValueError, match=r"not a valid XML"):
        demo_trees.parse_voc_xml(b"<annotation>")


def test_tile_offsets():
    assert demo_trees.tile_offsets(1249, 400, 400) == [0, 283, 566, 849]
    assert demo_trees.tile_offsets(1035, 400, 400) == [0, 318, 635]
    assert demo_trees.tile_offsets(400, 400, 300) == [0]
    assert demo_trees.tile_offsets(250, 400, 300) == [0]
    rng = np.random.default_rng(0)
    for _ in range(500):
        tile = int(rng.integers(1, 600))
        stride = int(rng.integers(1, tile + 1))
        length = int(rng.integers(tile + 1, 5000))
        offs = demo_trees.tile_offsets(length, tile, stride)
        gaps = np.diff(offs)
        assert offs[0] == 0 and offs[-1] == length - tile
        assert (gaps >= 1).all() and (gaps <= stride).all(), (length, tile, stride, offs)
        # fewest windows: one fewer could not cover the image with spacing <= stride
        assert (len(offs) - 2) * stride < length - tile
    with pytest.raises(ValueError, match=r"stride must be in \[1, tile_size=400\]"):
        demo_trees.tile_offsets(1000, 400, 401)


def test_clipping_rule():
    boxes = np.array(
        [
            [10, 10, 20, 20],  # inside: kept unchanged
            [90, 0, 110, 10],  # 50% inside: kept, clipped
            [94, 0, 114, 10],  # 30% inside: dropped
            [-6, 50, 14, 60],  # 70% inside: kept, clipped
            [200, 200, 210, 210],  # outside
        ],
        dtype=float,
    )
    clipped, keep = demo_trees.clip_boxes_to_window(boxes, (0, 0, 100, 100), 0.5)
    assert keep.tolist() == [0, 1, 3]
    np.testing.assert_array_equal(clipped, [[10, 10, 20, 20], [90, 0, 100, 10], [0, 50, 14, 60]])
    clipped, keep = demo_trees.clip_boxes_to_window(
        boxes, (50, 0, 150, 100), 0.5
    )  # window coordinates
    assert keep.tolist() == [1, 2]
    np.testing.assert_array_equal(clipped, [[40, 0, 60, 10], [44, 0, 64, 10]])


def test_tile_file_name_roundtrip():
    name = demo_trees.tile_file_name(VAL_STEM, 283, 0)
    assert name == f"{VAL_STEM}_x0283_y0000.png"
    assert demo_trees.parse_tile_file_name("/a/b/" + name) == (VAL_STEM, 283, 0)


def test_default_root(monkeypatch):
    monkeypatch.delenv("AADET_DATASETS", raising=False)
    monkeypatch.delenv("DETECTRON2_DATASETS", raising=False)
    assert trees.default_root() == "datasets"
    monkeypatch.setenv("DETECTRON2_DATASETS", "/d2")
    assert trees.default_root() == "/d2"
    monkeypatch.setenv("AADET_DATASETS", "/aa")
    assert trees.default_root() == "/aa"


# ---------------------------------------------------------------- the prepared dataset
def test_layout_and_coco_fields(prepared):
    assert prepared.built
    assert set(prepared.splits) == {"trees_train", "trees_val", "trees_test"}
    for split in trees.SPLITS:
        coco, image_root = _split_json(prepared, split)
        assert coco["categories"] == [{"id": 1, "name": "Tree"}]
        assert os.path.dirname(image_root) == prepared.dataset_dir
        image_ids = [im["id"] for im in coco["images"]]
        assert len(set(image_ids)) == len(image_ids)
        sizes = {}
        for im in coco["images"]:
            assert set(im) == {"id", "file_name", "height", "width"}
            assert "/" not in im["file_name"] and im["file_name"].endswith(".png")
            with Image.open(os.path.join(image_root, im["file_name"])) as f:
                assert f.size == (im["width"], im["height"]) == (400, 400) and f.mode == "RGB"
            sizes[im["id"]] = (im["width"], im["height"])
        ann_ids = [a["id"] for a in coco["annotations"]]
        assert len(set(ann_ids)) == len(ann_ids)
        for a in coco["annotations"]:
            assert set(a) == {"id", "image_id", "category_id", "bbox", "area", "iscrowd"}
            assert a["category_id"] == 1 and a["iscrowd"] == 0
            x, y, w, h = a["bbox"]
            assert all(isinstance(v, float) for v in a["bbox"])
            W, H = sizes[a["image_id"]]
            assert 0 <= x and 0 <= y and w > 0 and h > 0 and x + w <= W and y + h <= H, a
            assert a["area"] == pytest.approx(w * h)
        assert sorted(os.listdir(image_root)) == sorted(im["file_name"] for im in coco["images"])


def test_split_by_source_image(prepared):
    train_sources = {
        demo_trees.parse_tile_file_name(im["file_name"])[0]
        for im in _split_json(prepared, "train")[0]["images"]
    }
    val_sources, test_sources = (
        {
            demo_trees.parse_tile_file_name(im["file_name"])[0]
            for im in _split_json(prepared, split)[0]["images"]
        }
        for split in ("val", "test")
    )
    assert val_sources == {VAL_STEM} and test_sources == {TEST_STEM}
    assert train_sources == set(SOURCES["train"])
    assert not train_sources & val_sources and not (train_sources | val_sources) & test_sources
    assert not any(VAL_STEM in n or TEST_STEM in n for n in os.listdir(prepared.splits["trees_train"][1]))
    assert not any(TEST_STEM in n for n in os.listdir(prepared.splits["trees_val"][1]))


def test_test_split_keeps_dead_and_alive_crowns_as_trees(sources):
    """SOAP_061's XML labels 28 crowns "Dead" and 9 "Alive": all are the one class, Tree."""
    labels = sources[TEST_STEM].labels
    assert (labels.count("Dead"), labels.count("Alive"), len(labels)) == (28, 9, 37)


def _expected_tile_boxes(src, x0, y0, tw, th):
    """Brute force of the clipping rule, box by box, in tile coordinates."""
    out = []
    for bx0, by0, bx1, by1 in src.boxes.tolist():
        ix0, iy0, ix1, iy1 = max(bx0, x0), max(by0, y0), min(bx1, x0 + tw), min(by1, y0 + th)
        inter = max(0.0, ix1 - ix0) * max(0.0, iy1 - iy0)
        if inter > 0 and inter >= 0.5 * (bx1 - bx0) * (by1 - by0):
            out.append((ix0 - x0, iy0 - y0, ix1 - x0, iy1 - y0))
    return sorted(out)


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_tiles_follow_the_rule_exactly(prepared, sources, split):
    coco, _ = _split_json(prepared, split)
    by_image = {}
    for a in coco["annotations"]:
        x, y, w, h = a["bbox"]
        by_image.setdefault(a["image_id"], []).append((x, y, x + w, y + h))
    stride = demo_trees.TRAIN_STRIDE if split == "train" else demo_trees.VAL_STRIDE
    got_tiles = set()
    for im in coco["images"]:
        stem, x0, y0 = demo_trees.parse_tile_file_name(im["file_name"])
        got_tiles.add((stem, x0, y0))
        expected = _expected_tile_boxes(sources[stem], x0, y0, im["width"], im["height"])
        got = np.array(sorted(by_image.get(im["id"], []))).reshape(-1, 4)
        np.testing.assert_allclose(got, np.array(expected).reshape(-1, 4), err_msg=im["file_name"])
    # which tiles exist: all windows for val, the non-empty ones for train
    want_tiles = set()
    for stem in SOURCES[split]:
        src = sources[stem]
        for y0 in demo_trees.tile_offsets(src.height, 400, stride):
            for x0 in demo_trees.tile_offsets(src.width, 400, stride):
                if split != "train" or _expected_tile_boxes(
                    src, x0, y0, min(400, src.width), min(400, src.height)
                ):
                    want_tiles.add((stem, x0, y0))
    assert got_tiles == want_tiles
    counts = COUNTS[f"trees_{split}"]
    assert (len(coco["images"]), len(coco["annotations"])) == (counts["images"], counts["boxes"])


def test_every_source_box_is_whole_in_some_tile(prepared, sources):
    """With the chosen tiling no box is lost, and each appears unclipped in at least one tile."""
    for split in trees.SPLITS:
        coco, _ = _split_json(prepared, split)
        images = {
            im["id"]: demo_trees.parse_tile_file_name(im["file_name"]) for im in coco["images"]
        }
        seen = {stem: set() for stem in SOURCES[split]}
        for a in coco["annotations"]:
            stem, x0, y0 = images[a["image_id"]]
            x, y, w, h = a["bbox"]
            seen[stem].add((x + x0, y + y0, x + w + x0, y + h + y0))
        for stem in SOURCES[split]:
            missing = [b for b in map(tuple, sources[stem].boxes.tolist()) if b not in seen[stem]]
            assert not missing, f"{stem}: {len(missing)} boxes not whole in any tile"


def test_tile_pixels_are_the_source_crop(prepared, wheel):
    coco, image_root = _split_json(prepared, "val")
    name = coco["images"][5]["file_name"]
    stem, x0, y0 = demo_trees.parse_tile_file_name(name)
    with zipfile.ZipFile(wheel) as z, z.open(f"{WHEEL_DATA_DIR}{stem}.png") as f:
        src = np.asarray(Image.open(f).convert("RGB"))
    tile = np.asarray(Image.open(os.path.join(image_root, name)))
    np.testing.assert_array_equal(tile, src[y0 : y0 + 400, x0 : x0 + 400])


def test_manifest(prepared):
    manifest = _load_json(os.path.join(prepared.dataset_dir, "MANIFEST.json"))
    assert manifest["params"]["wheel_sha256"] == demo_trees.WHEEL_SHA256
    assert manifest["params"]["tile_size"] == 400
    assert manifest["counts"] == COUNTS
    assert {"annotations/trees_val.json", "annotations/trees_test.json"} <= set(manifest["files"])


# ---------------------------------------------------------------- idempotence and interrupted runs
def test_second_run_does_nothing(prepared, wheel, capsys):
    root = os.path.dirname(prepared.dataset_dir)
    files = [os.path.join(d, n) for d, _, ns in os.walk(prepared.dataset_dir) for n in ns]
    before = {p: os.stat(p).st_mtime_ns for p in files}
    again = demo_trees.prepare(root, wheel=wheel)
    assert not again.built and again.splits == prepared.splits
    again = demo_trees.prepare(root)  # no wheel needed when complete: no download
    assert not again.built
    assert {p: os.stat(p).st_mtime_ns for p in files} == before
    assert not os.path.exists(os.path.join(root, ".cache"))
    out = capsys.readouterr().out
    assert "trees_train: 62 images, 1067 boxes" in out and "trees_val: 12 images, 414 boxes" in out
    assert "trees_test: 1 images, 37 boxes" in out
    assert not _tmp_dirs(root)


def test_failure_mid_write_leaves_no_dataset(tmp_path, wheel, monkeypatch):
    calls = []

    def failing_save(image, path):
        calls.append(path)
        if len(calls) == 10:
            raise KeyboardInterrupt  # like Ctrl-C while writing tiles
        image.save(path, format="PNG")

    monkeypatch.setattr(demo_trees, "_save_tile", failing_save)
    root = str(tmp_path / "root")
    with pytest.raises(KeyboardInterrupt):
        demo_trees.prepare(root, wheel=wheel)
    assert not os.path.exists(os.path.join(root, "trees")) and not _tmp_dirs(root)
    monkeypatch.undo()
    assert demo_trees.prepare(root, wheel=wheel).built


def test_failed_rebuild_keeps_the_complete_dataset(scratch, wheel, monkeypatch):
    def failing_save(image, path):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(demo_trees, "_save_tile", failing_save)
    with pytest.raises(OSError, match="No space left"):
        demo_trees.prepare(scratch, wheel=wheel, force=True)
    monkeypatch.undo()
    assert not _tmp_dirs(scratch)
    assert not demo_trees.prepare(scratch, wheel=wheel).built  # still complete


def test_killed_run_is_not_mistaken_for_complete(scratch, wheel):
    """A hard kill leaves a tmp folder; an old or hand-made folder may lack the manifest."""
    dataset_dir = os.path.join(scratch, "trees")
    os.remove(os.path.join(dataset_dir, "MANIFEST.json"))
    os.makedirs(os.path.join(scratch, ".trees.tmp-killed", "train"))
    result = demo_trees.prepare(scratch, wheel=wheel)
    assert result.built
    assert os.path.isfile(os.path.join(dataset_dir, "MANIFEST.json")) and not _tmp_dirs(scratch)


def test_missing_file_rebuilds(scratch, wheel, capsys):
    val_dir = os.path.join(scratch, "trees", "val")
    victim = sorted(os.listdir(val_dir))[0]
    os.remove(os.path.join(val_dir, victim))
    assert demo_trees.prepare(scratch, wheel=wheel).built
    assert victim in capsys.readouterr().out  # "Rebuilding ...: .../val/<victim> is missing"
    assert os.path.isfile(os.path.join(val_dir, victim))


def test_changed_parameters_rebuild(scratch, wheel, capsys):
    result = demo_trees.prepare(scratch, wheel=wheel, val_stride=300)
    assert result.built
    assert "parameters changed" in capsys.readouterr().out
    coco = _load_json(result.splits["trees_val"][0])
    windows = len(demo_trees.tile_offsets(1249, 400, 300)) * len(
        demo_trees.tile_offsets(1035, 400, 300)
    )
    assert len(coco["images"]) == windows == 4 * 4  # 1035 px tall: 3 -> 4 rows at stride <= 300
    assert not demo_trees.prepare(scratch, wheel=wheel, val_stride=300).built


def test_bad_parameters_and_wheels(tmp_path, monkeypatch):
    with pytest.raises(
        ValueError, match=r"val_stride must be an integer in \[1, tile_size=400\], got 500"
    ):
        demo_trees.prepare(str(tmp_path), val_stride=500)
    with pytest.raises(ValueError, match=r"min_visible must be in \(0, 1\]"):
        demo_trees.prepare(str(tmp_path), min_visible=0)
    with pytest.raises(FileNotFoundError, match="nope.whl"):
        demo_trees.prepare(str(tmp_path), wheel=str(tmp_path / "nope.whl"))
    fake = tmp_path / WHEEL_NAME
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(f"{WHEEL_DATA_DIR}OSBS_029.xml", b"<annotation/>")
    with pytest.raises(
        ValueError, match=r"sha256 is [0-9a-f]{64}, expected " + demo_trees.WHEEL_SHA256
    ):
        demo_trees.prepare(str(tmp_path), wheel=str(fake))


def test_missing_or_corrupt_source_in_wheel(tmp_path, wheel, monkeypatch):
    """A wheel without a source file, or with an undecodable image, stops naming the member."""
    stem = SOURCES["train"][0]
    broken = {
        f"{WHEEL_DATA_DIR}{stem}.png": None,
        f"{WHEEL_DATA_DIR}{VAL_STEM}.png": b"\x89PNG\r\n\x1a\n garbage",
    }
    for member, content in broken.items():
        fake = tmp_path / f"{len(member)}-{WHEEL_NAME}"
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(fake, "w") as dst:
            for info in src.infolist():
                if info.filename.startswith(WHEEL_DATA_DIR) and info.filename != member:
                    dst.writestr(info, src.read(info))
            if content is not None:
                dst.writestr(member, content)
        monkeypatch.setattr(demo_trees, "WHEEL_SHA256", demo_trees._sha256(str(fake)))
        root = str(tmp_path / "root")
        error = FileNotFoundError if content is None else ValueError
        with pytest.raises(error, match=f"{fake}.*{member}"):
            demo_trees.prepare(root, wheel=str(fake))
        assert not os.path.exists(os.path.join(root, "trees")) and not _tmp_dirs(root)


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
    assert f"python tools/prepare_demo_data.py --root {missing}" in msg


def test_import_registers_default_names():
    assert {"trees_train", "trees_val", "trees_test"} <= set(DatasetCatalog.list())
    assert trees.SPLITS == tuple(SOURCES) and set(trees.dataset_paths()) == {
        "trees_train", "trees_val", "trees_test"}
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'val', 'test'\), got 'eval'"):
        trees.dataset_name("eval")


# Source text that marks download / archive / file-preparation code (tools/demo_trees.py has all).
_PREP_MARKERS = ("import zipfile", "import urllib", "from urllib", "pip download", '"download"',
                 "import subprocess", "import shutil", "import hashlib")
# Modules that use a marker's module for something else, and what for.
_MARKERS_ALLOWED = {
    # run summaries: `git rev-parse HEAD` for the commit, sha256 of the resolved config
    "aadet.utils.run_summary": {"import subprocess", "import hashlib"},
    # the weights fingerprint that ranks compare
    "aadet.engine.rank_sync": {"import hashlib"},
    # the C++ kernels' build cache key (their sources, flags and CPU)
    "aadet.layers.functional.backends.cpu_kernels": {"import hashlib"},
}


def test_importing_aadet_loads_no_data_preparation_code():
    """``import aadet`` (with its data, engine and analysis packages) loads no download or
    preparation code: in a fresh interpreter no prep module is imported and no loaded module of
    ours contains a downloader (zipfile / urllib / pip / subprocess)."""
    code = (
        "import json, sys\n"
        "import aadet, aadet.data, aadet.engine, aadet.analysis\n"
        "mods = {n: getattr(m, '__file__', None) for n, m in list(sys.modules.items())}\n"
        "print(json.dumps(mods))\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    mods = json.loads(p.stdout.strip().splitlines()[-1])
    assert "aadet.data.trees" in mods and mods["aadet"].startswith(REPO)
    prep = [n for n in mods if "demo_trees" in n or "prepare" in n.split(".")[-1]]
    assert prep == [], f"import aadet loaded preparation modules {prep}"
    ours = {n: f for n, f in mods.items() if (n == "aadet" or n.startswith("aadet.")) and f}
    assert len(ours) > 10, sorted(ours)  # the check below looks at real modules
    for name, path in ours.items():
        with open(path) as f:
            source = f.read()
        found = [m for m in _PREP_MARKERS if m in source and m not in _MARKERS_ALLOWED.get(name, ())]
        assert not found, f"{name} ({path}) is loaded by `import aadet` and contains {found}"
    with open(demo_trees.__file__) as f:  # the markers do find the real preparation code
        source = f.read()
    assert all(m in source for m in ("import zipfile", "import subprocess", '"download"'))


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


@pytest.mark.slow  # a fresh interpreter importing Detectron2 (test_prepare_demo_data_cli is fast)
def test_prepare_demo_data_script_runs_from_anywhere(prepared, wheel, tmp_path):
    """``python tools/prepare_demo_data.py`` imports the installed ``aadet`` with no ``sys.path``
    edits (here ``aadet`` comes from $PYTHONPATH)."""
    root = os.path.dirname(prepared.dataset_dir)
    cmd = [sys.executable, os.path.join(REPO, "tools", "prepare_demo_data.py"), "--root", root,
           "--wheel", wheel]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == [
        "trees_train: 62 images, 1067 boxes -> "
        f"{prepared.splits['trees_train'][0]} (up to date)",
        f"trees_val: 12 images, 414 boxes -> {prepared.splits['trees_val'][0]} (up to date)",
        f"trees_test: 1 images, 37 boxes -> {prepared.splits['trees_test'][0]} (up to date)",
    ]


def test_prepare_demo_data_cli(prepared, wheel, tmp_path, capsys):
    tool = load_tool("prepare_demo_data")
    root = os.path.dirname(prepared.dataset_dir)
    assert tool.main(["--root", root, "--wheel", wheel]) == 0
    assert "(up to date)" in capsys.readouterr().out
    assert tool.main(["--root", str(tmp_path), "--wheel", str(tmp_path / "x.whl")]) == 1
    assert "x.whl does not exist" in capsys.readouterr().err
