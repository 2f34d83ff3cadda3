"""``datasets/prepare_trees.py`` and its code (``datasets/prepare_trees.py``): the demo
tree-crown dataset read from the pinned ``deepforest==2.1.0`` wheel, tiled by the rule, never
half-written, rebuilt only when it changed.

The wheel is found at ``$AADET_DEMO_WHEEL``, else ``./datasets/.cache/``, else downloaded once with
pip into pytest's cache (``.pytest_cache``); ``prepared`` and ``scratch`` are ``conftest.py``'s.
"""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from PIL import Image

from aadet.data import trees
import prepare_trees as demo_trees
from prepare_trees import SOURCES, WHEEL_DATA_DIR, WHEEL_NAME

from tests.helpers import REPO

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


def test_sources_are_the_registered_splits():
    assert tuple(SOURCES) == trees.SPLITS


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

# ---------------------------------------------------------------- the command
@pytest.mark.slow  # a fresh interpreter importing Detectron2 (test_prepare_demo_data_cli is fast)
def test_prepare_demo_data_script_runs_from_anywhere(prepared, wheel, tmp_path):
    """``python datasets/prepare_trees.py`` imports the installed ``aadet`` with no ``sys.path``
    edits (here ``aadet`` comes from $PYTHONPATH)."""
    root = os.path.dirname(prepared.dataset_dir)
    cmd = [sys.executable, os.path.join(REPO, "datasets", "prepare_trees.py"), "--root", root,
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
    tool = demo_trees
    root = os.path.dirname(prepared.dataset_dir)
    assert tool.main(["--root", root, "--wheel", wheel]) == 0
    assert "(up to date)" in capsys.readouterr().out
    assert tool.main(["--root", str(tmp_path), "--wheel", str(tmp_path / "x.whl")]) == 1
    assert "x.whl does not exist" in capsys.readouterr().err
