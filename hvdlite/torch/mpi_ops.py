"""Horovod-compatible collective ops on torch tensors (``horovod.torch.mpi_ops``).

``allreduce``/``allgather``/``broadcast``/``alltoall``/``reducescatter`` and their grouped forms
are differentiable, with Horovod's gradients (see :mod:`.autograd`: they are not always the
gradient of the sum of every rank's loss: allgather's and broadcast's are averaged over the
ranks, reducescatter's is scaled up by the set's size).  The ``*_async`` forms, ``poll`` and
``synchronize`` live in :mod:`.async_ops` (how a tensor is handed to the core) and are
re-exported here under Horovod's module name.  Every op takes ``process_set`` (default: all
ranks).
"""
from __future__ import annotations

import torch

from hvdlite.common import core
from hvdlite.common.core import (ALLREDUCE, REDUCESCATTER, GroupHandle, Handle,  # noqa: F401
                                 ProcessSet, ReduceOp, global_process_set, rank, resolve_op,
                                 size)

from .async_ops import (allgather_async, allreduce_async, allreduce_async_, alltoall_async,
                        broadcast_async, broadcast_async_, grouped_allgather_async,
                        grouped_allreduce_async, grouped_allreduce_async_,
                        grouped_reducescatter_async, poll, reducescatter_async, synchronize)
from .autograd import (differentiable_allgather, differentiable_allreduce,
                       differentiable_alltoall, differentiable_broadcast,
                       differentiable_grouped_allgather, differentiable_grouped_allreduce,
                       differentiable_grouped_reducescatter, differentiable_reducescatter)
from .compression import Compression


# --- allreduce -------------------------------------------------------------------------------
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``tensor`` reduced across all ranks (default: averaged).  Differentiable: the
    gradient of an Average/Sum allreduce is the same allreduce of the incoming gradient.
    ``compression`` (e.g. ``Compression.fp16``) shrinks the data on the wire."""
    try:   # as core.announced, without a context manager's cost on every call
        op = resolve_op(op, average)
        compressed, ctx = compression.compress(tensor)
    except Exception as exc:
        core.announce_failure(ALLREDUCE, name, process_set, exc)
        raise
    reduced = differentiable_allreduce(compressed, name, op, prescale_factor, postscale_factor,
                                       process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce (not differentiable); returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


# --- allgather, broadcast, alltoall ----------------------------------------------------------
def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenation of every rank's ``tensor`` along dimension 0, in rank order.
    Differentiable (as in Horovod): each rank gets its rows of the incoming gradients averaged
    over the set."""
    return differentiable_allgather(tensor, name, process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank.  Differentiable (as in Horovod): the root
    receives the average of all ranks' gradients, the others zeros."""
    return differentiable_broadcast(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Scatter slices of ``tensor`` to every rank and gather the slices sent to this rank.

    Returns the gathered tensor, or ``(tensor, received_splits)`` when ``splits`` is given
    (Horovod's convention).  Differentiable (as in Horovod): the gradient travels back the same
    way, an alltoall of the incoming gradient with the received splits.
    """
    output, received = differentiable_alltoall(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# --- reducescatter ---------------------------------------------------------------------------
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none,
                  op: ReduceOp | None = ReduceOp.Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's rows of ``tensor`` reduced across ranks (see :func:`reducescatter_async`);
    ``compression`` as for :func:`allreduce`.  Differentiable for Sum and Average, with
    Horovod's gradient: the allgather of the incoming gradients, times the set's size for Sum
    (and not divided by it for Average), times ``prescale_factor * postscale_factor``."""
    with core.announced(REDUCESCATTER, name, process_set):
        compressed, cctx = compression.compress(tensor)
        op = resolve_op(op)
    reduced = differentiable_reducescatter(compressed, name, op, prescale_factor,
                                           postscale_factor, process_set)
    return compression.decompress(reduced, cctx)


# --- grouped ops -----------------------------------------------------------------------------
def grouped_allreduce(tensors, average: bool | None = None, name: str | None = None,
                      compression=Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors as one unit (``compression`` applies to each); differentiable
    for Sum and Average, like :func:`allreduce`."""
    tensors = list(tensors)
    if not tensors:
        return []
    with core.announced_group(ALLREDUCE, name, process_set, len(tensors)):
        compressed, ctxs = _compress_all(compression, tensors)
        op = resolve_op(op, average)
    reduced = differentiable_grouped_allreduce(compressed, name, op, prescale_factor,
                                               postscale_factor, process_set)
    return [compression.decompress(t, c) for t, c in zip(reduced, ctxs)]


def _compress_all(compression, tensors: list) -> tuple[list, list]:
    pairs = [compression.compress(t) for t in tensors]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def grouped_allreduce_(tensors, average: bool | None = None, name: str | None = None,
                       op: ReduceOp | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns the tensors."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allgather(tensors, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather a list of tensors as one unit.  Differentiable, like :func:`allgather` (each
    member's gradient as allgather's)."""
    tensors = list(tensors)
    if not tensors:   # (still validates process_set)
        return synchronize(grouped_allgather_async(tensors, name, process_set))
    return differentiable_grouped_allgather(tensors, name, process_set)


def grouped_reducescatter(tensors, name: str | None = None, compression=Compression.none,
                          op: ReduceOp | None = ReduceOp.Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter a list of tensors as one unit (``compression`` applies to each).
    Differentiable for Sum and Average, like :func:`reducescatter`."""
    tensors = list(tensors)
    if not tensors:   # (still validates process_set)
        return synchronize(grouped_reducescatter_async(tensors, name, op, process_set))
    with core.announced_group(REDUCESCATTER, name, process_set, len(tensors)):
        compressed, ctxs = _compress_all(compression, tensors)
        op = resolve_op(op)
    reduced = differentiable_grouped_reducescatter(compressed, name, op, prescale_factor,
                                                   postscale_factor, process_set)
    return [compression.decompress(t, c) for t, c in zip(reduced, ctxs)]


# --- barrier, join ---------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of the process set) reaches the barrier."""
    core.barrier(process_set)


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """This rank has run out of data: keep serving the other ranks' allreduces (contributing
    zeros, so averages still divide by the full size) until every rank has joined.  Returns
    the rank that joined last: ranks that joined earlier missed the later steps, so broadcast
    the model and optimizer state from it before training on.  DistributedOptimizers of this
    process set then agree on their first-step state again in their next step, so a rank may
    join before its first step and train later.  ``device`` (as in Horovod) names the GPU this
    rank serves the others' CUDA allreduces from; by default the current CUDA device, if CUDA
    is in use."""
    if device < 0 and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
    if device >= 0:
        from hvdlite.common.core import cuda
        cuda.claim_device(device, "join")
    return core.join(process_set)


__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather",
           "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
           "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize",
           "barrier", "join", "size"]
