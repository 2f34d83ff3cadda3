"""Box voting after NMS (``TEST.BBOX_VOTE``, :mod:`aadet.modeling.box_voting`)."""
import functools
import os

import pytest
import torch
from detectron2.layers import batched_nms
from detectron2.modeling import build_model
from detectron2.modeling.meta_arch.retinanet import RetinaNet
from detectron2.structures import Boxes, Instances

from aadet.config import ConfigValueError
from aadet.engine import get_aadet_cfg, load_config
from aadet.modeling import RetinaNetWithTTA
from aadet.modeling.box_voting import bbox_vote_thresh, box_voting, check_vote_thresh

from tests.helpers import REPO


def _instances(boxes, scores, classes, size=(100, 100)):
    return Instances(
        size,
        pred_boxes=Boxes(torch.tensor(boxes, dtype=torch.float32)),
        scores=torch.tensor(scores, dtype=torch.float32),
        pred_classes=torch.tensor(classes),
    )


def test_kept_box_becomes_the_score_weighted_mean_of_its_voters():
    cands = _instances(
        [
            [10, 10, 30, 30],  # kept, class 0
            [12, 10, 32, 30],  # IoU 18/22 = 0.818 with it, class 0: votes
            [10, 10, 30, 34],  # IoU 20/24 = 0.833, class 1: another class, does not vote
            [20, 20, 40, 40],  # IoU 100/700 = 0.14, class 0: too far, does not vote
            [50, 50, 60, 60],  # kept, class 0, alone
        ],
        [0.9, 0.3, 0.8, 0.7, 0.6],
        [0, 0, 1, 0, 0],
    )
    out = box_voting(cands[torch.tensor([0, 4])], cands, 0.8)
    expected = torch.tensor(
        [[(0.9 * 10 + 0.3 * 12) / 1.2, 10, (0.9 * 30 + 0.3 * 32) / 1.2, 30], [50, 50, 60, 60]],
    )
    torch.testing.assert_close(out.pred_boxes.tensor, expected, rtol=0, atol=1e-5)
    assert out.scores.tolist() == pytest.approx([0.9, 0.6]) and out.pred_classes.tolist() == [0, 0]
    # Above the second box's IoU (0.818) only the kept box votes: nothing moves.
    out = box_voting(cands[torch.tensor([0, 4])], cands, 0.82)
    torch.testing.assert_close(out.pred_boxes.tensor, cands.pred_boxes.tensor[[0, 4]], rtol=0, atol=1e-5)


def test_an_empty_box_keeps_its_own_and_nothing_kept_is_nothing():
    # A box clipped to zero width overlaps nothing, not even itself: no division by zero.
    cands = _instances([[0, 5, 0, 9], [0, 5, 2, 9]], [0.5, 0.4], [0, 0])
    out = box_voting(cands[torch.tensor([0])], cands, 0.5)
    assert torch.equal(out.pred_boxes.tensor, cands.pred_boxes.tensor[:1])
    assert len(box_voting(cands[torch.tensor([], dtype=torch.long)], cands, 0.5)) == 0


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5, True])
def test_bad_vote_threshold_names_the_key(value):
    """The config's threshold is checked when the model (or TTA) maps it, naming the key; the
    model's plain argument takes 0 (off) besides the range."""
    cfg = get_aadet_cfg()
    cfg.TEST.BBOX_VOTE.VOTE_TH = value
    with pytest.raises(ConfigValueError, match=r"TEST\.BBOX_VOTE\.VOTE_TH must be in \(0, 1\]"):
        bbox_vote_thresh(cfg)
    if value != 0 or value is True:
        with pytest.raises(ValueError, match=r"bbox_vote_thresh must be in \(0, 1\] \(or 0: off\)"):
            check_vote_thresh(value, "bbox_vote_thresh")
    check_vote_thresh(0.0, "bbox_vote_thresh")


def test_config_turns_it_on_and_off():
    cfg = get_aadet_cfg()
    assert bbox_vote_thresh(cfg) == 0.0  # off by default: not in the papers
    cfg.TEST.BBOX_VOTE.ENABLED = True
    assert bbox_vote_thresh(cfg) == cfg.TEST.BBOX_VOTE.VOTE_TH == 0.8  # Detectron's default


def _demo_model(vote):
    opts = ["MODEL.DEVICE", "cpu", "MODEL.RETINANET.SCORE_THRESH_TEST", "0.0",
            "TEST.BBOX_VOTE.ENABLED", str(vote > 0)]
    if vote:
        opts += ["TEST.BBOX_VOTE.VOTE_TH", str(vote)]
    cfg = load_config(os.path.join(REPO, "configs/Demo/trees_R_26_slim_FPN.yaml"), opts)
    torch.manual_seed(0)
    return cfg, build_model(cfg).eval()


def test_retinanet_votes_with_its_pre_nms_candidates():
    """The model's detections with voting = Detectron2's detections (same scores, classes, order)
    with each box replaced by the weighted mean of the pre-NMS candidates, recomputed here."""
    _, plain = _demo_model(0)
    cfg, voting = _demo_model(0.6)
    assert voting.bbox_vote_thresh == 0.6
    voting.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(0)
    inp = {"image": torch.randint(0, 256, (3, 192, 192), generator=g, dtype=torch.uint8)}
    captured = {}
    decode = plain._decode_multi_level_predictions

    def capture(*args):
        captured["candidates"] = decode(*args)
        return captured["candidates"]

    plain._decode_multi_level_predictions = capture
    with torch.no_grad():
        a = plain([inp])[0]["instances"]
        b = voting([inp])[0]["instances"]
    cands = captured["candidates"]
    assert len(a) == len(b) == cfg.TEST.DETECTIONS_PER_IMAGE < len(cands)
    assert torch.equal(a.scores, b.scores) and torch.equal(a.pred_classes, b.pred_classes)
    keep = batched_nms(cands.pred_boxes.tensor, cands.scores, cands.pred_classes, 0.5)[: len(a)]
    # (the output is clipped to the image by Detectron2's postprocess; the candidates are not)
    assert torch.equal(cands.pred_boxes.tensor[keep].clamp(0, 192), a.pred_boxes.tensor)
    boxes, scores = cands.pred_boxes.tensor.double(), cands.scores.double()
    for i, k in enumerate(keep.tolist()):
        x0, y0 = torch.maximum(boxes[k, :2], boxes[:, :2]).unbind(1)
        x1, y1 = torch.minimum(boxes[k, 2:], boxes[:, 2:]).unbind(1)
        inter = (x1 - x0).clamp(min=0) * (y1 - y0).clamp(min=0)
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        w = scores * (inter / (area[k] + area - inter) >= 0.6)
        expected = (w @ boxes / w.sum()).clamp(0, 192)
        torch.testing.assert_close(b.pred_boxes.tensor[i].double(), expected, rtol=0, atol=1e-3)
    assert (b.pred_boxes.tensor - a.pred_boxes.tensor).abs().max() > 1.0  # it did move boxes


def test_without_voting_inference_is_detectron2s():
    """Voting off, the shared NMS/top-k step (nms_and_vote) gives Detectron2's RetinaNet output."""
    _, model = _demo_model(0)
    g = torch.Generator().manual_seed(1)
    inp = {"image": torch.randint(0, 256, (3, 160, 224), generator=g, dtype=torch.uint8)}
    with torch.no_grad():
        ours = model([inp])[0]["instances"]
        model.inference_single_image = functools.partial(RetinaNet.inference_single_image, model)
        theirs = model([inp])[0]["instances"]
    assert len(ours) == 100
    for field in ("scores", "pred_classes"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field))
    assert torch.equal(ours.pred_boxes.tensor, theirs.pred_boxes.tensor)


def test_tta_merge_votes_over_the_passes():
    class TwoBoxes(torch.nn.Module):
        def forward(self, inputs):
            out = []
            for x in inputs:
                h, w = x["height"], x["width"]
                out.append({"instances": Instances(
                    (h, w), pred_boxes=Boxes(torch.tensor([[10.0, 10, 30, 30], [12, 10, 32, 30]])),
                    scores=torch.tensor([0.9, 0.3]), pred_classes=torch.tensor([0, 0]))})
            return out

    cfg = get_aadet_cfg()
    cfg.TEST.AUG.ENABLED, cfg.TEST.AUG.MIN_SIZES, cfg.TEST.AUG.MAX_SIZE = True, (100,), 1000
    cfg.TEST.AUG.FLIP = False
    inp = {"image": torch.zeros(3, 100, 100, dtype=torch.uint8), "height": 100, "width": 100}
    plain = RetinaNetWithTTA(cfg, TwoBoxes())([inp])[0]["instances"]
    assert plain.pred_boxes.tensor.tolist() == [[10.0, 10, 30, 30]]
    cfg.TEST.BBOX_VOTE.ENABLED = True
    voted = RetinaNetWithTTA(cfg, TwoBoxes())([inp])[0]["instances"]
    torch.testing.assert_close(voted.pred_boxes.tensor, torch.tensor([[10.5, 10, 30.5, 30]]))
    assert voted.scores.tolist() == pytest.approx([0.9])
