#!/usr/bin/env python
"""Export a trained detector to TorchScript and/or ONNX by tracing (Detectron2's route).

  python tools/export_model.py --config-file configs/Demo/trees_AA_R_26_slim_FPN.yaml \
      --weights output/demo_aa/model_final.pth --format onnx torchscript \
      --input-size 400 400 --output exported/demo_aa --check

The graph takes one ``[3, H, W]`` float32 image (0-255, INPUT.FORMAT channel order, already
resized to the model's test size) and returns pred_boxes, pred_classes, scores, image_size, NMS
included; it is specialized to ``H x W`` (``--input-size``, or the resized ``--sample-image``).
``--check`` runs the exported file (onnxruntime / torch.jit) on the sample and compares its
detections with the PyTorch model's. See aadet/export/tracing.py for the details.
"""
import argparse
import logging
import sys

import torch
from detectron2.data import detection_utils as utils
from detectron2.utils.logger import setup_logger

import aadet  # noqa: F401  (registers models)
from aadet.engine import Predictor
from aadet.engine.tool_config import inference_settings, load_any_config
from aadet.export import (
    DEFAULT_ONNX_OPSET,
    EXPORT_FORMATS,
    ExportedDetector,
    check_exportable,
    export_model,
    match_detections,
    sample_input,
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-file", required=True, metavar="FILE", help="a YAML config or a LazyConfig .py")
    ap.add_argument("--weights", default=None, help="checkpoint (default: MODEL.WEIGHTS)")
    ap.add_argument("--format", nargs="+", choices=EXPORT_FORMATS, default=["onnx"])
    ap.add_argument("--opset", type=int, default=DEFAULT_ONNX_OPSET, help="ONNX opset")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--sample-image", help="trace on this image, resized like the Predictor")
    src.add_argument("--input-size", nargs=2, type=int, metavar=("H", "W"),
                     help="trace for model inputs of this size (after the test-time resize)")
    ap.add_argument("--output", required=True, help="folder for model.onnx / model.ts (+ .json)")
    ap.add_argument("--check", action="store_true",
                    help="run the exported model on the sample and compare with PyTorch")
    ap.add_argument("--opts", nargs=argparse.REMAINDER, default=[],
                    help="config overrides KEY VALUE ... (a LazyConfig .py: key=value ...)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    logger = setup_logger(name="aadet")
    logging.getLogger("aadet.export").setLevel(logging.INFO)
    cfg = load_any_config(args.config_file, args.opts)
    settings = inference_settings(cfg)
    for fmt in args.format:  # fail before building the model
        check_exportable(cfg, fmt, args.opset)
    predictor = Predictor(cfg, args.weights)  # strict weight loading
    model = predictor.model
    if args.sample_image:
        image = sample_input(cfg, image=utils.read_image(args.sample_image, format=settings.input_format))
    else:
        image = sample_input(cfg, size=args.input_size)
    results = {}
    for fmt in args.format:
        path = export_model(cfg, model, image, args.output, fmt, opset=args.opset)
        results[fmt] = path
        print(f"{fmt}: {path} (input [3, {image.shape[1]}, {image.shape[2]}])")
        if args.check:
            with torch.no_grad():
                ref = model([{"image": image.to(model.device)}])[0]["instances"].to("cpu")
            got = ExportedDetector(path).run(image)
            m = match_detections(
                ref, got, score_thresh=settings.score_thresh_test,
                max_dets=settings.detections_per_image,
            )
            print(
                f"  check: {m.num_other} detections vs PyTorch {m.num_ref}, {m.matched} matched, "
                f"max |box diff| {m.max_box_diff:.2e} px, max |score diff| {m.max_score_diff:.2e}"
                + ("" if m.ok else f"; MISMATCH: unmatched scores {m.unmatched_ref} / {m.unmatched_other}")
            )
            if not m.ok:
                logger.error("the exported %s model does not reproduce the PyTorch detections", fmt)
                sys.exit(1)
    return results


if __name__ == "__main__":
    main()
