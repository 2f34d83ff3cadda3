"""Single-image inference with strict weight loading (used by the visualization tools)."""
import torch
from detectron2.data import transforms as T

from .checkpoint import AADetCheckpointer
from .tool_config import build_inference_model, inference_settings

__all__ = ["Predictor"]


class Predictor:
    """Like Detectron2's ``DefaultPredictor``, but a checkpoint that does not match the config is
    an error (``CheckpointMismatchError``) instead of a warning with random weights; with
    ``MODEL_EMA.ENABLED`` it loads the checkpoint's moving-average weights. ``cfg``: a YACS config
    or a LazyConfig (:func:`~aadet.engine.tool_config.inference_settings`).

    Call with a ``[H, W, 3]`` uint8 image in the config's input format; returns the model's output
    dict (``"instances"`` in original-image coordinates).
    """

    def __init__(self, cfg, weights: str = None):
        self.cfg = cfg
        s = self.settings = inference_settings(cfg)
        self.model = build_inference_model(cfg).eval()
        weights = weights if weights is not None else s.weights
        if not weights:
            raise ValueError("no weights given: pass --weights or set MODEL.WEIGHTS (train.init_checkpoint)")
        AADetCheckpointer(self.model, strict=True, ema_weights=s.ema_weights).load(weights)
        self.aug = T.ResizeShortestEdge([s.min_size_test, s.min_size_test], s.max_size_test)
        self.input_format = s.input_format

    @torch.no_grad()
    def __call__(self, image):
        height, width = image.shape[:2]
        resized = self.aug.get_transform(image).apply_image(image)
        tensor = torch.as_tensor(resized.astype("float32").transpose(2, 0, 1))
        return self.model([{"image": tensor.to(self.settings.device), "height": height, "width": width}])[0]
