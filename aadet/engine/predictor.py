"""Single-image inference with strict weight loading (used by the visualization tools)."""
import torch
from detectron2.data import transforms as T
from detectron2.modeling import build_model

from .checkpoint import AADetCheckpointer

__all__ = ["Predictor"]


class Predictor:
    """Like Detectron2's ``DefaultPredictor``, but a checkpoint that does not match the config is
    an error (``CheckpointMismatchError``) instead of a warning with random weights; with
    ``MODEL_EMA.ENABLED`` it loads the checkpoint's moving-average weights.

    Call with a ``[H, W, 3]`` uint8 image in ``cfg.INPUT.FORMAT``; returns the model's output dict
    (``"instances"`` in original-image coordinates).
    """

    def __init__(self, cfg, weights: str = None):
        self.cfg = cfg
        self.model = build_model(cfg).eval()
        weights = weights if weights is not None else cfg.MODEL.WEIGHTS
        if not weights:
            raise ValueError("no weights given: pass --weights or set MODEL.WEIGHTS")
        AADetCheckpointer(self.model, strict=True, ema_weights=cfg.MODEL_EMA.ENABLED).load(weights)
        self.aug = T.ResizeShortestEdge(
            [cfg.INPUT.MIN_SIZE_TEST, cfg.INPUT.MIN_SIZE_TEST], cfg.INPUT.MAX_SIZE_TEST
        )
        self.input_format = cfg.INPUT.FORMAT

    @torch.no_grad()
    def __call__(self, image):
        height, width = image.shape[:2]
        resized = self.aug.get_transform(image).apply_image(image)
        tensor = torch.as_tensor(resized.astype("float32").transpose(2, 0, 1))
        return self.model([{"image": tensor.to(self.cfg.MODEL.DEVICE), "height": height, "width": width}])[0]
