"""Adasum allreduce kernel on a flat (fusion) buffer, over any mpi4py communicator.

Adasum combines two gradients ``a`` and ``b`` as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient whose denominator is 0 is taken as 1), and ``2**k`` ranks as a binary tree: ranks
(0,1), (2,3), ... first, then the results of (0,1) and (2,3), and so on (distance 1, 2, 4, ...).
The lower-numbered half of each pair plays ``a``.

The kernel uses recursive vector halving with distance doubling: at the level with distance ``d``
each rank swaps half of its current slice with ``rank ^ d``, so it holds both operands for the
half it keeps.  The per-tensor dot products and squared norms over that half are partial; they are
summed over the ``2d`` ranks that together hold the two full vectors by a butterfly exchange inside
that group (a fixed summation order, so every rank gets the same bits, and no sub-communicators to
create, cache or free).  After ``log2(size)`` levels each rank owns one slice of the result;
distance-halving exchanges then give every rank the whole buffer.  Each final element is computed
by exactly one rank and copied, so the result is bitwise identical everywhere.

The buffer travels in its own dtype (as raw bytes: MPI has no float16/bfloat16); dot products,
norms and the combination are computed in float64, and each level's result is rounded back to the
buffer's dtype, as a tree of pairwise Adasums on tensors of that dtype would be.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hvdlite.common.data_paths.helpers import copy_out_pieces, flat, pack, phase, postscale_factor
from hvdlite.common.dtypes import dtype_info, scale_in_place
from hvdlite.common.engine.data_path import Batch, DataPath
from hvdlite.common.engine.fusion import FusionBuffer
from hvdlite.common.engine.messages import ALLREDUCE
from hvdlite.common.errors import UnsupportedOperationError
from hvdlite.common.reduce_ops import ReduceOp

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_TAG = 0x4144  # point-to-point tag for every message the kernel sends ("AD")


def check_adasum_size(size: int, what: str) -> None:
    """Raise UnsupportedOperationError (a ValueError and, as in Horovod, a NotImplementedError)
    unless ``size`` (a number of ranks) is a power of two; 1 is allowed."""
    if size < 1 or size & (size - 1):
        raise UnsupportedOperationError(
            f"{what}: op=Adasum needs a power-of-two number of ranks (1, 2, 4, 8, ...), but this "
            f"job has {size}. Run on a power-of-two number of ranks or use op=Average.")


def _check_args(buf: np.ndarray, segments: Sequence[int]) -> np.ndarray:
    """Validate locally (before any message, so a bad call fails on every rank instead of hanging);
    return the segment offsets (``len(segments) + 1`` of them)."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"Adasum needs a numpy array buffer; got {type(buf).__name__}")
    if buf.dtype.name not in _FLOAT_DTYPES:
        raise TypeError(f"Adasum supports floating-point tensors only "
                        f"({', '.join(_FLOAT_DTYPES)}); "
                        f"got {buf.dtype.name}. Use op=Average or op=Sum for this tensor.")
    if buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ValueError("Adasum needs a writeable 1-D contiguous buffer; "
                         f"got shape {buf.shape}, contiguous={buf.flags.c_contiguous}, "
                         f"writeable={buf.flags.writeable}")
    sizes = np.asarray(segments, dtype=np.int64).reshape(-1)
    if (sizes < 0).any() or int(sizes.sum()) != buf.size:
        raise ValueError(f"Adasum segments must be non-negative and sum to the buffer size "
                         f"{buf.size}; got {list(segments)}")
    return np.concatenate(([0], np.cumsum(sizes)))


def adasum_allreduce_(comm, buf: np.ndarray, segments: Sequence[int]) -> None:
    """In-place Adasum of the 1-D contiguous ``buf`` across all ranks of ``comm``.

    ``buf`` is the concatenation of tensors whose element counts are ``segments``; each tensor is
    reduced with its own dot products and norms, exactly as if it were reduced alone.  Every rank
    must pass the same dtype and segments.  The result is bitwise identical on every rank.
    """
    offsets = _check_args(buf, segments)
    size, rank = comm.Get_size(), comm.Get_rank()
    check_adasum_size(size, "Adasum allreduce")
    if size == 1 or buf.size == 0:
        return
    # imported lazily, like the rest of the core: importing this module needs no MPI
    from mpi4py import MPI

    def raw(x: np.ndarray) -> list:
        return [x.view(np.uint8), MPI.BYTE]

    # Forward: vector halving, distance doubling.
    lo, hi = 0, buf.size
    levels = []  # (d, kept range, sent range) for the way back
    d = 1
    while d < size:
        partner, upper = rank ^ d, bool(rank & d)
        mid = lo + (hi - lo) // 2
        keep, send = ((mid, hi), (lo, mid)) if upper else ((lo, mid), (mid, hi))
        theirs = np.empty(keep[1] - keep[0], dtype=buf.dtype)
        comm.Sendrecv(raw(buf[send[0]:send[1]]), partner, _TAG, raw(theirs), partner, _TAG)
        mine = buf[keep[0]:keep[1]]
        a, b = (theirs, mine) if upper else (mine, theirs)
        _combine(comm, rank, d, a, b, mine, keep, offsets)
        levels.append((d, keep, send))
        lo, hi = keep
        d *= 2

    # Backward: distance halving; each rank sends the slice it owns and receives its partner's.
    for d, keep, send in reversed(levels):
        comm.Sendrecv(raw(buf[keep[0]:keep[1]]), rank ^ d, _TAG,
                      raw(buf[send[0]:send[1]]), rank ^ d, _TAG)


def _combine(comm, rank: int, d: int, a: np.ndarray, b: np.ndarray, out: np.ndarray,
             keep: tuple[int, int], offsets: np.ndarray) -> None:
    """Write ``adasum(a, b)`` over the kept range ``keep`` into ``out`` (a view of the buffer),
    using dot products and norms summed over the ``2d`` ranks of this level's group."""
    nseg = len(offsets) - 1
    # Segments overlapping the kept range, clipped to it (zero-length overlaps dropped, which
    # keeps the reduceat start indices strictly increasing and inside the range).
    starts = np.maximum(offsets[:-1], keep[0])
    ends = np.minimum(offsets[1:], keep[1])
    hit = np.nonzero(ends > starts)[0]
    stats = np.zeros((nseg, 3))
    a64 = np.asarray(a, dtype=np.float64)   # no copy for float64 buffers
    b64 = np.asarray(b, dtype=np.float64)
    if hit.size == 1:
        stats[hit[0]] = np.dot(a64, b64), np.dot(a64, a64), np.dot(b64, b64)
    elif hit.size > 1:
        local = starts[hit] - keep[0]
        stats[hit, 0] = np.add.reduceat(a64 * b64, local)
        stats[hit, 1] = np.add.reduceat(a64 * a64, local)
        stats[hit, 2] = np.add.reduceat(b64 * b64, local)
    stats = _group_sum(comm, rank, d, stats)
    dot, anorm2, bnorm2 = stats[:, 0], stats[:, 1], stats[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        ca = np.where(anorm2 == 0, 1.0, 1.0 - dot / (2 * anorm2))
        cb = np.where(bnorm2 == 0, 1.0, 1.0 - dot / (2 * bnorm2))
    if hit.size == 1:   # common case: the whole kept half lies in one tensor
        out[...] = ca[hit[0]] * a64 + cb[hit[0]] * b64
    elif hit.size > 1:
        lengths = ends[hit] - starts[hit]
        out[...] = np.repeat(ca[hit], lengths) * a64 + np.repeat(cb[hit], lengths) * b64


def _group_sum(comm, rank: int, d: int, stats: np.ndarray) -> np.ndarray:
    """Sum ``stats`` over the ``2d`` ranks sharing ``rank // (2d)`` by a butterfly exchange.

    Both partners of every step add the same two values (and IEEE addition is commutative), so
    after the last step every rank of the group holds the same bits."""
    from mpi4py import MPI
    e = 1
    while e <= d:
        other = np.empty_like(stats)
        comm.Sendrecv([stats, MPI.DOUBLE], rank ^ e, _TAG, [other, MPI.DOUBLE], rank ^ e, _TAG)
        stats = stats + other
        e *= 2
    return stats


class AdasumPath(DataPath):
    """Host allreduces with ``op=Adasum`` (at two ranks or more; one rank's Adasum is its input,
    which the MPI path copies): one tensor in place, or a fused batch whose tensors keep their
    own dot products and norms (segments)."""

    name = "adasum"

    def __init__(self, context) -> None:
        super().__init__(context)
        self._fusion = FusionBuffer()

    def enabled(self, batch: Batch) -> bool:
        response = batch[0][0]
        return (response.device < 0 and response.reduce_op == ReduceOp.Adasum
                and response.kind == ALLREDUCE and self.size > 1)

    def execute(self, batch: Batch) -> None:
        response, entry = batch[0]
        phase(batch, "ADASUM_ALLREDUCE")
        if len(batch) == 1:
            out = entry.output.reshape(-1)
            if entry.output is not entry.array:
                np.copyto(out, entry.array.reshape(-1))
            if not entry.stand_in:   # a joined rank's identity stays neutral
                scale_in_place(out, response.prescale)
            adasum_allreduce_(self.comm, out, [out.size])
            scale_in_place(out, postscale_factor(response, self.size))
            return
        sizes = [e.array.size for _, e in batch]
        count = sum(sizes)
        info = dtype_info(response.dtype)
        buf = self._fusion.view(count * info.itemsize, info.np_dtype)
        pack(batch, buf, sizes, response.prescale)
        adasum_allreduce_(self.comm, buf, sizes)
        phase(batch, "MEMCPY_OUT_FUSION_BUFFER")
        copy_out_pieces([flat(e.output) for _, e in batch], sizes, [(0, count, buf)],
                        postscale_factor(response, self.size))
