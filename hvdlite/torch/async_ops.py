"""Collectives on torch tensors that return a handle at once (``*_async``), and how a tensor is
handed to the core: contiguous tensors as zero-copy numpy views, non-contiguous ones through a
contiguous buffer (copied back when the handle of an in-place op is waited on), outputs whose
shape is known only after negotiation allocated then.

These are the submissions under everything else: the blocking ops and their gradients
(:mod:`.autograd`, :mod:`.mpi_ops`), sparse reductions and DistributedOptimizer's gradients.
The public names are re-exported by :mod:`hvdlite.torch.mpi_ops` and :mod:`hvdlite.torch`.
"""
from __future__ import annotations

import torch

from hvdlite.common import core
from hvdlite.common.core import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER,
                                 GroupHandle, Handle, ProcessSet, ReduceOp, global_process_set,
                                 resolve_op)

from .tensor_bridge import as_core_array, check_tensor, empty_core_backed, plain_cpu


def _submit(kind: str, tensor: torch.Tensor, output: torch.Tensor | None, what: str,
            **kwargs) -> Handle:
    """Submit ``tensor`` -> ``output`` (same object = in place); the handle yields ``output``."""
    check_tensor(tensor, what)
    in_place = output is tensor
    src = tensor if tensor.is_contiguous() else tensor.contiguous()
    if in_place:
        dst = src
    elif output is None or output.is_contiguous():
        dst = output
    else:
        dst = torch.empty_like(output, memory_format=torch.contiguous_format)
    array, dtype = as_core_array(src)
    out_array = array if in_place else (None if dst is None else as_core_array(dst)[0])
    handle = core.submit(kind, array, output=out_array, dtype=dtype, **kwargs)
    if in_place and src is not tensor:
        return handle.then(lambda _: tensor.copy_(src))
    if output is not None and dst is not output:
        return handle.then(lambda _: output.copy_(dst))
    return handle.then(lambda _: output if output is not None else dst)


# --- allreduce -------------------------------------------------------------------------------
def _fast_allreduce(tensor, in_place: bool, name, reduce_op: ReduceOp, prescale_factor,
                    postscale_factor, process_set) -> Handle | None:
    """The per-gradient hot path: a plain, contiguous CPU tensor that needs no autograd goes
    straight to the core's fast submission (see ``submission.fast_host_allreduce``), without the
    general path's layers; ``None`` if anything is unusual (the caller takes the general path,
    which also raises the errors).  Out of place, the core allocates the result and the tensor
    returned wraps it without a copy."""
    if (process_set is not global_process_set and process_set is not None
            or not plain_cpu(tensor)):
        return None
    array = tensor.numpy()
    handle = core.fast_host_allreduce(array, array if in_place else None, name, reduce_op,
                                      prescale_factor, postscale_factor, None)
    if handle is None:
        return None
    return handle.then((lambda _: tensor) if in_place else torch.from_numpy)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start averaging (or summing, ...) ``tensor`` across ranks into a new tensor.

    Returns a handle for :func:`poll` / :func:`synchronize`.  ``op`` is Average (default), Sum,
    Min, Max or Product; ``prescale_factor`` multiplies the input before the reduction and
    ``postscale_factor`` the result after it.  ``name`` must be unique among pending ops and the
    same on every rank (unnamed ops must be issued in the same order on every rank).
    """
    try:   # announce a failure as @announcing would, without its wrapper on every call
        reduce_op = resolve_op(op, average)
        handle = _fast_allreduce(tensor, False, name, reduce_op, prescale_factor, postscale_factor,
                                 process_set)
        if handle is not None:
            return handle
        what = f"allreduce of {name or 'unnamed tensor'}"
        check_tensor(tensor, what)   # before allocating: empty_like fails on e.g. sparse tensors
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return _submit(ALLREDUCE, tensor, output, what,
                       name=name, reduce_op=reduce_op,
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                       process_set=process_set)
    except Exception as exc:
        core.announce_failure(ALLREDUCE, name, process_set, exc)
        raise


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: ``tensor`` is overwritten with the result."""
    try:   # announce a failure as @announcing would, without its wrapper on every call
        reduce_op = resolve_op(op, average)
        handle = _fast_allreduce(tensor, True, name, reduce_op, prescale_factor, postscale_factor,
                                 process_set)
        if handle is not None:
            return handle
        return _submit(ALLREDUCE, tensor, tensor, f"allreduce_ of {name or 'unnamed tensor'}",
                       name=name, reduce_op=reduce_op,
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                       process_set=process_set)
    except Exception as exc:
        core.announce_failure(ALLREDUCE, name, process_set, exc)
        raise


# --- allgather -------------------------------------------------------------------------------
@core.announcing(ALLGATHER)
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (which may differ in size
    between ranks; the other dimensions must match)."""
    what = f"allgather of {name or 'unnamed tensor'}"
    check_tensor(tensor, what)
    src, array, dtype, allocate, holder = _shape_later(tensor)
    handle = core.submit(ALLGATHER, array, name=name, allocate=allocate, dtype=dtype,
                         process_set=process_set)
    return handle.then(lambda _: (src, holder[0])[1])


def _shape_later(tensor: torch.Tensor):
    """Contiguous source, its numpy view and core dtype, plus an allocator (and the list that
    receives the torch tensor it creates) for outputs shaped only after negotiation."""
    holder: list[torch.Tensor] = []

    def allocate(shape, np_dtype):
        out, array = empty_core_backed(shape, tensor)
        holder.append(out)
        if out.is_cuda:
            return array   # device outputs keep the device view's dtype (bfloat16 as 16 bits)
        return array.view(np_dtype) if array.dtype != np_dtype else array

    src = tensor.contiguous()
    array, dtype = as_core_array(src)
    return src, array, dtype, allocate, holder


# --- broadcast -------------------------------------------------------------------------------
@core.announcing(BROADCAST)
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start broadcasting ``root_rank``'s ``tensor`` into a new tensor on every rank."""
    what = f"broadcast of {name or 'unnamed tensor'}"
    check_tensor(tensor, what)   # before allocating: empty_like fails on e.g. sparse tensors
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit(BROADCAST, tensor, output, what,
                   name=name, root_rank=root_rank, process_set=process_set)


@core.announcing(BROADCAST)
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place broadcast: non-root ranks' ``tensor`` is overwritten with the root's."""
    return _submit(BROADCAST, tensor, tensor, f"broadcast_ of {name or 'unnamed tensor'}",
                   name=name, root_rank=root_rank, process_set=process_set)


# --- alltoall --------------------------------------------------------------------------------
@core.announcing(ALLTOALL)
def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall: rows ``splits[j]`` of ``tensor`` (dimension 0, in order) go to rank
    j of the process set; without ``splits`` the rows are divided evenly.  ``synchronize``
    returns ``(output, received_splits)``: the rows received from every rank, in rank order,
    and an int32 tensor of how many came from each."""
    what = f"alltoall of {name or 'unnamed tensor'}"
    check_tensor(tensor, what)
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    src, array, dtype, allocate, holder = _shape_later(tensor)
    handle = core.submit(ALLTOALL, array, name=name, allocate=allocate, dtype=dtype,
                         splits=splits, process_set=process_set)
    return handle.then(lambda result: (src, holder[0], torch.from_numpy(result[1]))[1:])


# --- reducescatter ---------------------------------------------------------------------------
@core.announcing(REDUCESCATTER)
def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | None = ReduceOp.Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter: ``tensor`` (same shape on every rank) is reduced across the
    process set (Average by default, or Sum/Min/Max/Product) and each rank receives its share
    of the rows: with R rows and N ranks the first R % N ranks get R // N + 1 rows, the others
    R // N.  (Arguments in Horovod's order.)"""
    what = f"reducescatter of {name or 'unnamed tensor'}"
    check_tensor(tensor, what)
    src, array, dtype, allocate, holder = _shape_later(tensor)
    handle = core.submit(REDUCESCATTER, array, name=name, allocate=allocate, dtype=dtype,
                         reduce_op=resolve_op(op), prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=process_set)
    return handle.then(lambda _: (src, holder[0])[1])


# --- grouped ops -----------------------------------------------------------------------------
def _group_views(tensors, what: str, in_place: bool = False):
    """(contiguous sources, core views, core dtype names) of the members (see
    :func:`as_core_array`); the dtype names are None, not a list, when every member is a plain
    contiguous CPU tensor, viewed as it is."""
    arrays = []
    for t in tensors:   # the usual case: plain, contiguous CPU tensors, viewed as they are
        if not plain_cpu(t):
            break
        arrays.append(t.numpy())
    else:
        return tensors, arrays, None
    srcs, arrays, dtypes = [], [], []
    for t in tensors:
        check_tensor(t, what)
        if in_place and not t.is_contiguous():
            raise ValueError(f"{what}: in-place grouped ops need contiguous tensors.")
        src = t.contiguous()
        array, dtype = as_core_array(src)
        srcs.append(src)
        arrays.append(array)
        dtypes.append(dtype)
    return srcs, arrays, dtypes


@core.announcing_group(ALLREDUCE, "tensors")
def grouped_allreduce_async(tensors, average: bool | None = None, name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start allreducing a list of tensors as one unit (negotiated together, fused where
    possible); ``synchronize`` returns the list of reduced tensors."""
    srcs, arrays, dtypes = _group_views(list(tensors),
                                        f"grouped_allreduce {name or ''}".strip())
    reduce_op = resolve_op(op, average)
    if dtypes is None:   # plain CPU tensors: the core allocates the results, wrapped uncopied
        handle = core.submit_group(
            ALLREDUCE, arrays, name=name, reduce_op=reduce_op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, process_set=process_set)
        return handle.then(lambda results: [torch.from_numpy(r) for r in results])
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in srcs]
    handle = core.submit_group(
        ALLREDUCE, arrays, name=name, outputs=[as_core_array(o)[0] for o in outs], dtypes=dtypes,
        reduce_op=reduce_op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, process_set=process_set)
    return handle.then(lambda _: (srcs, outs)[1])


@core.announcing_group(ALLREDUCE, "tensors")
def grouped_allreduce_async_(tensors, average: bool | None = None, name: str | None = None,
                             op: ReduceOp | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupHandle:
    """In-place :func:`grouped_allreduce_async` (contiguous tensors)."""
    tensors = list(tensors)
    _, arrays, dtypes = _group_views(tensors, f"grouped_allreduce_ {name or ''}".strip(),
                                     in_place=True)
    handle = core.submit_group(
        ALLREDUCE, arrays, name=name, outputs=arrays, dtypes=dtypes,
        reduce_op=resolve_op(op, average), prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, process_set=process_set)
    return handle.then(lambda _: tensors)


def _gather_views(tensors, what: str):
    """``_shape_later`` for every member (scalars travel as one row each, as in allgather)."""
    for t in tensors:
        check_tensor(t, what)
    return [_shape_later(t.reshape(1) if t.dim() == 0 else t) for t in tensors]


@core.announcing_group(ALLGATHER, "tensors")
def grouped_allgather_async(tensors, name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start allgathering a list of tensors as one unit."""
    parts = _gather_views(tensors, f"grouped_allgather {name or ''}".strip())
    handle = core.submit_group(
        ALLGATHER, [p[1] for p in parts], name=name, allocates=[p[3] for p in parts],
        dtypes=[p[2] for p in parts], process_set=process_set)
    return handle.then(lambda _: [p[4][0] for p in parts])


@core.announcing_group(REDUCESCATTER, "tensors")
def grouped_reducescatter_async(tensors, name: str | None = None,
                                op: ReduceOp | None = ReduceOp.Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> GroupHandle:
    """Start reducescattering a list of tensors as one unit (arguments in Horovod's order)."""
    for t in tensors:
        check_tensor(t, f"grouped_reducescatter {name or ''}".strip())
    parts = [_shape_later(t) for t in tensors]
    handle = core.submit_group(
        REDUCESCATTER, [p[1] for p in parts], name=name, allocates=[p[3] for p in parts],
        dtypes=[p[2] for p in parts], reduce_op=resolve_op(op),
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set)
    return handle.then(lambda _: [p[4][0] for p in parts])


# --- handles ---------------------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """True if the asynchronous operation behind ``handle`` has completed."""
    if not isinstance(handle, (Handle, GroupHandle)):   # (Horovod: a TypeError, too)
        raise TypeError(f"poll() expects a handle returned by an *_async call, got "
                        f"{type(handle).__name__}.")
    return handle.poll()


def synchronize(handle: Handle):
    """Wait for ``handle``; return its output tensor (raises the operation's error)."""
    return core.synchronize(handle)


__all__ = ["allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async",
           "broadcast_async_", "alltoall_async", "reducescatter_async",
           "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_allgather_async",
           "grouped_reducescatter_async", "poll", "synchronize"]
