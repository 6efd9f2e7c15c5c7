"""Intra-node allreduce through one MPI shared-memory window.

When every rank of a process set runs on one node, an allreduce need not go through MPI's
point-to-point machinery (which copies each chunk into a shared cell and out again, and needs
both ranks' threads scheduled at once for every cell).  A fused batch goes like this:

1. each rank packs its inputs straight into its own segment of a shared window (the pack into a
   fusion buffer happens anyway, so this costs nothing extra);
2. after a barrier, rank ``p`` reduces share ``p`` of the elements, reading every peer's
   segment directly and writing the result over its own share;
3. after a second barrier, every rank copies each share out of its owner's segment into the
   outputs (the data path folds the postscale into that copy).

A single large tensor (``allreduce_one``) needs no pack: each rank publishes only the shares
its peers reduce, reduces its own share straight from its input into its output (prescale,
reduction and postscale in one cache-sized chunk at a time) and publishes that result; after
the second barrier it copies the peers' results into its output.  Average's scaling costs no
extra pass; at 2 ranks a 64 MiB Sum measured 2x faster than MPICH, 16 MiB out of place 1.4x.

Each element is reduced by exactly one rank, so results are bitwise identical on every rank.
Two slots alternate between consecutive batches: packing batch k+1 cannot overwrite what a slower
peer still copies out of batch k, because every rank passes batch k+1's first barrier only after
its copy-out of batch k.

Every decision here (use it or not, grow the window) is a function of the negotiated batch and
of values agreed across ranks, so all ranks make the same collective calls in the same order.
Waits are MPI barriers, so a vanished peer is handled exactly as in MPI's own collectives.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import numpy as np

from hvdlite.common.dtypes import scale_into
from hvdlite.common.runtime.waiting import PEER_SPIN_SECONDS, wait_until

log = logging.getLogger("hvdlite")

# ``between(lo, share)``: called with this rank's reduced share (elements lo onwards) before the
# peers read it (see SharedWindow.reduce).
Between = Callable[[int, np.ndarray], None]

# Below these the two barriers cost more than MPI's own allreduce (measured): a fused batch
# saves MPI's copies of a buffer packed anyway; a lone tensor must also pay for publishing.
MIN_BYTES = 64 * 1024
MIN_SINGLE_BYTES = 1 << 20
_CHUNK_BYTES = 256 * 1024   # one step of the single-tensor reduction: stays in L2
# Sizing rules shared with intranode/node_buffer.py (the other shared-memory segment):
ALIGN = 64                 # bytes: each rank's share starts on a cache line
MIN_SLOT = 1 << 20         # smallest segment allocated: growing is collective, so start roomy
SHM_DIR = "/dev/shm"       # where MPICH and Open MPI place shared segments on Linux
SHM_MARGIN = 16 << 20      # left free for MPI's own segments and everything else


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (segments grow by doubling, so few regrowths)."""
    return 1 << max(0, n - 1).bit_length()


def window_barrier(win, comm, max_sleep: float,
                   on_slow: Callable[[float], None] | None) -> None:
    """Every rank of ``comm`` is here, and memory of ``win`` written before is seen after.

    Win.Sync orders this rank's stores/loads around the barrier (MPI's unified model).  A
    blocking Barrier would busy-poll while a peer waits for a core (see POLITE_MAX_BYTES in
    data_paths/helpers.py), so this sleeps up to ``max_sleep`` between tests; ``on_slow`` runs
    the stall checks during a long wait (and may raise)."""
    win.Sync()
    wait_until(comm.Ibarrier().Test, max_sleep, on_slow=on_slow, spin_seconds=PEER_SPIN_SECONDS)
    win.Sync()


class SharedWindow:
    """The shared window of one process set's communicator, grown on demand."""

    def __init__(self, comm, max_batch_bytes: int, max_sleep: float = 1e-3,
                 on_slow: Callable[[float], None] | None = None) -> None:
        self.comm = comm
        self.max_sleep = max_sleep   # longest sleep while waiting for peers at a barrier
        self.on_slow = on_slow       # stall checks during such a wait (may raise)
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.max_batch_bytes = max_batch_bytes
        self._single_node: bool | None = None   # decided collectively on first use
        self._disabled = False
        self._win = None
        self._segments: list[np.ndarray] = []   # every rank's segment, as bytes
        self._slot_bytes = 0
        self._slot = 0
        self.batches = 0                # fused batches reduced here (for tests and benchmarks)
        self.singles = 0                # single tensors reduced here (likewise)
        self.largest_slot_bytes = 0     # the largest window slot ever allocated (likewise)

    # --- collective decisions ----------------------------------------------------------------
    def usable(self, nbytes: int, single: bool = False) -> bool:
        """Whether a fused batch (or, with ``single``, one tensor) of ``nbytes`` goes through
        shared memory.  Collective: every rank calls it for the same batch (it may split a
        communicator or grow the window)."""
        least = MIN_SINGLE_BYTES if single else MIN_BYTES
        if self._disabled or self.size < 2 or not least <= nbytes <= self.max_batch_bytes:
            return False
        if self._single_node is None:
            self._single_node = all_on_one_node(self.comm)
        if not self._single_node:
            return False
        if nbytes > self._slot_bytes:
            self._grow(nbytes)
        return not self._disabled

    def _grow(self, nbytes: int) -> None:
        from mpi4py import MPI
        slot = min(max(next_pow2(nbytes), MIN_SLOT), self.max_batch_bytes)
        slot = -(-slot // ALIGN) * ALIGN
        need = 2 * slot * self.size   # every rank's two slots live in the node's shared memory
        space = shm_space()   # the old window's space comes back when it is freed
        fits = space is None or space + self._window_bytes() >= need + SHM_MARGIN
        if not self.comm.allreduce(fits, op=MPI.LAND):
            self._disabled = True
            self.close(collective=True)   # every rank is here: a window never used again goes
            log.warning("hvdlite: %s has too little free space for a %d MiB shared fusion "
                        "window; fused allreduces use MPI instead. Enlarge it (docker run "
                        "--shm-size) or set HVDLITE_SHM_WINDOW_MB=0 to silence this.",
                        SHM_DIR, need >> 20)
            return
        self.close(collective=True)
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")   # each segment on its owner's pages
        try:
            win = MPI.Win.Allocate_shared(2 * slot, 1, info=info, comm=self.comm)
        finally:
            info.Free()
        win.Lock_all(MPI.MODE_NOCHECK)
        segments = []
        for r in range(self.size):
            buf, _ = win.Shared_query(r)
            segments.append(np.frombuffer(buf, dtype=np.uint8, count=2 * slot))
        self._win, self._segments, self._slot_bytes, self._slot = win, segments, slot, 0
        self.largest_slot_bytes = max(self.largest_slot_bytes, slot)

    def _window_bytes(self) -> int:
        return 2 * self._slot_bytes * self.size if self._win is not None else 0

    # --- one batch ---------------------------------------------------------------------------
    def pack_buffer(self, count: int, dtype: np.dtype) -> np.ndarray:
        """This rank's input buffer for the next batch (``count`` elements, in the window)."""
        start = self._slot * self._slot_bytes
        return self._segments[self.rank][start:start + count * dtype.itemsize].view(dtype)

    def _next_views(self, count: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's ``count`` elements in the current slot; the next call gets the other."""
        start = self._slot * self._slot_bytes
        stop = start + count * dtype.itemsize
        self._slot ^= 1
        return [seg[start:stop].view(dtype) for seg in self._segments]

    def reduce(self, count: int, dtype: np.dtype, ufunc,
               between: Between | None = None) -> list[tuple[int, int, np.ndarray]]:
        """Reduce the packed buffers of every rank with ``ufunc`` (after all ranks packed).

        Returns the result as pieces ``(start, stop, elements start..stop)`` in element order;
        they stay valid until the batch after next.  ``between(lo, share)``, if given, is
        called with this rank's reduced share (elements ``lo`` onwards, writable) before the
        peers read it: the hierarchical path combines it with other hosts' there.
        """
        views = self._next_views(count, dtype)
        bounds = self.shares(count, dtype.itemsize, self.size)
        self._barrier()
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        if hi > lo:
            with np.errstate(all="ignore"):   # overflow wraps/saturates silently, as in MPI
                self._fold_peers(views[self.rank][lo:hi], views, lo, hi, ufunc)
        if between is not None:
            between(lo, views[self.rank][lo:hi])
        self._barrier()
        self.batches += 1
        return [(bounds[r], bounds[r + 1], views[r][bounds[r]:bounds[r + 1]])
                for r in range(self.size) if bounds[r + 1] > bounds[r]]

    def reduce_pair_into(self, count: int, dtype: np.dtype, ufunc, outputs: list[np.ndarray],
                         sizes: list[int], factor: float,
                         in_place: list[bool] | None = None) -> None:
        """Two ranks: each combines both packed buffers straight into its outputs (``sizes[i]``
        elements each, back to back), multiplied by ``factor``.  ``in_place[i]``: output ``i``
        is this rank's input exactly as packed (no prescale), so it is combined from itself
        instead of from its packed copy, which spares one stream of memory traffic
        (an in-place update writes lines it has just read; measured 1.15-1.27 -> 0.85-1.04 ms
        for 200 x 16 KiB with both ranks running).

        Always rank 0's values first, so both ranks compute the same bits.  Against
        :meth:`reduce` this is one pass over the data instead of a share reduction plus a
        copy-out, and one barrier instead of two: reading both buffers costs no more than
        reading half of them twice.  (With more ranks every rank would read every buffer, so
        they share the work instead.)  One barrier is enough: a rank packs the slot of batch
        k+2 only after batch k+1's barrier, which its peer reaches only after reading batch k.
        """
        first, second = self._next_views(count, dtype)
        mine_first = self.rank == 0
        self._barrier()
        offset = 0
        with np.errstate(all="ignore"):   # overflow wraps/saturates silently, as in MPI
            for i, (out, n) in enumerate(zip(outputs, sizes)):
                end = offset + n
                if in_place is not None and in_place[i]:
                    if mine_first:
                        ufunc(out, second[offset:end], out=out)
                    else:
                        ufunc(first[offset:end], out, out=out)
                else:
                    ufunc(first[offset:end], second[offset:end], out=out)
                if factor != 1.0:
                    scale_into(out, out, factor)
                offset = end
        self.batches += 1

    def allreduce_one(self, src: np.ndarray, out: np.ndarray, ufunc, prescale: float,
                      postscale: float, between: Between | None = None) -> None:
        """``out = postscale * reduce(prescale * src of every rank)`` for one flat contiguous
        array (``out`` may be ``src``), publishing only what the peers need.  ``between``: as
        in :meth:`reduce`, called with this rank's reduced share before the postscale."""
        count, dtype = src.size, src.dtype
        views = self._next_views(count, dtype)
        bounds = self.shares(count, dtype.itemsize, self.size)
        published = views[self.rank]
        others = [r for r in range(self.size) if r != self.rank and bounds[r + 1] > bounds[r]]
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        step = max(1, _CHUNK_BYTES // dtype.itemsize)
        with np.errstate(all="ignore"):   # overflow wraps/saturates silently, as in MPI
            for r in others:              # the inputs of the shares the peers reduce
                scale_into(published[bounds[r]:bounds[r + 1]], src[bounds[r]:bounds[r + 1]],
                           prescale)
            self._barrier()
            for x in range(lo, hi, step):   # my share, from my input into my output
                y = min(hi, x + step)
                chunk = out[x:y]
                scale_into(chunk, src[x:y], prescale)
                self._fold_peers(chunk, views, x, y, ufunc)
                if between is None:   # finish each chunk while it is in cache
                    scale_into(chunk, chunk, postscale)
                    np.copyto(published[x:y], chunk)
            if between is not None:   # the share is complete only after the other hosts'
                between(lo, out[lo:hi])
                scale_into(out[lo:hi], out[lo:hi], postscale)
                np.copyto(published[lo:hi], out[lo:hi])
            self._barrier()
        for r in others:   # the peers' results
            np.copyto(out[bounds[r]:bounds[r + 1]], views[r][bounds[r]:bounds[r + 1]])
        self.singles += 1

    def _fold_peers(self, target: np.ndarray, views: list[np.ndarray], lo: int, hi: int,
                    ufunc) -> None:
        """``target`` (this rank's elements lo..hi) combined with every peer's, in rank order.
        The owner's value comes first, so a float result's last bits depend on whose share an
        element falls in (as MPI's depend on its algorithm); every rank copies the owner's
        result, so all ranks still hold the same bits."""
        for r in range(self.size):
            if r != self.rank:
                ufunc(target, views[r][lo:hi], out=target)

    @staticmethod
    def shares(count: int, itemsize: int, size: int) -> list[int]:
        """Element boundaries of each rank's share: nearly equal, each starting on a cache
        line (pure logic, unit-tested)."""
        unit = max(1, ALIGN // itemsize)
        bounds = [(count * p // size) // unit * unit for p in range(size)]
        return bounds + [count]

    def _barrier(self) -> None:
        window_barrier(self._win, self.comm, self.max_sleep, self.on_slow)

    def close(self, collective: bool) -> None:
        """Release the window.  Freeing is collective, so it is skipped (and the memory left to
        process exit) when some rank may never call it (a peer died or left early)."""
        win, self._win = self._win, None
        self._segments, self._slot_bytes = [], 0
        if win is None:
            return
        win.Unlock_all()
        if collective:
            win.Free()


def shm_space() -> int | None:
    """Free bytes where shared segments live, or None if that cannot be known here."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def all_on_one_node(comm) -> bool:
    """Whether every rank of ``comm`` shares one node's memory.  Collective."""
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        together = local.Get_size() == comm.Get_size()
    finally:
        local.Free()
    return bool(comm.allreduce(together, op=MPI.LAND))
