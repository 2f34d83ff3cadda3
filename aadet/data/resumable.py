"""A training stream that resumes exactly where a killed run stopped.

Detectron2's ``TrainingSampler`` restarts its index stream from the beginning after ``--resume``,
and the augmentations draw from the process-global NumPy RNG, so a resumed run sees different
images and crops than the uninterrupted one. Here:

* :class:`ResumableTrainingSampler` yields the *same* stream as ``TrainingSampler`` (same seed, same
  permutations, same rank sharding), starting at a global sample offset, and tags every index with
  its global position: the key ``position * len(dataset) + index`` (one int, as Detectron2's
  ``MapDataset`` requires);
* :class:`PositionSeededMapper` decodes the key and seeds NumPy/Python RNGs from ``(seed,
  position)`` before the augmentations run, so the random resize/crop/flip of sample ``p`` is the
  same in every run, in every data-loader worker.

With ``start = start_iter * IMS_PER_BATCH`` a resumed run consumes exactly the samples the
uninterrupted run would have (with aspect-ratio grouping, up to the order inside groups).
"""
import itertools
import random

import numpy as np
from detectron2.data.samplers import TrainingSampler
from torch.utils.data import Dataset

__all__ = ["ResumableTrainingSampler", "PositionKeyedDataset", "PositionSeededMapper"]


class ResumableTrainingSampler(TrainingSampler):
    """``TrainingSampler`` whose stream can start at global sample ``start``; yields int keys."""

    def __init__(self, size: int, shuffle: bool = True, seed: int = None, start: int = 0):
        super().__init__(size, shuffle=shuffle, seed=seed)
        if start < 0:
            raise ValueError(f"start must be >= 0; got {start}")
        self._start = int(start)

    @property
    def seed(self) -> int:
        return self._seed

    def __iter__(self):
        stream = enumerate(self._infinite_indices())  # (global position, dataset index)
        for pos, idx in itertools.islice(stream, self._start + self._rank, None, self._world_size):
            yield pos * self._size + idx


class PositionKeyedDataset(Dataset):
    """Map-style view of ``dataset`` indexed by the sampler's keys; returns ``(position, item)``."""

    def __init__(self, dataset):
        self._dataset = dataset
        self._n = len(dataset)

    def __len__(self):
        return self._n

    def __getitem__(self, key):
        pos, idx = divmod(int(key), self._n)
        return pos, self._dataset[idx]


class PositionSeededMapper:
    """Calls ``mapper(item)`` with NumPy and Python RNGs seeded from ``(seed, position)``."""

    def __init__(self, mapper, seed: int):
        self.mapper = mapper
        self.seed = int(seed)

    def __call__(self, pos_item):
        pos, item = pos_item
        s = (self.seed * 1_000_003 + pos) % (2**32)
        np.random.seed(s)
        random.seed(s)
        return self.mapper(item)
