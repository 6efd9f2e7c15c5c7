"""Host buffers for results the core allocates.

Two properties matter for speed, both measured on the 2-core reference machine:

* **Alignment.**  TensorFlow adopts a ``tf.numpy_function`` output without copying it only when
  its data is aligned to Eigen's 64 bytes; numpy guarantees 16.  Eager ``tf.convert_to_tensor``
  of a 16 MiB array took 14.6 ms unaligned, 1.8 ms aligned.  Torch and numpy view any alignment.
  Below ``ALIGN_MIN_BYTES`` the copy costs nothing measurable (4-16 KiB: 39-43 us unaligned
  against 46-56 us aligned, TensorFlow's own overhead), while finding an array's address to
  align it costs ~2 us (``ndarray.ctypes``): about 20 us of a lone 4 KiB allreduce once the
  background thread competes for the interpreter.  Small results are therefore plain
  ``np.empty``.
* **Warm pages.**  A fresh multi-megabyte allocation is new memory from the kernel: every 4 KiB
  page faults and is zeroed the first time MPI writes it, which tripled the time of a 16 MiB
  out-of-place allreduce (9.3 ms against 3.3 ms into a reused buffer).  Results of that size are
  therefore carved from a :class:`BufferPool` that takes a block back when the last array using
  it is garbage-collected, so a training loop that allreduces the same sizes every step reuses
  the same warm memory, as the caching allocators of GPU frameworks do.  Blocks come in size
  classes (eight per doubling), so results whose size changes a little from step to step (the
  allgather of a sparse gradient) reuse them too: matched by exact size, an allgather of
  3.6-4 MB results missed every time, took 5-27 ms instead of 2.3-2.8 ms, and the pool filled
  with 500 MiB of blocks nobody asked for again.  A new block is mapped with its pages
  populated in one system call (Linux ``MAP_POPULATE``) instead of faulting them in one by one:
  on the reference VM a fresh 16 MiB array took 53-60 ms to fill (most runs; once 4 ms), 9-11 ms
  populated; a block dropped by the pool goes straight back to the operating system.
"""
from __future__ import annotations

import math
import mmap
import threading
import weakref

import numpy as np

from hvdlite.common.config import DEFAULT_RESULT_POOL_MB

ALIGNMENT = 64
ALIGN_MIN_BYTES = 64 * 1024           # smaller results are not aligned (see above)
POOL_MIN_BYTES = 256 * 1024           # below this, malloc's heap already reuses warm memory
POOL_MAX_IDLE_BYTES = int(DEFAULT_RESULT_POOL_MB * 2**20)   # (HVDLITE_RESULT_POOL_MB)


_POPULATE_FLAGS = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
                   if hasattr(mmap, "MAP_POPULATE") and hasattr(mmap, "MAP_ANONYMOUS") else None)


def fresh_block(nbytes: int) -> np.ndarray:
    """``nbytes`` (> 0) of new, writable, page-aligned memory whose pages are already mapped
    where the platform allows (see the module docstring); freed with the last array using it."""
    if _POPULATE_FLAGS is not None:
        try:
            return np.frombuffer(mmap.mmap(-1, nbytes, flags=_POPULATE_FLAGS), dtype=np.uint8)
        except OSError:   # (e.g. a map-count limit): malloc's memory is as correct
            pass
    return np.empty(nbytes, dtype=np.uint8)


def size_class(nbytes: int) -> int:
    """The pool block size serving ``nbytes``: rounded up to one of eight steps per power of
    two (at most 12.5% unused; pure logic, unit-tested)."""
    shift = nbytes.bit_length() - 4
    if shift <= 0:
        return nbytes
    return -(-nbytes >> shift) << shift


def _nbytes(shape, dtype: np.dtype) -> int:
    # math.prod, not np.prod: this runs for every out-of-place result, and np.prod of a small
    # tuple costs ~6 us (a quarter of a lone 4 KiB allreduce's budget).
    return int(math.prod(shape)) * dtype.itemsize


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    return _aligned_empty(shape, dtype, _nbytes(shape, dtype))


def _aligned_empty(shape, dtype: np.dtype, nbytes: int) -> np.ndarray:
    return _carve(np.empty(nbytes + ALIGNMENT, dtype=np.uint8), nbytes, dtype, shape)


def _carve(raw: np.ndarray, nbytes: int, dtype: np.dtype, shape) -> np.ndarray:
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class _Lease:
    """Exposes a pooled block to numpy.  Not an ndarray on purpose: numpy collapses chains of
    ndarray views onto the array that owns the memory, which would let the lease die while its
    views live; a non-array base is kept by every view derived from it."""

    __slots__ = ("__array_interface__", "_block", "__weakref__")

    def __init__(self, block: np.ndarray) -> None:
        self._block = block
        self.__array_interface__ = {"shape": block.shape, "typestr": "|u1", "version": 3,
                                    "data": (block.ctypes.data, False)}


class BufferPool:
    """Aligned arrays whose memory returns to the pool when the last array using it dies.

    Each block is handed out through a *lease*: a view that every result array derives from
    (numpy views keep their base alive, and so does a framework tensor that wraps the array
    without copying).  A finalizer on the lease puts the block back on the free list of its
    size class (:func:`size_class`): a training loop asks for the same sizes every step, and
    sizes that vary a little share a class.  At most ``max_idle_bytes`` stay idle; beyond that
    a returned block is dropped (0 turns pooling off).
    Thread-safe: a lease may die on any thread.
    """

    def __init__(self, min_bytes: int = POOL_MIN_BYTES,
                 max_idle_bytes: int = POOL_MAX_IDLE_BYTES) -> None:
        self.min_bytes = min_bytes
        self.max_idle_bytes = max_idle_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.hits = 0      # for tests and diagnostics
        self.misses = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def empty(self, shape, dtype, nbytes: int | None = None) -> np.ndarray:
        """Like :func:`aligned_empty`; pooled when at least ``min_bytes`` large.  ``nbytes``:
        the array's size, if the caller knows it already."""
        dtype = np.dtype(dtype)
        if nbytes is None:
            nbytes = _nbytes(shape, dtype)
        if nbytes < self.min_bytes or self.max_idle_bytes <= 0:
            return _aligned_empty(shape, dtype, nbytes)
        block_bytes = size_class(nbytes)
        block = None
        with self._lock:
            blocks = self._free.get(block_bytes)
            if blocks:
                block = blocks.pop()
                self._idle_bytes -= block_bytes
                self.hits += 1
            else:
                self.misses += 1
        if block is None:
            block = fresh_block(block_bytes + ALIGNMENT)
        lease = _Lease(block)
        finalizer = weakref.finalize(lease, self._give_back, block, block_bytes)
        finalizer.atexit = False   # (exit frees everything anyway)
        return _carve(np.asarray(lease), nbytes, dtype, shape)

    def _give_back(self, block: np.ndarray, block_bytes: int) -> None:
        with self._lock:
            if self._idle_bytes + block_bytes > self.max_idle_bytes:
                return                        # dropped: freed with the array
            self._free.setdefault(block_bytes, []).append(block)
            self._idle_bytes += block_bytes

    def clear(self) -> None:
        """Release every idle block (leased ones come back to a pool that then stays small)."""
        with self._lock:
            self._free.clear()
            self._idle_bytes = 0


_pool = BufferPool()


def result_empty(shape, dtype) -> np.ndarray:
    """Where the core allocates host results: those of ``ALIGN_MIN_BYTES`` or more 64-byte
    aligned, large ones from the pool, small ones plain ``np.empty``."""
    dtype = np.dtype(dtype)
    nbytes = _nbytes(shape, dtype)
    if nbytes < ALIGN_MIN_BYTES:
        return np.empty(shape, dtype)
    return _pool.empty(shape, dtype, nbytes)


def result_pool() -> BufferPool:
    return _pool
