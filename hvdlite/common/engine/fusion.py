"""Tensor fusion planning (pure logic) and the reusable host fusion buffer.

Responses that can share one collective (allreduces with the same dtype, reduce op, scale factors
and device) are packed, in negotiated order, into batches of at most ``threshold`` bytes.  A tensor
larger than the threshold, or any tensor when fusion is off (threshold 0), runs alone and is
reduced without going through the fusion buffer.
"""
from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def plan_batches(items: Sequence[T], key: Callable[[T], Hashable | None],
                 nbytes: Callable[[T], int], threshold: int) -> list[list[T]]:
    """Group ``items`` into batches.

    ``key(item)`` is None for items that never fuse.  Batches come out ordered by their first
    item, so every rank given the same items produces the same plan.
    """
    keys = [key(item) for item in items]
    sizes = [nbytes(item) for item in items]
    # The usual training step: every tensor fuses with every other and all fit in one batch.
    if (threshold > 0 and keys and keys[0] is not None and keys.count(keys[0]) == len(keys)
            and sum(sizes) <= threshold):
        return [list(items)]
    batches: list[list[T]] = []
    open_batch: dict[Hashable, list] = {}   # key -> [its open batch, the batch's bytes]
    for item, k, size in zip(items, keys, sizes):
        if k is None or threshold <= 0 or size > threshold:
            batches.append([item])
            continue
        current = open_batch.get(k)
        if current is not None and current[1] + size <= threshold:
            current[0].append(item)
            current[1] += size
            continue
        batch = [item]
        batches.append(batch)
        open_batch[k] = [batch, size]
    return batches


class FusionBuffer:
    """One growable host buffer reused by every fused collective (never shrinks)."""

    def __init__(self) -> None:
        self._raw = np.empty(0, dtype=np.uint8)

    def view(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        if self._raw.nbytes < nbytes:
            self._raw = np.empty(nbytes, dtype=np.uint8)
        return self._raw[:nbytes].view(dtype)
