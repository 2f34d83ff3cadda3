"""Export by tracing (aadet.export, tools/export_model.py): every demo architecture to ONNX, run in
onnxruntime on the CPU, and to TorchScript, against the eager PyTorch detections.

The compared outputs are the full graph's (NMS and the top-k cut included, as Detectron2 exports
RetinaNet): the same detections one to one, boxes within 1e-2 px and scores within 1e-4.
Random weights with a cls_score layer scaled so that scores spread over 0.2-0.75 (ties are
rare) and some pass the 0.3 threshold (4 with the attentional head, dozens with the others): the
boxes compared are real detections.
"""
import json
import os

import numpy as np
import pytest
import torch

from aadet.config import ConfigValueError
from aadet.engine import load_config
from aadet.export import (
    DEFAULT_ONNX_OPSET,
    ONNX_OPSETS,
    OUTPUT_NAMES,
    ExportedDetector,
    check_exportable,
    export_model,
    match_detections,
    sample_input,
)

from tests.helpers import REPO, load_tool
from tests.helpers.detectors import random_detector

DEMO = os.path.join(REPO, "configs", "Demo")
SIZE = 128  # model input H = W
BOX_TOL, SCORE_TOL = 1e-2, 1e-4  # px, probability
SCORE_THRESH = 0.3
SMALL = ["MODEL.DEVICE", "cpu", "INPUT.MIN_SIZE_TEST", SIZE, "INPUT.MAX_SIZE_TEST", SIZE,
         "MODEL.RETINANET.SCORE_THRESH_TEST", SCORE_THRESH]

try:
    import onnx
    import onnxruntime as ort
except ImportError:  # the export extra is not installed: the tests that run ONNX are skipped
    onnx = ort = None
needs_onnx = pytest.mark.skipif(onnx is None, reason="needs onnx and onnxruntime: pip install -e '.[export]'")


def eager(model, image):
    with torch.no_grad():
        return model([{"image": image}])[0]["instances"]


def op_types(graph):
    """Every node's op type, subgraphs (If/Loop bodies) included."""
    for node in graph.node:
        yield node.op_type
        for attr in node.attribute:
            if attr.g is not None:
                yield from op_types(attr.g)


def assert_same_detections(ref, got, cfg):
    m = match_detections(ref, got, box_tol=BOX_TOL, score_tol=SCORE_TOL,
                         score_thresh=SCORE_THRESH, max_dets=cfg.TEST.DETECTIONS_PER_IMAGE)
    assert m.num_ref >= 3, f"only {m.num_ref} detections pass {SCORE_THRESH}: too few compared"
    assert m.ok and m.matched == m.num_ref == m.num_other, m
    assert m.max_box_diff <= BOX_TOL and m.max_score_diff <= SCORE_TOL, m
    return m


ARCHS = [
    pytest.param("trees_R_26_slim_FPN.yaml", id="conv"),
    pytest.param("trees_AA_R_26_slim_FPN.yaml", id="AA"),
    pytest.param("trees_SASA_R_26_slim_FPN.yaml", id="SASA", marks=pytest.mark.slow),
    pytest.param("trees_SASA_full_attention_R_26_slim.yaml", id="SASA-full", marks=pytest.mark.slow),
    pytest.param("trees_Halo_R_26_slim_FPN.yaml", id="Halo", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("config", ARCHS)
@needs_onnx
def test_onnx_and_torchscript_match_pytorch(config, tmp_path):
    cfg, model = random_detector(os.path.join(DEMO, config), SMALL)
    image = sample_input(cfg, size=(SIZE, SIZE))
    ref = eager(model, image)

    onnx_path = export_model(cfg, model, image, str(tmp_path), "onnx")
    proto = onnx.load(onnx_path)
    onnx.checker.check_model(proto)
    assert [o.name for o in proto.graph.output] == list(OUTPUT_NAMES)
    assert proto.opset_import[0].version == DEFAULT_ONNX_OPSET
    assert "NonMaxSuppression" in op_types(proto.graph)  # post-processing is inside the graph, as in Detectron2
    assert_same_detections(ref, ExportedDetector(onnx_path).run(image), cfg)

    ts_path = export_model(cfg, model, image, str(tmp_path), "torchscript")
    assert_same_detections(ref, ExportedDetector(ts_path).run(image), cfg)

    meta = json.load(open(onnx_path + ".json"))
    assert meta["input"]["shape"] == [3, SIZE, SIZE] and meta["input"]["channels"] == "BGR"
    assert meta["opset"] == DEFAULT_ONNX_OPSET and meta["outputs"] == list(OUTPUT_NAMES)


@pytest.mark.parametrize("opset", [ONNX_OPSETS[0], ONNX_OPSETS[-1]])
@needs_onnx
def test_opset_range_ends_export(opset, tmp_path):
    """The first and last supported opsets, on the AA model (relative logits, GN, NMS)."""
    cfg, model = random_detector(os.path.join(DEMO, "trees_AA_R_26_slim_FPN.yaml"), SMALL)
    image = sample_input(cfg, size=(SIZE, SIZE))
    path = export_model(cfg, model, image, str(tmp_path), "onnx", opset=opset)
    assert onnx.load(path).opset_import[0].version == opset
    assert_same_detections(eager(model, image), ExportedDetector(path).run(image), cfg)


def test_export_errors_name_the_key(tmp_path):
    cfg = load_config(os.path.join(DEMO, "trees_SASA_R_26_slim_FPN.yaml"),
                      ["MODEL.SASA.IMPL", "neighborhood"])
    with pytest.raises(ConfigValueError, match="MODEL.SASA.IMPL.*'auto', 'materialized'.*neighborhood"):
        check_exportable(cfg, "onnx")
    cfg = load_config(os.path.join(DEMO, "trees_AA_R_26_slim_FPN.yaml"), ["MODEL.AA.IMPL", "cpp"])
    with pytest.raises(ConfigValueError, match="MODEL.AA.IMPL.*'auto', 'materialized'.*'cpp'"):
        check_exportable(cfg, "torchscript")
    cfg = load_config(os.path.join(DEMO, "trees_Halo_R_26_slim_FPN.yaml"), ["MODEL.HALO.IMPL", "bmm"])
    with pytest.raises(ConfigValueError, match="MODEL.HALO.IMPL.*'auto', 'materialized'.*'bmm'"):
        check_exportable(cfg, "onnx")
    cfg = load_config(os.path.join(DEMO, "trees_R_26_slim_FPN.yaml"))
    with pytest.raises(ValueError, match=r"opset must be in \[13, 20\].*got 9"):
        check_exportable(cfg, "onnx", 9)
    with pytest.raises(ValueError, match="format must be one of"):
        check_exportable(cfg, "caffe2")
    with pytest.raises(ValueError, match="exactly one of"):
        sample_input(cfg)


@needs_onnx
def test_exported_model_rejects_other_sizes_and_matches_predictor_on_images(tmp_path):
    """ExportedDetector = Predictor: same resize, rescale to the original image; a model input
    of another size is an error naming the exported size."""
    from aadet.engine import Predictor

    cfg, model = random_detector(os.path.join(DEMO, "trees_R_26_slim_FPN.yaml"), SMALL)
    ckpt = str(tmp_path / "random.pth")
    torch.save({"model": model.state_dict()}, ckpt)
    predictor = Predictor(cfg, ckpt)
    image = np.random.default_rng(1).integers(0, 256, (256, 256, 3), dtype=np.uint8)  # -> 128
    path = export_model(cfg, predictor.model, sample_input(cfg, image=image), str(tmp_path), "onnx")
    exported = ExportedDetector(path)
    ref, got = predictor(image)["instances"], exported(image)["instances"]
    assert got.image_size == ref.image_size == (256, 256)
    m = match_detections(ref, got, box_tol=2 * BOX_TOL, score_tol=SCORE_TOL,
                         score_thresh=SCORE_THRESH, max_dets=cfg.TEST.DETECTIONS_PER_IMAGE)
    assert m.ok and m.matched == m.num_ref >= 10, m
    with pytest.raises(ValueError, match=r"exported for inputs of shape \[3, 128, 128\].*\[3, 96, 128\]"):
        exported.run(torch.zeros(3, 96, 128))
    with pytest.raises(ValueError, match=r"exported for inputs of shape"):
        exported(np.zeros((100, 200, 3), np.uint8))  # resized to 64 x 128


@needs_onnx
def test_tool_exports_both_formats_and_checks(tmp_path, capsys):
    tool = load_tool("export_model")

    cfg, model = random_detector(os.path.join(DEMO, "trees_R_26_slim_FPN.yaml"), SMALL)
    ckpt = str(tmp_path / "random.pth")
    torch.save({"model": model.state_dict()}, ckpt)
    out = str(tmp_path / "exported")
    written = tool.main([
        "--config-file", os.path.join(DEMO, "trees_R_26_slim_FPN.yaml"), "--weights", ckpt,
        "--format", "onnx", "torchscript", "--input-size", str(SIZE), str(SIZE),
        "--output", out, "--check", "--opts", *map(str, SMALL),
    ])
    assert written == {"onnx": os.path.join(out, "model.onnx"),
                       "torchscript": os.path.join(out, "model.ts")}
    text = capsys.readouterr().out
    assert text.count("check:") == 2 and "MISMATCH" not in text
    with pytest.raises(SystemExit):  # argparse: a format it does not know
        tool.main(["--config-file", "x.yaml", "--format", "caffe2", "--input-size", "8", "8",
                   "--output", out])
