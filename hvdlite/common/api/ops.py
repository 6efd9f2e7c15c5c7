"""Collective operations on numpy arrays: the framework-neutral public API.

This is what a plain numpy program (or a framework without an adapter) uses; the framework
adapters build on :mod:`hvdlite.common.api.submission`, handing it zero-copy numpy views of
their tensors. Semantics follow Horovod: every rank must call the same operations with the same
names (or in the same order when unnamed); results are identical on every rank.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from hvdlite.common.api.announce import (announce_failure, announced, announcing,
                                         announcing_with)
from hvdlite.common.api.submission import (PreparedAllreduce, check_writable, contiguous,
                                           contiguous_in_place, fast_host_allreduce,
                                           make_entry, prepare_allreduce, submit)
from hvdlite.common.engine.handle import GroupHandle, Handle
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST,
                                            JOIN, REDUCESCATTER)
from hvdlite.common.errors import HvdliteError
from hvdlite.common.reduce_ops import ReduceOp, resolve_op
from hvdlite.common.runtime.process_sets import ProcessSet

__all__ = [
    # re-exported for the adapters and the door (hvdlite.common.core)
    "PreparedAllreduce", "announce_failure", "announced", "announcing", "announcing_with",
    "fast_host_allreduce", "make_entry", "prepare_allreduce", "submit",
    # the public operations
    "allreduce_async", "allreduce_async_", "allreduce", "allreduce_", "allgather_async",
    "allgather", "broadcast_async", "broadcast_async_", "broadcast", "broadcast_",
    "alltoall_async", "alltoall", "reducescatter_async", "reducescatter", "barrier", "on_join",
    "join", "poll", "synchronize",
]


# --- allreduce -------------------------------------------------------------------------------
def allreduce_async(array, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start an allreduce of ``array`` into a new array; return a handle.

    ``op``: Average (default), Sum, Min, Max, Product or Adasum (float tensors, power-of-two
    number of ranks).  ``prescale_factor`` multiplies the input before the reduction and
    ``postscale_factor`` the result after it (Average divides by the number of ranks on top).
    Integer results are scaled in float64 and truncated toward zero.  ``process_set`` limits
    the operation to a registered subset of ranks (default: all).
    """
    try:   # announce a failure as @announcing would, without its wrapper on every call
        reduce_op = resolve_op(op, average)
        handle = fast_host_allreduce(array, None, name, reduce_op, prescale_factor,
                                     postscale_factor, process_set)
        if handle is not None:
            return handle
        return submit(ALLREDUCE, contiguous(array), name=name, reduce_op=reduce_op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      process_set=process_set)
    except Exception as exc:
        announce_failure(ALLREDUCE, name, process_set, exc)
        raise


def allreduce_async_(array: np.ndarray, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet | None = None) -> Handle:
    """In-place variant of :func:`allreduce_async`: the result overwrites ``array``."""
    try:   # announce a failure as @announcing would, without its wrapper on every call
        reduce_op = resolve_op(op, average)
        handle = fast_host_allreduce(array, array, name, reduce_op, prescale_factor,
                                     postscale_factor, process_set)
        if handle is not None:
            return handle
        flags = array.flags
        if flags.c_contiguous and flags.writeable:   # the common case, without extra layers
            return submit(ALLREDUCE, array, name=name, output=array, reduce_op=reduce_op,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          process_set=process_set)
        check_writable(array, "allreduce_")
        return contiguous_in_place(array, lambda a: submit(
            ALLREDUCE, a, name=name, output=a, reduce_op=reduce_op,
            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            process_set=process_set))
    except Exception as exc:
        announce_failure(ALLREDUCE, name, process_set, exc)
        raise


def allreduce(array, average: bool | None = None, name: str | None = None,
              op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet | None = None) -> np.ndarray:
    """Reduce ``array`` across all ranks (default: average) and return the result."""
    return allreduce_async(array, average, name, op, prescale_factor, postscale_factor,
                           process_set).wait()


def allreduce_(array: np.ndarray, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: ProcessSet | None = None
               ) -> np.ndarray:
    """In-place allreduce; returns ``array``."""
    return allreduce_async_(array, average, name, op, prescale_factor, postscale_factor,
                            process_set).wait()


# --- allgather -------------------------------------------------------------------------------
@announcing(ALLGATHER)
def allgather_async(array, name: str | None = None,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start gathering every rank's ``array`` along the first dimension (which may differ per
    rank; the other dimensions must match).  A scalar counts as one row."""
    return submit(ALLGATHER, contiguous(array), name=name, process_set=process_set)


def allgather(array, name: str | None = None,
              process_set: ProcessSet | None = None) -> np.ndarray:
    """Concatenation of every rank's ``array`` along dimension 0, in rank order."""
    return allgather_async(array, name, process_set).wait()


# --- broadcast -------------------------------------------------------------------------------
@announcing(BROADCAST)
def broadcast_async(array, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start broadcasting ``root_rank``'s ``array`` into a new array on every rank.
    ``root_rank`` is a global rank (a member of ``process_set``)."""
    return submit(BROADCAST, contiguous(array), name=name, root_rank=root_rank,
                  process_set=process_set)


@announcing(BROADCAST)
def broadcast_async_(array: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Handle:
    """In-place broadcast: ``array`` is overwritten with the root's values on other ranks."""
    check_writable(array, "broadcast_")
    return contiguous_in_place(array, lambda a: submit(
        BROADCAST, a, name=name, output=a, root_rank=root_rank, process_set=process_set))


def broadcast(array, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> np.ndarray:
    """Return ``root_rank``'s ``array`` on every rank."""
    return broadcast_async(array, root_rank, name, process_set).wait()


def broadcast_(array: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None) -> np.ndarray:
    """In-place broadcast; returns ``array``."""
    return broadcast_async_(array, root_rank, name, process_set).wait()


# --- alltoall --------------------------------------------------------------------------------
@announcing(ALLTOALL)
def alltoall_async(array, splits=None, name: str | None = None,
                   process_set: ProcessSet | None = None) -> Handle:
    """Start an alltoall: rows ``splits[j]`` of ``array`` (along dimension 0, in order) go to
    rank j.  Without ``splits`` the rows are divided evenly (the first dimension must then be
    divisible by the number of ranks).  The handle yields ``(received, received_splits)``:
    the rows received from every rank, in rank order, and how many came from each."""
    return submit(ALLTOALL, contiguous(array), name=name, splits=splits,
                  process_set=process_set)


def alltoall(array, splits=None, name: str | None = None,
             process_set: ProcessSet | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Blocking :func:`alltoall_async`; returns ``(received, received_splits)``."""
    return alltoall_async(array, splits, name, process_set).wait()


# --- reducescatter ---------------------------------------------------------------------------
@announcing(REDUCESCATTER)
def reducescatter_async(array, name: str | None = None, op: ReduceOp | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet | None = None) -> Handle:
    """Start a reducescatter: ``array`` (same shape on every rank) is reduced across ranks
    (Average by default, or Sum/Min/Max/Product) and rank r receives its share of the rows.
    Rows are divided as evenly as possible: with R rows and N ranks, the first R % N ranks get
    R // N + 1 rows and the others R // N (Horovod's rule)."""
    return submit(REDUCESCATTER, contiguous(array), name=name, reduce_op=resolve_op(op),
                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                  process_set=process_set)


def reducescatter(array, name: str | None = None, op: ReduceOp | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet | None = None) -> np.ndarray:
    """This rank's rows of the reduced ``array``; see :func:`reducescatter_async`."""
    return reducescatter_async(array, name, op, prescale_factor, postscale_factor,
                               process_set).wait()


# --- barrier, join and handles ---------------------------------------------------------------
def barrier(process_set: ProcessSet | None = None) -> None:
    """Block until every rank (of ``process_set``) has called barrier()."""
    submit(BARRIER, None, name="barrier", process_set=process_set).wait()


# Called with the process set (None: global) each time join() has returned on this rank.
_join_listeners: list[Callable[[ProcessSet | None], None]] = []


def on_join(listener: Callable[[ProcessSet | None], None]) -> None:
    """Have ``listener(process_set)`` called after every successful :func:`join` on this rank
    (for adapters whose objects keep state agreed while a rank was joined).  It runs at the same
    point of the program on every rank of the set, so it must not start collectives of its own
    unless every rank's listeners start the same ones."""
    _join_listeners.append(listener)


def join(process_set: ProcessSet | None = None) -> int:
    """Declare that this rank has run out of data; block until every rank has joined.

    Until then this rank takes part in the other ranks' allreduces with the reduction's
    identity (zeros for Sum and Average, so Average still divides by the full number of
    ranks, as in Horovod).  Other operations (allgather, broadcast, alltoall, reducescatter,
    Adasum) cannot run while a rank is joined and fail with an error saying so.  Returns the
    global rank of the last rank to join.  A rank that joined early missed the other ranks'
    later updates: broadcast the model from the returned rank before training on.
    """
    last = submit(JOIN, None, name="join", process_set=process_set).wait()
    for listener in list(_join_listeners):
        listener(process_set)
    return last


def poll(handle: Handle) -> bool:
    """True if the asynchronous operation behind ``handle`` has finished."""
    return handle.poll()


def synchronize(handle: Handle):
    """Wait for ``handle`` and return its result (raises the operation's error, if any)."""
    if not isinstance(handle, (Handle, GroupHandle)):
        raise HvdliteError(f"synchronize() expects a handle returned by an *_async call, "
                           f"got {type(handle).__name__}.")
    return handle.wait()
