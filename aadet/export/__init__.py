"""Deployment: trace a detector to TorchScript or ONNX, run and check the exported file.

The route is Detectron2's ``tools/deploy/export_model.py --export-method tracing``: the model is
wrapped in :class:`detectron2.export.TracingAdapter` and traced on one sample image, so the
exported graph holds everything ``model([{"image": x}])`` does (normalization, padding, backbone,
head, box decoding, NMS, the top-``DETECTIONS_PER_IMAGE`` cut). What stays outside, as in
Detectron2: the test-time resize (done by :class:`ExportedDetector` like the Predictor) and the
final rescale of the boxes to the original image. Attention layers switch to their plain-ops
routes by themselves while tracing (``impl="auto"``, see :mod:`aadet.layers.functional`).
"""
from .runtime import DetectionMatch, ExportedDetector, match_detections  # noqa: F401
from .tracing import (  # noqa: F401
    DEFAULT_ONNX_OPSET,
    EXPORT_FORMATS,
    ONNX_OPSETS,
    OUTPUT_NAMES,
    check_exportable,
    export_model,
    sample_input,
)
