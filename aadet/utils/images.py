"""Reading the images a tool is given: the file types it takes, Detectron2's reader with an error
that names the file, and the conversion of a model's input format to RGB for drawing.

Used by ``tools/demo.py``, ``tools/visualize_detections.py`` and ``tools/visualize_attention.py``.
"""
import os

import numpy as np
from detectron2.data import detection_utils

__all__ = ["IMAGE_EXTS", "read_image", "to_rgb"]

#: File name endings (lower case) of the images a folder or glob input is searched for.
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")


def read_image(path: str, fmt: str) -> np.ndarray:
    """The image at ``path`` as ``[H, W, C]`` uint8 in the model's ``INPUT.FORMAT`` ``fmt``
    (Detectron2's ``read_image``: grayscale and RGBA are converted, EXIF rotation applied).

    Raises:
        FileNotFoundError: no file at ``path``.
        RuntimeError: the file is not an image Detectron2 can read (the message names it).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image not found: {path}")
    try:
        return detection_utils.read_image(path, format=fmt)
    except Exception as e:
        raise RuntimeError(f"cannot read image {path}: {e}") from e


def to_rgb(image: np.ndarray, fmt: str) -> np.ndarray:
    """``image [H, W, 3]`` in format ``fmt`` ("BGR" or "RGB") as RGB (a view, not a copy)."""
    return image[:, :, ::-1] if fmt == "BGR" else image
