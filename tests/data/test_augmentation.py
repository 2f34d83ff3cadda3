"""The papers' train-time recipe: resize (longer side in [512, 768]), 640 crop/pad, flip 0.5."""
import numpy as np
import pytest
from detectron2.data import transforms as T

from aadet.data.augmentation import build_augmentation, build_scale_jitter_augmentation
from aadet.engine import get_aadet_cfg


def _apply(augs, image, boxes):
    aug_input = T.AugInput(image, boxes=boxes)
    tfms = T.AugmentationList(augs)(aug_input)
    return aug_input.image, aug_input.boxes, tfms


@pytest.mark.parametrize("hw", [(480, 640), (1000, 300), (640, 640), (200, 260)])
def test_resize_long_side_in_range_and_output_is_crop_size(hw):
    rng = np.random.RandomState(0)
    np.random.seed(0)  # Detectron2's augmentations draw from NumPy's global RNG
    augs = build_scale_jitter_augmentation((512, 768), 640, 0.5)
    longs = []
    for _ in range(40):
        img = rng.randint(0, 255, size=(*hw, 3), dtype=np.uint8)
        out, _, tfms = _apply(augs, img, np.zeros((0, 4), np.float32))
        resize = next(t for t in tfms.transforms if isinstance(t, T.ResizeTransform))
        long_side = max(resize.new_h, resize.new_w)
        longs.append(long_side)
        assert 512 - 1 <= long_side <= 768 + 1
        assert out.shape[:2] == (640, 640)  # cropped to at most 640, then padded to 640
    assert max(longs) - min(longs) > 100  # it really jitters


def test_boxes_follow_the_pixels_under_resize_crop_flip():
    """Paint each box with its own colour; after the recipe each transformed box must still
    enclose exactly its colour (up to resampling at the border)."""
    np.random.seed(1)  # Detectron2's augmentations draw from NumPy's global RNG
    augs = build_scale_jitter_augmentation((512, 768), 640, 0.5, pad_value=0)
    flips = 0
    for trial in range(30):
        img = np.zeros((700, 900, 3), np.uint8)
        boxes = np.array([[100, 120, 260, 300], [500, 50, 700, 200], [300, 400, 800, 650]], np.float32)
        for i, (x0, y0, x1, y1) in enumerate(boxes.astype(int)):
            img[y0:y1, x0:x1] = (60 * (i + 1), 255 - 60 * i, 40 * i + 10)
        out, out_boxes, tfms = _apply(augs, img, boxes.copy())
        flips += any(isinstance(t, T.HFlipTransform) for t in tfms.transforms)
        for i, (x0, y0, x1, y1) in enumerate(out_boxes):
            x0, x1 = np.clip([x0, x1], 0, 640)
            y0, y1 = np.clip([y0, y1], 0, 640)
            if x1 - x0 < 4 or y1 - y0 < 4:
                continue  # cropped away
            colour = np.array((60 * (i + 1), 255 - 60 * i, 40 * i + 10))
            mask = np.all(np.abs(out.astype(int) - colour) <= 2, axis=-1)
            ys, xs = np.nonzero(mask)
            assert len(xs) > 0
            # the colour region and the transformed box agree within 2 px
            assert abs(xs.min() - x0) <= 2 and abs(xs.max() + 1 - x1) <= 2
            assert abs(ys.min() - y0) <= 2 and abs(ys.max() + 1 - y1) <= 2
    assert 5 <= flips <= 25  # p = 0.5 over 30 trials


def test_config_driven_and_disabled_path():
    cfg = get_aadet_cfg()
    augs = build_augmentation(cfg, is_train=True)
    assert [type(a) for a in augs] == [T.ResizeScale, T.FixedSizeCrop, T.RandomFlip]
    cfg.INPUT.SCALE_JITTER.FLIP_PROB = 0.0
    assert [type(a) for a in build_augmentation(cfg, True)] == [T.ResizeScale, T.FixedSizeCrop]
    cfg.INPUT.SCALE_JITTER.ENABLED = False
    assert isinstance(build_augmentation(cfg, True)[0], T.ResizeShortestEdge)
    # test time: longer side 640 with MIN_SIZE_TEST = MAX_SIZE_TEST = 640
    cfg.INPUT.MIN_SIZE_TEST = cfg.INPUT.MAX_SIZE_TEST = 640
    (test_aug,) = build_augmentation(cfg, is_train=False)
    for h, w in [(480, 1000), (1200, 800), (300, 300)]:
        t = test_aug.get_transform(np.zeros((h, w, 3), np.uint8))
        assert max(t.new_h, t.new_w) == 640


def test_optional_photometric_jitter():
    cfg = get_aadet_cfg()
    cfg.INPUT.PHOTOMETRIC.ENABLED = True
    cfg.INPUT.PHOTOMETRIC.BRIGHTNESS = (0.8, 1.2)
    augs = build_augmentation(cfg, True)
    assert [type(a) for a in augs] == [T.ResizeScale, T.FixedSizeCrop, T.RandomFlip,
                                       T.RandomBrightness, T.RandomContrast]
    assert (augs[2].horizontal, augs[2].vertical) == (True, False)
    assert (augs[3].intensity_min, augs[3].intensity_max) == (0.8, 1.2)
