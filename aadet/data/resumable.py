"""A training stream that resumes exactly where a killed run stopped (public Detectron2 API only).

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
from detectron2.data import build_detection_train_loader
from detectron2.data.common import DatasetFromList
from detectron2.data.samplers import TrainingSampler
from detectron2.utils import comm
from torch.utils.data import Dataset, Sampler

__all__ = [
    "ResumableTrainingSampler",
    "PositionKeyedDataset",
    "PositionSeededMapper",
    "build_resumable_train_loader",
]


class ResumableTrainingSampler(Sampler):
    """``TrainingSampler``'s stream, started at global sample ``start``; yields int keys.

    Built on Detectron2's public ``TrainingSampler`` (no private fields): its iterator yields this
    rank's share of the global stream, positions ``rank, rank + world, ...``; the key of the
    ``i``-th item is ``(rank + i * world) * size + index``. ``start`` must be a multiple of the
    world size (it is ``start_iter * SOLVER.IMS_PER_BATCH``, and the batch is split evenly).
    """

    def __init__(self, size: int, shuffle: bool = True, seed: int = None, start: int = 0):
        if start < 0:
            raise ValueError(f"start must be >= 0; got {start}")
        self._rank, self._world = comm.get_rank(), comm.get_world_size()
        if start % self._world:
            raise ValueError(
                f"start must be a multiple of the world size {self._world} (start_iter * "
                f"SOLVER.IMS_PER_BATCH, with the batch split evenly over workers); got {start}"
            )
        self.seed = int(comm.shared_random_seed() if seed is None else seed)
        self._sampler = TrainingSampler(size, shuffle=shuffle, seed=self.seed)
        self._size = int(size)
        self._start = int(start)

    def __iter__(self):
        skip = self._start // self._world  # this rank's items before global position `start`
        for i, idx in enumerate(itertools.islice(iter(self._sampler), skip, None), start=skip):
            yield (self._rank + i * self._world) * self._size + idx


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


def build_resumable_train_loader(
    dataset,
    *,
    mapper,
    total_batch_size: int,
    seed=None,
    start_iter: int = 0,
    aspect_ratio_grouping: bool = True,
    num_workers: int = 0,
):
    """Detectron2's ``build_detection_train_loader`` on the resumable stream: ``dataset`` (a list
    of dataset dicts) sampled by :class:`ResumableTrainingSampler` from iteration ``start_iter``,
    each sample mapped by ``mapper`` with RNGs seeded from ``(seed, position)``.

    ``seed``: the stream's seed (an int >= 0; None or < 0: the run's shared random seed). The
    YACS trainer passes ``SEED``, ``SOLVER.IMS_PER_BATCH``, ``DATALOADER.*``; a LazyConfig writes
    them (``configs/common/data/``).
    """
    if seed is not None and seed < 0:
        seed = None
    sampler = ResumableTrainingSampler(len(dataset), seed=seed, start=start_iter * total_batch_size)
    return build_detection_train_loader(
        dataset=PositionKeyedDataset(DatasetFromList(list(dataset), copy=False)),
        mapper=PositionSeededMapper(mapper, sampler.seed),
        sampler=sampler,
        total_batch_size=total_batch_size,
        aspect_ratio_grouping=aspect_ratio_grouping,
        num_workers=num_workers,
    )
