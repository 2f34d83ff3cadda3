#!/usr/bin/env python
"""Draw training samples after the config's augmentation (scale jitter, crop, flip) with their
boxes, to check the recipe; or the raw annotations with --source annotation.

  python tools/visualize_data.py --config-file configs/Demo/trees_R_26_slim_FPN.yaml --output vis_data/ -n 8
"""
import argparse
import os

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.utils.visualizer import Visualizer
from PIL import Image

import aadet  # noqa: F401
from aadet.data import register_trees
from aadet.engine.tool_config import build_train_mapper, inference_settings, load_any_config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--source", choices=["augmented", "annotation"], default="augmented")
    ap.add_argument("-n", "--num-images", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)

    register_trees()
    cfg = load_any_config(args.config_file, args.opts)
    settings = inference_settings(cfg)
    name = settings.train_datasets[0]
    metadata = MetadataCatalog.get(name)
    dicts = DatasetCatalog.get(name)[: args.num_images]
    mapper = build_train_mapper(cfg)
    import numpy as np
    import torch

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    os.makedirs(args.output, exist_ok=True)
    written = []
    for d in dicts:
        base = os.path.splitext(os.path.basename(d["file_name"]))[0]
        if args.source == "annotation":
            img = np.asarray(Image.open(d["file_name"]).convert("RGB"))
            vis = Visualizer(img, metadata).draw_dataset_dict(d)
        else:
            out = mapper(dict(d))
            img = out["image"].permute(1, 2, 0).numpy().astype("uint8")
            if settings.input_format == "BGR":
                img = img[:, :, ::-1]
            inst = out["instances"]
            labels = None
            if hasattr(metadata, "thing_classes"):
                labels = [metadata.thing_classes[c] for c in inst.gt_classes.tolist()]
            vis = Visualizer(img, metadata).overlay_instances(boxes=inst.gt_boxes, labels=labels)
        path = os.path.join(args.output, f"{base}_{args.source}.png")
        Image.fromarray(vis.get_image()).save(path)
        written.append(path)
        print(path)
    return written


if __name__ == "__main__":
    main()
