"""The resumable training stream is Detectron2's TrainingSampler stream, started anywhere."""
import itertools

import pytest
from detectron2.data.samplers import TrainingSampler

from aadet.data.resumable import ResumableTrainingSampler


def take(it, n):
    return list(itertools.islice(iter(it), n))


@pytest.mark.parametrize("shuffle", [True, False])
def test_keys_decode_to_training_sampler_stream(shuffle):
    size = 7
    reference = take(TrainingSampler(size, shuffle=shuffle, seed=3), 40)
    keys = take(ResumableTrainingSampler(size, shuffle=shuffle, seed=3), 40)
    assert [divmod(k, size) for k in keys] == list(enumerate(reference))


def test_resumed_stream_continues_at_start():
    size, start = 5, 23
    full = take(ResumableTrainingSampler(size, seed=11), 60)
    resumed = take(ResumableTrainingSampler(size, seed=11, start=start), 60 - start)
    assert resumed == full[start:]


def test_bad_start():
    with pytest.raises(ValueError, match="start must be >= 0"):
        ResumableTrainingSampler(4, start=-1)
