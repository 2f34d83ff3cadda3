#!/usr/bin/env python
"""Draw a trained detector's detections (and optionally the ground truth beside them) to PNGs.

  python tools/visualize_detections.py --config-file CFG --weights output/model_final.pth \
      --dataset trees_val --output vis/ --show-gt
  python tools/visualize_detections.py --config-file CFG --weights W --input my_images/ --output vis/

Drawing is :mod:`aadet.utils.visualizer`: small images are enlarged (short side >= --min-side),
crowded scenes (more than --max-labels boxes) get no text per box but a colour bar by score, and
ground truth | detections panels have the same scale and canvas size.
"""
import argparse
import os

import numpy as np
from detectron2.data import DatasetCatalog, MetadataCatalog
from PIL import Image

import aadet  # noqa: F401
from aadet.data import register_trees
from aadet.engine import Predictor
from aadet.engine.tool_config import inference_settings, load_any_config
from aadet.utils.images import IMAGE_EXTS, read_image, to_rgb
from aadet.utils.visualizer import MAX_LABELS, MIN_SIDE, draw_instances, enlarge_factor, side_by_side


def list_inputs(args):
    """``(file_name, dataset_dict or None)`` pairs from --input or --dataset."""
    if args.dataset:
        dicts = DatasetCatalog.get(args.dataset)
        return [(d["file_name"], d) for d in dicts]
    files = []
    for p in args.input:
        if os.path.isdir(p):
            files += sorted(
                os.path.join(p, f) for f in os.listdir(p) if f.lower().endswith(IMAGE_EXTS)
            )
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"--input: no such file or folder: {p}")
    if not files:
        raise FileNotFoundError(f"--input: no images ({', '.join(IMAGE_EXTS)}) in {args.input}")
    return [(f, None) for f in files]


def _gt_boxes(record):
    """``(boxes [K, 4] XYXY, classes [K])`` of a dataset dict's non-crowd annotations."""
    from detectron2.structures import BoxMode

    anns = [a for a in record.get("annotations", []) if not a.get("iscrowd", 0)]
    boxes = [BoxMode.convert(a["bbox"], a["bbox_mode"], BoxMode.XYXY_ABS) for a in anns]
    return np.asarray(boxes, np.float64).reshape(-1, 4), np.array([a["category_id"] for a in anns], np.int64)


def render(predictor, cfg, metadata, file_name, record, threshold, show_gt,
           min_side=MIN_SIDE, max_labels=MAX_LABELS):
    """The picture of one image: detections, or ground truth | detections; ``(rgb, count)``."""
    fmt = inference_settings(cfg).input_format
    image = read_image(file_name, fmt)
    instances = predictor(image)["instances"].to("cpu")
    instances = instances[instances.scores >= threshold]
    rgb = np.ascontiguousarray(to_rgb(image, fmt))
    names = metadata.get("thing_classes", None)
    factor = enlarge_factor(*rgb.shape[:2], min_side=min_side)
    pred = draw_instances(
        rgb, instances.pred_boxes.tensor.numpy(), instances.scores.numpy(),
        instances.pred_classes.numpy(), names, threshold=threshold, factor=factor,
        max_labels=max_labels,
    )
    if show_gt and record is not None:
        boxes, classes = _gt_boxes(record)
        gt = draw_instances(rgb, boxes, None, classes, names, factor=factor, max_labels=max_labels)
        pred = side_by_side(gt, pred, titles=("ground truth", "detections"))
    return pred, len(instances)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", default=None, help="checkpoint (default: MODEL.WEIGHTS)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="image files and/or folders")
    src.add_argument("--dataset", help="a registered dataset name, e.g. trees_val")
    ap.add_argument("--output", required=True, help="folder for the PNGs")
    ap.add_argument("--threshold", type=float, default=0.5, help="minimum score drawn")
    ap.add_argument("--min-side", type=int, default=MIN_SIDE,
                    help="enlarge smaller images (nearest neighbour) until the short side is this")
    ap.add_argument("--max-labels", type=int, default=MAX_LABELS,
                    help="above this many boxes in an image, no text per box (colours + legend)")
    ap.add_argument("--max-images", type=int, default=0, help="0 = all")
    ap.add_argument("--show-gt", action="store_true", help="ground truth side by side (--dataset)")
    ap.add_argument("opts", nargs=argparse.REMAINDER,
                    help="config overrides KEY VALUE ... (a LazyConfig .py: key=value ...)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.threshold <= 1.0:
        ap.error(f"--threshold must be in [0, 1]; got {args.threshold}")
    if args.min_side < 1 or args.max_labels < 0:
        ap.error(f"--min-side must be >= 1 and --max-labels >= 0; got {args.min_side}, {args.max_labels}")

    register_trees()
    cfg = load_any_config(args.config_file, args.opts)
    predictor = Predictor(cfg, args.weights)
    test = inference_settings(cfg).test_datasets
    name = args.dataset or (test[0] if test else "__unused")
    metadata = MetadataCatalog.get(name)
    if not metadata.get("thing_classes") and name in DatasetCatalog.list():
        DatasetCatalog.get(name)  # a COCO json sets thing_classes when loaded
    items = list_inputs(args)
    if args.max_images > 0:
        items = items[: args.max_images]
    os.makedirs(args.output, exist_ok=True)
    written = []
    for file_name, record in items:
        vis, n = render(predictor, cfg, metadata, file_name, record, args.threshold, args.show_gt,
                        args.min_side, args.max_labels)
        out = os.path.join(args.output, os.path.splitext(os.path.basename(file_name))[0] + ".png")
        Image.fromarray(vis).save(out)
        written.append(out)
        print(f"{out}: {n} detections >= {args.threshold}")
    return written


if __name__ == "__main__":
    main()
