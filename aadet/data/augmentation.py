"""The papers' RetinaNet data recipe as Detectron2 augmentations.

AA paper, appendix A.1 (same recipe in SASA): "randomly resize images from [512, 768] and crop to a
max dimension of 640 during training. All images are horizontally flipped with a 50% probability."

* ``ResizeScale(min_scale=512/640, max_scale=768/640, 640, 640)`` resizes so the image fits a
  ``640*s`` square, i.e. its longer side is ``640*s``, uniform in [512, 768];
* ``FixedSizeCrop((640, 640))`` crops a random 640x640 window when larger and pads to 640x640;
* ``RandomFlip(prob=0.5)`` flips horizontally.

Optionally (not in the papers): brightness and contrast jitter (``INPUT.PHOTOMETRIC``).

Test time is Detectron2's ``ResizeShortestEdge(MIN_SIZE_TEST, MAX_SIZE_TEST)``; our configs set both
to 640 so the longer side is 640.
"""
from detectron2.data import detection_utils as utils
from detectron2.data import transforms as T

from ..config import check_recipe_values
from ..layers.functional.checks import argument_error

__all__ = [
    "build_scale_jitter_augmentation",
    "build_photometric_augmentation",
    "recipe_augmentation",
    "build_augmentation",
]


def build_scale_jitter_augmentation(long_side_range, crop_size, flip_prob, pad_value=128.0):
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
    return augs


def build_photometric_augmentation(brightness, contrast):
    """Brightness then contrast jitter, factors uniform in the ``(min, max)`` ranges."""
    return [T.RandomBrightness(*brightness), T.RandomContrast(*contrast)]


def recipe_augmentation(
    long_side_range, crop_size, flip_prob, pad_value=128.0, brightness=None, contrast=None
):
    """The training augmentation of the recipe from plain arguments (what a LazyConfig gives):
    :func:`build_scale_jitter_augmentation`, then photometric jitter when ``brightness`` and
    ``contrast`` ranges are given (None: off). ``build_augmentation(cfg, True)`` with
    ``INPUT.SCALE_JITTER.ENABLED`` is this function of the config's values."""
    check_recipe_values(long_side_range, crop_size, flip_prob, brightness, contrast,
                        name=lambda arg: arg, error=argument_error)
    augs = build_scale_jitter_augmentation(long_side_range, crop_size, flip_prob, pad_value)
    if (brightness is None) != (contrast is None):
        raise ValueError("recipe_augmentation: give both brightness and contrast ranges, or neither")
    if brightness is not None:
        augs += build_photometric_augmentation(tuple(brightness), tuple(contrast))
    return augs


def build_augmentation(cfg, is_train: bool):
    """Augmentations for training (scale jitter recipe if ``INPUT.SCALE_JITTER.ENABLED``, then
    photometric jitter if ``INPUT.PHOTOMETRIC.ENABLED``) or test."""
    if not is_train:
        return utils.build_augmentation(cfg, False)
    sj, ph = cfg.INPUT.SCALE_JITTER, cfg.INPUT.PHOTOMETRIC
    if sj.ENABLED:
        return recipe_augmentation(
            tuple(sj.LONG_SIDE_RANGE), int(sj.CROP_SIZE), float(sj.FLIP_PROB), float(sj.PAD_VALUE),
            *((ph.BRIGHTNESS, ph.CONTRAST) if ph.ENABLED else ()),
        )
    augs = utils.build_augmentation(cfg, True)
    if ph.ENABLED:
        augs += build_photometric_augmentation(ph.BRIGHTNESS, ph.CONTRAST)
    return augs
