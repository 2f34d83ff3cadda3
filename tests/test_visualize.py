"""The visualization tools write real images: detections (and ground truth side by side), and
augmented training samples."""
import os
import sys

import numpy as np
import pytest
import torch
from detectron2.modeling import build_model
from PIL import Image

import aadet  # noqa: F401
from aadet.engine import AADetCheckpointer, CheckpointMismatchError, load_config
from aadet.utils.visualizer import GAP, LEGEND_HEIGHT, TITLE_HEIGHT, enlarge_factor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
DEMO = os.path.join(REPO, "configs", "Demo", "trees_R_50_slim_FPN.yaml")

import visualize_data  # noqa: E402
import visualize_detections  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A demo model whose classifier bias is raised so that it 'detects' everywhere."""
    cfg = load_config(DEMO, ["MODEL.DEVICE", "cpu"])
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        model.head.cls_score.bias.fill_(3.0)
    path = str(tmp_path_factory.mktemp("ckpt"))
    AADetCheckpointer(model, path).save("model")
    return os.path.join(path, "model.pth")


def test_detections_on_a_folder_including_odd_images(checkpoint, tmp_path):
    """RGB, grayscale, RGBA, tiny (32x32) and large (4000x3000) images all work."""
    folder = tmp_path / "in"
    folder.mkdir()
    rng = np.random.RandomState(0)
    Image.fromarray(rng.randint(0, 255, (300, 400, 3), np.uint8)).save(folder / "rgb.png")
    Image.fromarray(rng.randint(0, 255, (200, 250), np.uint8), mode="L").save(folder / "gray.png")
    Image.fromarray(rng.randint(0, 255, (120, 90, 4), np.uint8), mode="RGBA").save(folder / "rgba.png")
    Image.fromarray(rng.randint(0, 255, (32, 32, 3), np.uint8)).save(folder / "tiny.jpg")
    Image.fromarray(np.full((3000, 4000, 3), 90, np.uint8)).save(folder / "large.jpg")
    out = tmp_path / "out"
    written = visualize_detections.main(
        ["--config-file", DEMO, "--weights", checkpoint, "--input", str(folder),
         "--output", str(out), "--threshold", "0.5", "MODEL.DEVICE", "cpu"]
    )
    assert len(written) == 5
    for path in written:
        img = np.asarray(Image.open(path))
        stem = os.path.splitext(os.path.basename(path))[0]
        (src,) = [f for f in os.listdir(folder) if os.path.splitext(f)[0] == stem]
        w, h = Image.open(folder / src).size
        f = enlarge_factor(h, w)  # small images are enlarged (nearest) for drawing
        assert img.shape[:2] == (f * h + LEGEND_HEIGHT, f * w)
        assert f == {"tiny": 16, "rgba": 6, "gray": 3, "rgb": 2, "large": 1}[stem]
    # boxes were drawn: the rgb render differs from its (converted) input
    drawn = np.asarray(Image.open(out / "rgb.png").convert("RGB")).astype(int)[:600]
    orig = np.asarray(Image.open(folder / "rgb.png").convert("RGB")).astype(int)
    orig = np.repeat(np.repeat(orig, 2, 0), 2, 1)
    assert np.abs(drawn - orig).sum() > 1000


def test_dataset_with_ground_truth_side_by_side(checkpoint, trees_root, tmp_path):
    from aadet.data import register_trees

    register_trees(trees_root)
    written = visualize_detections.main(
        ["--config-file", DEMO, "--weights", checkpoint, "--dataset", "trees_val", "--show-gt",
         "--max-images", "1", "--output", str(tmp_path), "MODEL.DEVICE", "cpu"]
    )
    (path,) = written
    img = np.asarray(Image.open(path))
    # ground truth | detections: two 400 px tiles enlarged 2x, legend strips, titles, gap
    assert img.shape[:2] == (800 + LEGEND_HEIGHT + TITLE_HEIGHT, 2 * 800 + GAP)
    assert img.std() > 10


def test_mismatched_checkpoint_is_refused(tmp_path):
    other = build_model(load_config(DEMO, ["MODEL.DEVICE", "cpu", "MODEL.RETINANET.NUM_CLASSES", "3"]))
    AADetCheckpointer(other, str(tmp_path)).save("other")
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "x.png")
    with pytest.raises(CheckpointMismatchError, match="cls_score"):
        visualize_detections.main(
            ["--config-file", DEMO, "--weights", str(tmp_path / "other.pth"), "--input",
             str(tmp_path / "x.png"), "--output", str(tmp_path / "o"), "MODEL.DEVICE", "cpu"]
        )


def test_missing_or_corrupt_input_is_named(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        visualize_detections.main(["--config-file", DEMO, "--weights", checkpoint, "--input",
                                   str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(RuntimeError, match="bad.png"):
        visualize_detections.main(["--config-file", DEMO, "--weights", checkpoint, "--input",
                                   str(tmp_path / "bad.png"), "--output", str(tmp_path / "o")])


def test_augmented_training_samples(trees_root, tmp_path):
    from aadet.data import register_trees

    register_trees(trees_root)
    written = visualize_data.main(["--config-file", DEMO, "--output", str(tmp_path), "-n", "3"])
    assert len(written) == 3
    for path in written:
        img = np.asarray(Image.open(path))
        assert img.shape[:2] == (256, 256)  # crop/pad size of the demo recipe (INPUT.SCALE_JITTER)
        assert img.std() > 10


def test_attention_maps_of_an_aa_layer(tmp_path):
    """Figure-10 style: heads x pixels maps, each a distribution over the attention grid."""
    import visualize_attention

    aa_cfg = os.path.join(REPO, "configs", "Demo", "trees_AA_R_50_slim_FPN.yaml")
    cfg = load_config(aa_cfg, ["MODEL.DEVICE", "cpu"])
    torch.manual_seed(0)
    AADetCheckpointer(build_model(cfg), str(tmp_path)).save("aa")
    rng = np.random.RandomState(0)
    Image.fromarray(rng.randint(0, 255, (300, 360, 3), np.uint8)).save(tmp_path / "img.png")
    out, maps = visualize_attention.main(
        ["--config-file", aa_cfg, "--weights", str(tmp_path / "aa.pth"), "--image",
         str(tmp_path / "img.png"), "--pixels", "10,20", "200,150", "359,299",
         "--output", str(tmp_path / "att.png"), "MODEL.DEVICE", "cpu"]
    )
    assert maps.shape[:2] == (cfg.MODEL.AA.NUM_HEADS, 3)
    np.testing.assert_allclose(maps.sum(axis=(2, 3)), 1.0, rtol=1e-4)
    img = np.asarray(Image.open(out))
    assert img.shape[0] > 200 and img.std() > 10
    with pytest.raises(SystemExit):
        visualize_attention.main(["--config-file", aa_cfg, "--weights", str(tmp_path / "aa.pth"),
                                  "--image", str(tmp_path / "img.png"), "--pixels", "1,1",
                                  "--layer", "backbone.nope", "MODEL.DEVICE", "cpu"])
