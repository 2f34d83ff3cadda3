"""Tracing a RetinaNet to TorchScript or ONNX through Detectron2's ``TracingAdapter``.

The exported graph takes one image and returns the detections, exactly what
``model([{"image": image}])[0]["instances"]`` gives in eager mode::

    image        float32 [3, H, W]   pixel values 0-255 in cfg.INPUT.FORMAT channel order, already
                                     resized for the model (ResizeShortestEdge to
                                     INPUT.MIN_SIZE_TEST / MAX_SIZE_TEST, as the Predictor does)
    pred_boxes   float32 [N, 4]      x0, y0, x1, y1 in the pixels of ``image``
    pred_classes int64   [N]         contiguous class index (0 .. NUM_CLASSES - 1)
    scores       float32 [N]         sorted high to low, N <= TEST.DETECTIONS_PER_IMAGE
    image_size   int64   [2]         H, W

(the order of Detectron2's flattened ``Instances``: its fields sorted by name, then the size).
Normalization, padding to the backbone's size divisibility, anchors, box decoding, the score
threshold, NMS, the top-k cut and box voting (``TEST.BBOX_VOTE``) are inside the graph, as in
Detectron2's tracing export.

Traces are specialized to the sample's ``H x W``: the attention layers' relative-position tables
and block layouts, and the anchors, are computed from the map sizes at trace time. ONNX files
have a fixed input shape (onnxruntime rejects another size); :class:`ExportedDetector` checks the
size for TorchScript files too. Export once per input size.

Attention layers trace with plain tensor ops: ``impl="auto"`` picks an exporting route while
tracing or exporting (no custom ``autograd.Function``, no SDPA, halo windows gathered with
``index_select``; :func:`aadet.layers.functional.is_exporting`); ``MODEL.AA.IMPL``,
``MODEL.SASA.IMPL`` and ``MODEL.HALO.IMPL`` must be ``"auto"`` or a route flagged ``exports`` in its registry,
``MODEL.SASA.STEM_IMPL`` one of ``STEM_EXPORTABLE_IMPLS`` (not the C++ kernel) (:func:`check_exportable`).
The export is PyTorch's TorchScript-based ONNX exporter (``dynamo=False``), the one Detectron2's tracing route uses.
"""
import contextlib
import json
import logging
import os
import warnings
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from detectron2.data import transforms as T
from detectron2.export import TracingAdapter
from detectron2.modeling.meta_arch.retinanet import RetinaNet

from ..config import config_error
from ..layers.attention_stem import STEM_EXPORTABLE_IMPLS
from ..layers.functional.checks import check_one_of
from ..layers.functional.criss_cross import CRISS_CROSS_BACKENDS
from ..layers.functional.halo_attention import HALO_ATTENTION_BACKENDS
from ..layers.functional.local_attention import LOCAL_ATTENTION_BACKENDS
from ..layers.functional.logit_tables import LOGIT_TABLE_BACKENDS
from ..engine.tool_config import inference_settings

__all__ = [
    "DEFAULT_ONNX_OPSET",
    "EXPORT_FORMATS",
    "ONNX_OPSETS",
    "OUTPUT_NAMES",
    "check_exportable",
    "export_model",
    "sample_input",
    "predictor_resize",
]

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("torchscript", "onnx")
FILE_NAMES = {"torchscript": "model.ts", "onnx": "model.onnx"}
# ONNX opsets the export is tested with (tests/export/test_export.py: both ends on the AA model, the
# default on every demo architecture). The graph needs NonMaxSuppression (11) and Einsum (12);
# 20 is the newest opset PyTorch's TorchScript-based exporter writes.
ONNX_OPSETS = tuple(range(13, 21))
DEFAULT_ONNX_OPSET = 17
OUTPUT_NAMES = ("pred_boxes", "pred_classes", "scores", "image_size")
#: The registry of each kind of attention route (``InferenceSettings.attention_routes``: the
#: config keys naming them, ``MODEL.AA.IMPL`` / ``MODEL.SASA.IMPL`` / ``MODEL.HALO.IMPL`` /
#: ``MODEL.CCNET.IMPL`` in a YACS config).
ROUTE_REGISTRIES = {
    "aa": LOGIT_TABLE_BACKENDS,
    "sasa": LOCAL_ATTENTION_BACKENDS,
    "halo": HALO_ATTENTION_BACKENDS,
    "ccnet": CRISS_CROSS_BACKENDS,
}


def check_exportable(cfg, fmt: str, opset: int = DEFAULT_ONNX_OPSET) -> None:
    """Raise a ``ValueError`` naming the argument or config key that cannot be exported
    (``cfg``: a YACS config or a LazyConfig, :func:`~aadet.engine.tool_config.inference_settings`)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format must be one of {EXPORT_FORMATS}; got {fmt!r}")
    if fmt == "onnx" and opset not in ONNX_OPSETS:
        raise ValueError(
            f"ONNX opset must be in [{ONNX_OPSETS[0]}, {ONNX_OPSETS[-1]}] (the tested range); "
            f"got {opset}"
        )
    for key, (kind, route) in inference_settings(cfg).attention_routes.items():
        exportable = STEM_EXPORTABLE_IMPLS if kind == "stem" else ROUTE_REGISTRIES[kind].exportable()
        check_one_of(
            route, exportable, key, config_error,
            " to export: the routes that trace into plain tensor ops (\"auto\" takes one of them "
            "while tracing)",
        )


def predictor_resize(cfg) -> T.ResizeShortestEdge:
    """The Predictor's test-time resize (outside the exported graph)."""
    s = inference_settings(cfg)
    return T.ResizeShortestEdge([s.min_size_test, s.min_size_test], s.max_size_test)


def sample_input(cfg, image: Optional[np.ndarray] = None, size: Optional[Sequence[int]] = None):
    """The ``[3, H, W]`` float32 model input to trace with.

    Args:
        image: ``[H, W, 3]`` uint8 in the config's input format; resized like the Predictor.
        size: ``(H, W)`` of the model input instead (a fixed pseudo-random image, not resized).
    """
    if (image is None) == (size is None):
        raise ValueError("give exactly one of image= (a sample image) and size= (H, W)")
    if image is None:
        if len(size) != 2 or any(int(s) < 1 for s in size):
            raise ValueError(f"size must be (H, W) with H, W >= 1; got {tuple(size)}")
        rng = np.random.default_rng(0)
        image = rng.integers(0, 256, size=(int(size[0]), int(size[1]), 3), dtype=np.uint8)
    else:
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"image must be [H, W, 3] uint8; got {image.shape} {image.dtype}")
        image = predictor_resize(cfg).get_transform(image).apply_image(image)
    return torch.as_tensor(np.ascontiguousarray(image.transpose(2, 0, 1)).astype("float32"))


# ----------------------------------------------------------------------------- export
def _adapter(model, image: torch.Tensor) -> TracingAdapter:
    """A ``TracingAdapter`` that has run once (so its output schema is known and checked)."""
    if not isinstance(model, RetinaNet):
        raise TypeError(
            f"export supports RetinaNet models (MODEL.META_ARCHITECTURE AADetRetinaNet or "
            f"RetinaNet); got {type(model).__name__}"
        )
    if model.training:
        raise ValueError("call model.eval() before exporting")
    if image.dim() != 3 or image.shape[0] != 3 or image.dtype != torch.float32:
        raise ValueError(f"image must be float32 [3, H, W]; got {image.dtype} {tuple(image.shape)}")
    # eval(): the ONNX exporter restores the wrapper's train/eval state recursively afterwards
    adapter = TracingAdapter(model, [{"image": image}]).eval()
    adapter(image)
    fields = adapter.outputs_schema.schemas[0].schemas[0].keys
    if tuple(fields) + ("image_size",) != OUTPUT_NAMES:
        raise RuntimeError(f"unexpected model outputs {fields}; expected {OUTPUT_NAMES[:-1]}")
    return adapter


@contextlib.contextmanager
def _quiet_tracer():
    """Detectron2's asserts on shapes trace as constants (expected): silence those warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", message=".*torch.jit.*deprecated.*")
        yield


def export_model(
    cfg,
    model,
    image: torch.Tensor,
    output_dir: str,
    fmt: str,
    *,
    opset: int = DEFAULT_ONNX_OPSET,
) -> str:
    """Trace ``model`` on ``image`` and write ``model.ts`` / ``model.onnx`` to ``output_dir``.

    A ``<file>.json`` beside it records what a deployment needs: the input size and format, the
    test-time resize, the output names, the opset and the library versions.

    Args:
        cfg: the model's config (checked with :func:`check_exportable`).
        model: the RetinaNet, in eval mode, with its weights loaded.
        image: ``[3, H, W]`` float32 from :func:`sample_input`; the export is for this ``H x W``.
        fmt: ``"torchscript"`` or ``"onnx"``.
        opset: ONNX opset (``ONNX_OPSETS``).

    Returns:
        The path of the written model file.
    """
    check_exportable(cfg, fmt, opset)
    image = image.to(model.device)
    adapter = _adapter(model, image)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, FILE_NAMES[fmt])
    tmp = path + ".tmp"
    with _quiet_tracer(), torch.no_grad():
        if fmt == "torchscript":
            torch.jit.save(torch.jit.trace(adapter, (image,), check_trace=False), tmp)
        else:
            torch.onnx.export(
                adapter,
                (image,),
                tmp,
                dynamo=False,  # Detectron2's route: trace, then the TorchScript exporter
                opset_version=opset,
                input_names=["image"],
                output_names=list(OUTPUT_NAMES),
            )
    os.replace(tmp, path)
    _write_metadata(cfg, path, fmt, tuple(image.shape[1:]), opset)
    logger.info("wrote %s (%s, input [3, %d, %d])", path, fmt, *image.shape[1:])
    return path


def _write_metadata(cfg, path: str, fmt: str, hw: Tuple[int, int], opset: int) -> None:
    s = inference_settings(cfg)
    meta = {
        "format": fmt,
        "file": os.path.basename(path),
        "input": {
            "name": "image",
            "shape": [3, int(hw[0]), int(hw[1])],
            "dtype": "float32",
            "channels": s.input_format,
            "range": "0-255",
        },
        "test_resize": {"min_size": s.min_size_test, "max_size": s.max_size_test},
        "outputs": list(OUTPUT_NAMES),
        "num_classes": s.num_classes,
        "score_thresh_test": s.score_thresh_test,
        "nms_thresh_test": s.nms_thresh_test,
        "detections_per_image": s.detections_per_image,
        "bbox_vote_thresh": s.bbox_vote_thresh,  # 0 = off
        "opset": opset if fmt == "onnx" else None,
        "torch": torch.__version__,
    }
    with open(path + ".json", "w") as f:
        json.dump(meta, f, indent=2)
