"""The index arithmetic of Horovod's ``ElasticSampler``, framework-neutral (``hvdlite.torch``'s
``ElasticSampler`` is this plus ``torch.utils.data.Sampler``).

Every rank shuffles the dataset's indices the same way for an epoch (``random.Random(seed +
epoch)``), and the ranks take turns through that order: rank ``r`` of ``R`` gets positions
``r, r + R, r + 2R, ...``.  A rank that has trained on ``b`` batches of ``B`` samples has
therefore used the first ``b * B * R`` positions together with the others, so "how many
samples of this epoch are done" is one number, ``processed_num``, the same on every rank.
After a reset, the positions not yet done are dealt out again over the new number of ranks,
so within an epoch no sample is trained on twice after a commit and none is skipped.  As
torch's ``DistributedSampler`` does, the last round is padded with samples from the start of
what remains so that every rank gets as many (at most ``R - 1`` repeats, at the end of an
epoch; fewer remaining samples than ranks are repeated as often as needed).
"""
from __future__ import annotations

import math
import random
from typing import Any


class ElasticSamplerBase:
    """Partitions ``range(len(dataset))`` over the ranks and re-partitions what remains of the
    epoch after a reset (Horovod's ``ElasticSampler`` semantics).

    Args:
        dataset: anything with ``len()`` (its size must not change).
        shuffle: shuffle the indices, differently for every epoch (default True).
        seed: the shuffle's seed; must be the same on every rank (default 0).

    Use it as Horovod recommends: put it in the elastic state, call :meth:`record_batch` after
    each batch, and :meth:`set_epoch` at the end of each epoch (not the start, so that an epoch
    cut short by a reset is not started again).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()   # Horovod's attribute (unused there too)
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.processed_num = 0
        self.reset()

    # Where the job's size and this rank's place come from (the framework's hvd.size/rank).
    def _world(self) -> tuple[int, int]:
        from hvdlite.common.runtime import state
        return state.size(), state.rank()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new shuffle, and nothing of it processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that every rank has processed one more batch of ``batch_size`` samples."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def reset(self) -> None:
        """Deal out what remains of the epoch over the current ranks."""
        self.num_replicas, self.rank = self._world()
        all_indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(all_indices)
        self.remaining_indices = all_indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        padding = self.total_size - len(indices)   # pad to a multiple of the ranks
        if padding and indices:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        assert len(indices) == self.total_size
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        assert len(self.indices) == self.num_samples
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
