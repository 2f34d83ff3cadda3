"""COCO evaluation through Detectron2's COCOEvaluator, on a small COCO-layout folder that goes
through Detectron2's builtin ``coco_2017_val`` registration (``DETECTRON2_DATASETS``)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
from PIL import Image

from tests.helpers import REPO


def make_coco_layout(root, n_images=4):
    """``root/coco/annotations/instances_val2017.json`` + ``root/coco/val2017/*.jpg``."""
    img_dir = os.path.join(root, "coco", "val2017")
    os.makedirs(img_dir)
    os.makedirs(os.path.join(root, "coco", "annotations"))
    rng = np.random.RandomState(0)
    images, anns = [], []
    for i in range(n_images):
        fn = f"{i:012d}.jpg"
        Image.fromarray(rng.randint(0, 255, (120, 160, 3), dtype=np.uint8)).save(os.path.join(img_dir, fn))
        images.append({"id": i + 1, "file_name": fn, "height": 120, "width": 160})
        for j in range(2):
            x, y = 10 + 60 * j, 20 + 5 * i
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": 1 if j == 0 else 18,
                         "bbox": [x, y, 40, 50], "area": 2000.0, "iscrowd": 0})
    from detectron2.data.datasets.builtin_meta import COCO_CATEGORIES

    cats = [{"id": c["id"], "name": c["name"]} for c in COCO_CATEGORIES if c["isthing"]]
    with open(os.path.join(root, "coco", "annotations", "instances_val2017.json"), "w") as f:
        json.dump({"images": images, "annotations": anns, "categories": cats}, f)


SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from detectron2.data import DatasetCatalog, MetadataCatalog
    from detectron2.structures import Boxes, Instances
    from aadet.engine import Trainer, get_aadet_cfg
    cfg = get_aadet_cfg(); cfg.OUTPUT_DIR = sys.argv[1]
    dicts = DatasetCatalog.get("coco_2017_val")  # Detectron2's builtin registration
    ev = Trainer.build_evaluator(cfg, "coco_2017_val")
    for shift in map(float, sys.argv[2:]):
      ev.reset()
      for d in dicts:
        inst = Instances((d["height"], d["width"]))
        # dataset dicts carry contiguous category ids, as the model's predictions do
        boxes = [[a["bbox"][0] + shift, a["bbox"][1], a["bbox"][0] + a["bbox"][2] + shift,
                  a["bbox"][1] + a["bbox"][3]] for a in d["annotations"]]
        inst.pred_boxes = Boxes(torch.tensor(boxes, dtype=torch.float32))
        inst.scores = torch.full((len(boxes),), 0.9)
        inst.pred_classes = torch.tensor([a["category_id"] for a in d["annotations"]])
        ev.process([{"image_id": d["image_id"]}], [{"instances": inst}])
      print("RESULT", json.dumps(ev.evaluate()["bbox"]))
    """
)


def _evaluate(tmp_path, *shifts):
    env = dict(os.environ, DETECTRON2_DATASETS=str(tmp_path), PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "out"), *map(str, shifts)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    return [json.loads(ln[len("RESULT "):]) for ln in lines]


def test_coco_builtin_registration_and_evaluator(tmp_path):
    make_coco_layout(str(tmp_path))
    perfect, shifted, slight = _evaluate(tmp_path, 0.0, 15.0, 5.0)
    assert perfect["AP"] > 99.0 and perfect["AP50"] > 99.0 and perfect["AP75"] > 99.0
    # boxes shifted by 15 px of 40: IoU = 25*50 / (55*50) = 0.45 < 0.5, so no true positive
    assert shifted["AP50"] < 1.0
    # shifted by 5 px: IoU = 35/45 = 0.78 -> counts at 0.5..0.75, not at 0.8+
    assert slight["AP50"] > 99.0 and slight["AP75"] > 99.0 and 30.0 < slight["AP"] < 70.0
