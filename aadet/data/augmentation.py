"""The papers' RetinaNet data recipe as Detectron2 augmentations.

AA paper, appendix A.1 (same recipe in SASA): "randomly resize images from [512, 768] and crop to a
max dimension of 640 during training. All images are horizontally flipped with a 50% probability."

* ``ResizeScale(min_scale=512/640, max_scale=768/640, 640, 640)`` resizes so the image fits a
  ``640*s`` square, i.e. its longer side is ``640*s``, uniform in [512, 768];
* ``FixedSizeCrop((640, 640))`` crops a random 640x640 window when larger and pads to 640x640;
* ``RandomFlip(prob=0.5)`` flips horizontally.

Optionally (not in the papers): a vertical flip (``INPUT.SCALE_JITTER.VFLIP_PROB``; overhead imagery
has no "up", but its shadows point away from the sun, and a flip moves them: check that the flipped
images look like the test images -- on the tree demo a vertical flip cost 9 AP50), and photometric
jitter (``INPUT.PHOTOMETRIC``): brightness, contrast and a per-channel gain
(:class:`RandomChannelGain`, white balance: two cameras or flights differ in it).

Test time is Detectron2's ``ResizeShortestEdge(MIN_SIZE_TEST, MAX_SIZE_TEST)``; our configs set both
to 640 so the longer side is 640.
"""
import numpy as np
from detectron2.data import detection_utils as utils
from detectron2.data import transforms as T

__all__ = ["RandomChannelGain", "build_scale_jitter_augmentation", "build_augmentation"]


class RandomChannelGain(T.Augmentation):
    """Multiply each colour channel by its own factor drawn uniformly from ``[gain_min, gain_max]``
    (a white-balance jitter), result clipped to [0, 255]. Boxes are unchanged.

    ``image [H, W, C]`` (uint8, or float in 0..255) -> same shape and dtype.
    """

    def __init__(self, gain_min: float, gain_max: float):
        super().__init__()
        self._init(locals())

    def get_transform(self, image):
        gains = np.random.uniform(self.gain_min, self.gain_max, size=image.shape[-1])
        gains = gains.astype(np.float32)

        def apply(img):
            out = np.clip(img.astype(np.float32) * gains, 0, 255)
            return out.astype(np.uint8) if img.dtype == np.uint8 else out

        return T.ColorTransform(apply)


def build_scale_jitter_augmentation(
    long_side_range, crop_size, flip_prob, pad_value=128.0, vflip_prob=0.0
):
    """The recipe's augmentation list (plain arguments; see module docstring)."""
    lo, hi = long_side_range
    augs = [
        T.ResizeScale(
            min_scale=lo / crop_size, max_scale=hi / crop_size,
            target_height=crop_size, target_width=crop_size,
        ),
        T.FixedSizeCrop(crop_size=(crop_size, crop_size), pad=True, pad_value=pad_value),
    ]
    if flip_prob > 0:
        augs.append(T.RandomFlip(prob=flip_prob, horizontal=True, vertical=False))
    if vflip_prob > 0:
        augs.append(T.RandomFlip(prob=vflip_prob, horizontal=False, vertical=True))
    return augs


def build_augmentation(cfg, is_train: bool):
    """Augmentations for training (scale jitter recipe if ``INPUT.SCALE_JITTER.ENABLED``, then
    photometric jitter if ``INPUT.PHOTOMETRIC.ENABLED``) or test."""
    if not is_train:
        return utils.build_augmentation(cfg, False)
    sj = cfg.INPUT.SCALE_JITTER
    if sj.ENABLED:
        augs = build_scale_jitter_augmentation(
            tuple(sj.LONG_SIDE_RANGE), int(sj.CROP_SIZE), float(sj.FLIP_PROB), float(sj.PAD_VALUE),
            float(sj.VFLIP_PROB),
        )
    else:
        augs = utils.build_augmentation(cfg, True)
    ph = cfg.INPUT.PHOTOMETRIC
    if ph.ENABLED:
        augs += [T.RandomBrightness(*ph.BRIGHTNESS), T.RandomContrast(*ph.CONTRAST)]
        if tuple(ph.CHANNEL_GAIN) != (1.0, 1.0):
            augs.append(RandomChannelGain(*ph.CHANNEL_GAIN))
    return augs
