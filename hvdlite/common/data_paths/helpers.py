"""What the data paths share: packing a batch into a flat buffer and scattering a result back,
the scaling rules of a reduction, timeline phases, and how to wait on a non-blocking MPI call.

Every path's own module holds only that path (:mod:`.mpi` is the MPI path, nothing more); what
two or more of them need lives here, so no path imports another for its helpers.
"""
from __future__ import annotations

import math

import numpy as np

from hvdlite.common.dtypes import dtype_info, scale_in_place, scale_into
from hvdlite.common.engine.data_path import Batch
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import Response
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime import timeline as _timeline

# MPI allreduces up to this size are started non-blocking and waited for politely (yield, then
# sleep): a blocking call busy-polls while the peer's background thread waits for a core, which
# with one core per rank steals the training thread's time (measured: a 40-byte gradient took
# 7 ms inside backward).  Larger ones wait inside MPI (a blocking call, or MPI_Wait), since MPI
# progresses a non-blocking transfer only inside Test calls and would stall while this thread
# sleeps.
POLITE_MAX_BYTES = 1 << 20


def wait_inside_mpi(request) -> None:
    """Wait for a large non-blocking collective inside MPI (``MPI_Wait`` progresses it as a
    blocking call would).  MPICH 5.0.2 runs some collectives far faster started non-blocking
    than blocking: ``MPI_Allgatherv`` of 16 MiB at 4 ranks took 794 ms blocking against 17 ms
    as ``MPI_Iallgatherv`` + wait on one host, 1351 against 34 ms across two hosts (TCP), and
    across hosts a 16 MiB ``MPI_Allreduce`` 157 against 82 ms (on one host they are alike)."""
    request.Wait()


def postscale_factor(response: Response, size: int) -> float:
    """What a reduction's result is multiplied by: the postscale factor, and 1/size for
    Average (every data path, so GPU and CPU results follow the same rules)."""
    factor = response.postscale
    if response.reduce_op == ReduceOp.Average:
        factor *= 1.0 / size
    return factor



def allreduce_alone(response: Response, entry: Entry, size: int) -> None:
    """A reduction at one rank: the result is the input, copied (out of place) and scaled."""
    if entry.output is not entry.array:
        np.copyto(entry.output.reshape(-1), entry.array.reshape(-1))
    out = entry.output.reshape(-1)
    if dtype_info(response.dtype).is_bool:
        return
    scale_in_place(out, response.prescale)
    scale_in_place(out, postscale_factor(response, size))


def pack(batch: Batch, buf: np.ndarray, sizes: list[int], prescale: float) -> None:
    """Pack the batch's inputs back to back into ``buf`` and apply the prescale factor (not to a
    joined rank's stand-in identities, which must stay neutral)."""
    phase(batch, "MEMCPY_IN_FUSION_BUFFER")
    # One C-level pass packs every input (axis=None: each one flattened, without a view).
    np.concatenate([e.array for _, e in batch], axis=None, out=buf)
    if prescale != 1.0 and any(e.stand_in for _, e in batch):
        offset = 0
        for (_, entry), n in zip(batch, sizes):
            if not entry.stand_in:
                scale_in_place(buf[offset:offset + n], prescale)
            offset += n
    else:
        scale_in_place(buf, prescale)


def flat(array: np.ndarray) -> np.ndarray:
    """A contiguous array as 1-D (itself if it already is: no new view per tensor)."""
    return array if array.ndim == 1 else array.reshape(-1)


def phase(batch, activity: str) -> None:
    """Mark the batch's tensors ((response, entry) pairs) as being in ``activity`` on the
    timeline, if one is recording (the names are only collected then)."""
    tl = _timeline.ACTIVE
    if tl is not None:
        tl.activity([response.name for response, _ in batch], activity)


def copy_out_pieces(outputs: list[np.ndarray], sizes: list[int],
                     pieces: list[tuple[int, int, np.ndarray]], factor: float) -> None:
    """Scatter a result held as consecutive pieces ``(start, stop, elements)`` into the flat
    outputs (``sizes[i]`` elements each, back to back), multiplying by ``factor``."""
    if factor == 1.0:
        copy = np.copyto   # the common case (Sum, or Average's 1/size applied as prescale)
    else:
        def copy(out, src):
            scale_into(out, src, factor)
    chunks = iter(pieces)
    start, stop, src = next(chunks)
    offset = 0
    for out, n in zip(outputs, sizes):
        end = offset + n
        if end <= stop:   # the whole output lies in the current piece (nearly always)
            copy(out, src[offset - start:end - start])
            offset = end
            continue
        pos = offset
        while pos < end:
            while pos >= stop:
                start, stop, src = next(chunks)
            cut = min(end, stop)
            copy(out[pos - offset:cut - offset], src[pos - start:cut - start])
            pos = cut
        offset = end


def row_layout(shape: tuple) -> tuple[tuple, int]:
    """Shape of one row (everything after dimension 0) and its number of elements."""
    row_shape = tuple(shape[1:])
    return row_shape, math.prod(row_shape)


def displacements(counts: list[int]) -> list[int]:
    """Where each of ``counts`` consecutive blocks starts (MPI's ``displs``)."""
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return out
