"""One buffer per node in shared memory, read and written by every rank of the node (the
hierarchical allgather gathers its result there once per node, see
:mod:`hvdlite.common.data_paths.hierarchical`).

The buffer belongs to the node's first rank (an MPI shared-memory window whose other ranks
contribute no memory) and holds two slots that alternate between consecutive operations: a
rank writes slot ``s`` again two operations later, after passing the first barrier of the
operation in between, which every rank of the node reaches only after reading slot ``s``.  So
each operation needs two barriers, not three.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from hvdlite.common.intranode.shared_window import (ALIGN, MIN_SLOT, SHM_MARGIN, next_pow2,
                                                    shm_space, window_barrier)


class NodeBuffer:
    """The shared buffer of one node-local communicator ``local``; at most ``max_bytes`` a
    slot."""

    def __init__(self, local, max_bytes: int, max_sleep: float = 1e-3,
                 on_slow: Callable[[float], None] | None = None) -> None:
        self.comm = local
        self.max_bytes = max_bytes
        self.max_sleep = max_sleep
        self.on_slow = on_slow
        self._win = None
        self._memory: np.ndarray | None = None   # both slots, as bytes
        self.slot_bytes = 0
        self._slot = 0

    @staticmethod
    def slot_size(nbytes: int, max_bytes: int) -> int:
        """The slot size a buffer of ``nbytes`` is given (0: more than ``max_bytes``)."""
        if nbytes > max_bytes:
            return 0
        slot = min(max(next_pow2(nbytes), MIN_SLOT), max_bytes)
        return -(-slot // ALIGN) * ALIGN

    def slot_for(self, nbytes: int) -> int:
        return self.slot_size(nbytes, self.max_bytes)

    def room_for(self, nbytes: int) -> bool:
        """Whether this node's shared memory has room for slots of ``nbytes`` (not collective:
        the caller agrees on it with every node before :meth:`grow`)."""
        slot = self.slot_for(nbytes)
        if slot == 0:
            return False
        space = shm_space()   # the old buffer's space comes back when it is freed
        held = 2 * self.slot_bytes if self._win is not None else 0
        return space is None or space + held >= 2 * slot + SHM_MARGIN

    def grow(self, nbytes: int) -> None:
        """Make each slot hold ``nbytes`` (collective over the node's ranks)."""
        from mpi4py import MPI
        slot = self.slot_for(nbytes)
        self.close(collective=True)
        mine = 2 * slot if self.comm.Get_rank() == 0 else 0
        win = MPI.Win.Allocate_shared(mine, 1, comm=self.comm)
        win.Lock_all(MPI.MODE_NOCHECK)
        buf, _ = win.Shared_query(0)
        self._win, self.slot_bytes, self._slot = win, slot, 0
        self._memory = np.frombuffer(buf, dtype=np.uint8, count=2 * slot)

    def next_slot(self, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` elements of the slot for this operation; the next call gets the other."""
        start = self._slot * self.slot_bytes
        self._slot ^= 1
        return self._memory[start:start + count * dtype.itemsize].view(dtype)

    def barrier(self) -> None:
        """Every rank of the node is here; memory written before it is seen after it."""
        window_barrier(self._win, self.comm, self.max_sleep, self.on_slow)

    def close(self, collective: bool) -> None:
        """Release the buffer (freeing is collective: skipped when a peer may never call it)."""
        win, self._win = self._win, None
        self._memory, self.slot_bytes = None, 0
        if win is None:
            return
        win.Unlock_all()
        if collective:
            win.Free()
