#!/usr/bin/env python
"""Run a detector on images (files, folders, globs) or a video, in Detectron2's demo/demo.py style.

  python tools/demo.py --config-file configs/Demo/trees_R_26_slim_FPN.yaml \
      --input datasets/trees/val/ "more/*.jpg" --output vis/ --json detections.json \
      --opts MODEL.WEIGHTS output/demo/model_final.pth
  python tools/demo.py --config-file CFG --video-input clip.mp4 --output clip_detections.mp4 \
      --opts MODEL.WEIGHTS W

--output: a folder (one picture per input, same file name), an image file (one input), or for a
video a .mp4 (mp4v) / .avi (MJPG) file or a folder (<stem>.mp4). --json writes the detections in
COCO results format: image_id (the DATASETS.TEST[0] image id when every input is one of its
images, else the input's index; the frame index for a video), file_name, bbox [x, y, w, h],
score, category_id (the dataset's category id when DATASETS.TEST[0] has COCO metadata, else the
class index). --confidence-threshold sets MODEL.RETINANET.SCORE_THRESH_TEST (after --opts), as
Detectron2's demo does.
"""
import argparse
import glob
import json
import logging
import os

import cv2
import numpy as np
from detectron2.data import MetadataCatalog
from detectron2.data.datasets import load_coco_json
from detectron2.structures import BoxMode
from PIL import Image
from tqdm import tqdm

import aadet  # noqa: F401
from aadet.engine import Predictor
from aadet.engine.tool_config import inference_settings, is_lazy_config, load_any_config
from aadet.utils.images import IMAGE_EXTS, read_image, to_rgb
from aadet.utils.visualizer import draw_instances

logger = logging.getLogger("aadet.demo")

# Video containers this tool writes, with the codec OpenCV writes and reads back for each.
VIDEO_CODECS = {".mp4": "mp4v", ".avi": "MJPG"}
DEFAULT_VIDEO_FPS = 30.0  # when the input video does not report its frame rate


def draw(rgb: np.ndarray, instances, metadata, threshold: float, factor=None) -> np.ndarray:
    """The annotated picture (the one place this tool draws): ``aadet.utils.visualizer``'s readable
    drawing (small images enlarged, score colours and a legend strip, no per-box text in crowded
    scenes). ``[f*H + LEGEND_HEIGHT, f*W, 3]`` uint8 RGB; ``factor=1`` keeps the input's scale."""
    return draw_instances(
        rgb, instances.pred_boxes, instances.scores, instances.pred_classes,
        metadata.get("thing_classes", None), threshold=threshold, factor=factor,
    )


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-file", required=True, metavar="FILE", help="a YAML config or a LazyConfig .py")
    ap.add_argument("--weights", default=None, help="checkpoint (default: MODEL.WEIGHTS)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="image files, folders and/or glob patterns")
    src.add_argument("--video-input", help="a video file (read with OpenCV)")
    ap.add_argument("--output", help="output folder or file (see above); omitted: nothing drawn")
    ap.add_argument("--json", help="write detections in COCO results format to this file")
    ap.add_argument("--confidence-threshold", type=float, default=0.5,
                    help="minimum score kept, in [0, 1] (default 0.5)")
    ap.add_argument("--opts", nargs=argparse.REMAINDER, default=[],
                    help="config overrides KEY VALUE ... (a LazyConfig .py: key=value ...; last on the line)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.confidence_threshold <= 1.0:
        ap.error(f"--confidence-threshold must be in [0, 1]; got {args.confidence_threshold}")
    return args


def setup_cfg(args):
    """The config (YAML, or a LazyConfig ``.py``), its score threshold the confidence threshold."""
    thresh = (
        [f"model.test_score_thresh={args.confidence_threshold}"] if is_lazy_config(args.config_file)
        else ["MODEL.RETINANET.SCORE_THRESH_TEST", args.confidence_threshold]
    )
    return load_any_config(args.config_file, list(args.opts) + thresh)


# ----------------------------------------------------------------------------- inputs / outputs
def list_images(patterns):
    """Image files from files, folders (their images, sorted) and glob patterns, in order."""
    files = []
    for p in patterns:
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p) if f.lower().endswith(IMAGE_EXTS))
        elif os.path.isfile(p):
            found = [p]
        else:
            found = sorted(f for f in glob.glob(p) if f.lower().endswith(IMAGE_EXTS))
        if not found:
            raise FileNotFoundError(
                f"--input {p}: no such file, or no images ({', '.join(IMAGE_EXTS)}) in that "
                "folder / matching that pattern"
            )
        files += found
    unique, seen = [], set()
    for f in files:  # an image named twice (a file and its folder) is run once
        if os.path.abspath(f) not in seen:
            seen.add(os.path.abspath(f))
            unique.append(f)
    return unique


def image_outputs(output, files):
    """Output path of each input image: ``output`` itself (one input) or ``output/<basename>``."""
    if output is None:
        return [None] * len(files)
    if output.lower().endswith(IMAGE_EXTS) and not os.path.isdir(output):
        if len(files) != 1:
            raise ValueError(
                f"--output {output} is an image file but there are {len(files)} inputs: give a folder"
            )
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        return [output]
    os.makedirs(output, exist_ok=True)
    names = [os.path.basename(f) for f in files]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--output {output}: several inputs are named {dup[0]}; write them to separate folders")
    return [os.path.join(output, n) for n in names]


def video_output(output, video):
    """The annotated video's path and OpenCV codec (``VIDEO_CODECS``)."""
    ext = os.path.splitext(output)[1].lower()
    if os.path.isdir(output) or not ext:
        os.makedirs(output, exist_ok=True)
        output, ext = os.path.join(output, os.path.splitext(os.path.basename(video))[0] + ".mp4"), ".mp4"
    if ext not in VIDEO_CODECS:
        raise ValueError(f"--output {output}: a video is written as one of {sorted(VIDEO_CODECS)}")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    return output, VIDEO_CODECS[ext]


class CocoIds:
    """Dataset ids from ``DATASETS.TEST[0]``'s COCO json, when it has one.

    ``category_id(c)`` maps a contiguous class index back to the json's category id (Detectron2's
    ``thing_dataset_id_to_contiguous_id``, set by ``load_coco_json``); ``image_ids`` maps absolute
    file names to the json's image ids. Without metadata: class indices, no image ids.
    """

    def __init__(self, cfg):
        test = inference_settings(cfg).test_datasets
        self.name = test[0] if test else None
        self.metadata = MetadataCatalog.get(self.name or "__aadet_demo_unused")
        self.image_ids, self._to_dataset = {}, None
        json_file = self.metadata.get("json_file") if self.name else None
        if json_file and os.path.isfile(json_file):
            dicts = load_coco_json(json_file, self.metadata.get("image_root", ""), self.name)
            self.image_ids = {os.path.abspath(d["file_name"]): d["image_id"] for d in dicts}
        mapping = self.metadata.get("thing_dataset_id_to_contiguous_id", None) if self.name else None
        if mapping:
            self._to_dataset = {v: k for k, v in mapping.items()}
        else:
            logger.warning(
                "category_id is the class index: DATASETS.TEST%s has no COCO category ids",
                f"[0]={self.name} ({json_file or 'no json_file'})" if self.name else " is empty",
            )

    def category_id(self, class_index: int) -> int:
        return self._to_dataset[class_index] if self._to_dataset is not None else class_index


def coco_results(instances, image_id, file_name, ids: CocoIds, **extra):
    """COCO results-format dicts (bbox ``[x, y, w, h]`` in original-image pixels)."""
    boxes = BoxMode.convert(instances.pred_boxes.tensor.numpy(), BoxMode.XYXY_ABS, BoxMode.XYWH_ABS)
    return [
        {"image_id": image_id, "file_name": file_name, **extra,
         "category_id": ids.category_id(int(c)), "bbox": [float(v) for v in b], "score": float(s)}
        for b, s, c in zip(boxes, instances.scores.tolist(), instances.pred_classes.tolist())
    ]


def detect(predictor, image, threshold):
    """Detections with score >= ``threshold``, on the CPU."""
    instances = predictor(image)["instances"].to("cpu")
    return instances[instances.scores >= threshold]


# ----------------------------------------------------------------------------- runs
def run_images(args, cfg, predictor, ids):
    files = list_images(args.input)
    outputs = image_outputs(args.output, files)
    absfiles = [os.path.abspath(f) for f in files]
    in_dataset = all(f in ids.image_ids for f in absfiles)
    results, written = [], []
    for i, (f, out) in enumerate(tqdm(list(zip(files, outputs)), desc="images", disable=len(files) < 2)):
        image = read_image(f, predictor.input_format)
        instances = detect(predictor, image, args.confidence_threshold)
        image_id = ids.image_ids[absfiles[i]] if in_dataset else i
        results += coco_results(instances, image_id, f, ids)
        if out is not None:
            Image.fromarray(
                draw(to_rgb(image, predictor.input_format), instances, ids.metadata, args.confidence_threshold)
            ).save(out)
            written.append(out)
        logger.info("%s: %d detections", f, len(instances))
    return results, written


def run_video(args, cfg, predictor, ids):
    path = args.video_input
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--video-input: no such file: {path}")
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        raise RuntimeError(f"--video-input {path}: OpenCV cannot open it")
    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) or None
    fps = cap.get(cv2.CAP_PROP_FPS)
    if not fps or fps <= 0 or not np.isfinite(fps):
        logger.warning("%s reports no frame rate: writing %.0f fps", path, DEFAULT_VIDEO_FPS)
        fps = DEFAULT_VIDEO_FPS
    out_path, codec = video_output(args.output, path) if args.output else (None, None)
    writer, results, frame_index = None, [], 0
    with tqdm(total=total, desc="frames", disable=total is not None and total < 2) as bar:
        while True:
            ok, frame = cap.read()  # BGR
            if not ok:
                break
            image = frame if predictor.input_format == "BGR" else frame[:, :, ::-1]
            instances = detect(predictor, image, args.confidence_threshold)
            results += coco_results(instances, frame_index, path, ids, frame=frame_index)
            if out_path is not None:
                # video keeps its scale (factor 1); the legend strip is added below each frame
                vis = draw(frame[:, :, ::-1], instances, ids.metadata, args.confidence_threshold,
                           factor=1)[:, :, ::-1]  # RGB -> BGR
                if writer is None:
                    h, w = vis.shape[:2]
                    writer = cv2.VideoWriter(out_path, cv2.VideoWriter_fourcc(*codec), fps, (w, h))
                    if not writer.isOpened():
                        raise RuntimeError(f"--output {out_path}: OpenCV cannot write {codec} video")
                writer.write(np.ascontiguousarray(vis))
            frame_index += 1
            bar.update(1)
    cap.release()
    if writer is not None:
        writer.release()
    if frame_index == 0:
        raise RuntimeError(f"--video-input {path}: no frame could be read")
    logger.info("%s: %d frames, %d detections", path, frame_index, len(results))
    return results, [out_path] if out_path else []


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = setup_cfg(args)
    predictor = Predictor(cfg, args.weights)
    ids = CocoIds(cfg)
    run = run_video if args.video_input else run_images
    results, written = run(args, cfg, predictor, ids)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f)
        print(f"{args.json}: {len(results)} detections")
    for out in written:
        print(out)
    return {"detections": results, "written": written}


if __name__ == "__main__":
    main()
