"""RetinaNet whose head comes from a registry (``MODEL.RETINANET.HEAD_NAME``), and that registry.

Detectron2's ``RetinaNet.from_config`` hard-codes ``RetinaNetHead``; SASA's all-attention model
needs an attentional head, so :class:`AADetRetinaNet` builds the head named by the config from
:data:`RETINANET_HEAD_REGISTRY` (:func:`build_retinanet_head`). One more difference: the EMA of
the number of positive anchors that normalizes the losses lives in a checkpointed buffer
(Detectron2 keeps it in a plain attribute that restarts at 100 after ``--resume``, so a resumed
run's losses differ from the uninterrupted run's). And optional box voting after NMS
(``TEST.BBOX_VOTE``, :mod:`aadet.modeling.box_voting`).
Under ``torch.compile`` (``MODEL.COMPILE``) the training losses (``forward_training``) and the
per-image post-processing (``inference_single_image``) run eagerly.
"""
import torch
from detectron2.config import configurable
from detectron2.modeling import META_ARCH_REGISTRY
from detectron2.modeling.meta_arch.retinanet import RetinaNet, RetinaNetHead
from detectron2.utils.events import get_event_storage
from detectron2.utils.registry import Registry

from ...config import config_error
from ...layers.functional.checks import check_one_of
from ...utils.d2compat import EMAUpdateHook, decode_multi_level_predictions
from ..box_voting import bbox_vote_thresh, check_vote_thresh, nms_and_vote

__all__ = ["RETINANET_HEAD_REGISTRY", "AADetRetinaNet", "build_retinanet_head"]

RETINANET_HEAD_REGISTRY = Registry("RETINANET_HEAD")  # MODEL.RETINANET.HEAD_NAME
RETINANET_HEAD_REGISTRY.__doc__ = """
RetinaNet heads, called as ``cls(cfg, feature_shapes)`` (``@configurable`` classes), returning
per-level ``(logits, bbox_reg)`` lists like Detectron2's ``RetinaNetHead`` (registered here, and
in aadet/modeling/attention_head.py). :func:`build_retinanet_head` accepts exactly the registered
names.
"""
RETINANET_HEAD_REGISTRY.register(RetinaNetHead)


def build_retinanet_head(cfg, feature_shapes):
    """The head named by ``MODEL.RETINANET.HEAD_NAME``, for the given input feature shapes.

    Raises:
        ConfigValueError: for a name not registered (the message lists the registered ones).
    """
    name = cfg.MODEL.RETINANET.HEAD_NAME
    check_one_of(
        name, sorted(n for n, _ in RETINANET_HEAD_REGISTRY), "MODEL.RETINANET.HEAD_NAME",
        config_error, " (names in RETINANET_HEAD_REGISTRY)",
    )
    return RETINANET_HEAD_REGISTRY.get(name)(cfg, feature_shapes)


@META_ARCH_REGISTRY.register()
class AADetRetinaNet(EMAUpdateHook, RetinaNet):
    """Detectron2's RetinaNet with the head chosen by ``MODEL.RETINANET.HEAD_NAME``, a
    checkpointed loss normalizer and optional box voting at inference."""

    @configurable
    def __init__(self, *, bbox_vote_thresh: float = 0.0, **kwargs):
        """
        Args:
            bbox_vote_thresh: 0 (off) or the IoU (``VOTE_THRESH_RANGE``) of box voting after NMS
                (:func:`~aadet.modeling.box_voting.box_voting`).
            kwargs: Detectron2's ``RetinaNet`` arguments.
        """
        super().__init__(**kwargs)
        check_vote_thresh(bbox_vote_thresh, "bbox_vote_thresh")
        self.bbox_vote_thresh = float(bbox_vote_thresh)
        # EMA of the positive-anchor count; < 0 = not started (Detectron2 then starts at 100).
        self.register_buffer("loss_normalizer_ema", torch.tensor(-1.0, dtype=torch.float64))

    def ema_update(self, name, value, initial_value, momentum=0.9):
        if name != "loss_normalizer":
            return super().ema_update(name, value, initial_value, momentum)
        old = float(self.loss_normalizer_ema)
        new = (initial_value if old < 0 else old) * momentum + value * (1 - momentum)
        self.loss_normalizer_ema.fill_(new)
        return new

    # Under torch.compile (MODEL.COMPILE, aadet.engine.compile) the backbone and head compile and
    # this runs eagerly: its anchor matching is data-dependent, and Detectron2's event-storage
    # writes (guarded on the iteration) and the normalizer's EMA (guarded on its value) would
    # recompile its graphs every iteration, until Dynamo's recompile limit sends them to eager.
    @torch.compiler.disable
    def forward_training(self, images, features, predictions, gt_instances):
        # Diverged weights give NaN boxes, on which the GIoU/DIoU losses fail with an assertion
        # ("bad box") before Detectron2's NaN-loss check: stop here with the iteration instead.
        for kind, per_level in zip(("classification logits", "box deltas"), predictions):
            for level, t in zip(self.head_in_features, per_level):
                if not torch.isfinite(t).all():
                    raise FloatingPointError(
                        f"Loss became infinite or NaN at iteration={get_event_storage().iter}: the "
                        f"head's {kind} on {level} are not finite, so loss_cls/loss_box_reg are "
                        "NaN. Lower SOLVER.BASE_LR or lengthen SOLVER.WARMUP_ITERS."
                    )
        return super().forward_training(images, features, predictions, gt_instances)

    # Under torch.compile the post-processing runs eagerly too: it is data-dependent (thresholds,
    # top-k, NMS), and where no candidate passes the score threshold (an untrained model, an
    # image without objects) its tensors are empty, which Inductor's lowering of the top-k
    # indexing fails on (IndexError, torch 2.14).
    @torch.compiler.disable
    def inference_single_image(self, anchors, box_cls, box_delta, image_size):
        """Detectron2's (score threshold, top-k per level, class-wise NMS, top
        ``max_detections_per_image``), then box voting with the pre-NMS candidates when on."""
        pred = decode_multi_level_predictions(
            self, anchors, box_cls, box_delta, self.test_score_thresh, self.test_topk_candidates, image_size
        )
        return nms_and_vote(pred, self.test_nms_thresh, self.max_detections_per_image, self.bbox_vote_thresh)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints of Detectron2's RetinaNet have no normalizer: keep ours (not started).
        state_dict.setdefault(prefix + "loss_normalizer_ema", self.loss_normalizer_ema.clone())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @classmethod
    def from_config(cls, cfg):
        # Detectron2's from_config builds the backbone and its RetinaNetHead; another head is
        # built after it and replaces it. (Building only the named head would draw other random
        # numbers for every parameter initialised after the backbone: the attention-head models'
        # trained results would change.)
        ret = super().from_config(cfg)
        ret["bbox_vote_thresh"] = bbox_vote_thresh(cfg)
        if cfg.MODEL.RETINANET.HEAD_NAME != "RetinaNetHead":
            shapes = ret["backbone"].output_shape()
            ret["head"] = build_retinanet_head(
                cfg, [shapes[f] for f in cfg.MODEL.RETINANET.IN_FEATURES]
            )
        return ret
