"""Horovod-compatible collective ops on torch CPU tensors.

Contiguous tensors are handed to the core as zero-copy numpy views; non-contiguous ones are
copied to a contiguous buffer (and, for in-place ops, copied back when the handle is waited on).
``allreduce``/``allgather``/``broadcast``/``alltoall``/``reducescatter`` and their grouped forms
are differentiable, with Horovod's gradients (see each autograd function; they are not always the
gradient of the sum of every rank's loss: allgather's and broadcast's are averaged over the ranks,
reducescatter's is scaled up by the set's size).  Every op takes ``process_set`` (default: all
ranks).
"""
from __future__ import annotations

import torch

from hvdlite.common import core
from hvdlite.common.core import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER,
                                 GroupHandle, Handle, ProcessSet, ReduceOp,
                                 UnsupportedOperationError, global_process_set, rank, resolve_op,
                                 size)

from .compression import Compression
from .tensor_bridge import NUMPY_DTYPES, as_core_array, check_tensor, empty_core_backed


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
    straight to the core's fast submission (see ``ops.fast_host_allreduce``), without the
    general path's layers; ``None`` if anything is unusual (the caller takes the general path,
    which also raises the errors).  Out of place, the core allocates the result and the tensor
    returned wraps it without a copy."""
    if (type(tensor) is not torch.Tensor
            or (process_set is not global_process_set and process_set is not None)
            or tensor.requires_grad or not tensor.is_cpu or tensor.dtype not in NUMPY_DTYPES
            or tensor.is_sparse or not tensor.is_contiguous()):
        return None
    array = tensor.numpy()
    handle = core.fast_host_allreduce(array, array if in_place else None, name, reduce_op,
                                      prescale_factor, postscale_factor, None)
    if handle is None:
        return None
    return handle.then((lambda _: tensor) if in_place else torch.from_numpy)


@core.announcing(ALLREDUCE)
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


@core.announcing(ALLREDUCE)
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: ``tensor`` is overwritten with the result."""
    reduce_op = resolve_op(op, average)
    handle = _fast_allreduce(tensor, True, name, reduce_op, prescale_factor, postscale_factor,
                             process_set)
    if handle is not None:
        return handle
    return _submit(ALLREDUCE, tensor, tensor, f"allreduce_ of {name or 'unnamed tensor'}",
                   name=name, reduce_op=reduce_op,
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                   process_set=process_set)


def _check_grad_op(op: ReduceOp, what: str) -> None:
    # Horovod's backward would reduce the gradient with the same op (a Max of gradients, say),
    # which is no gradient of anything: refused instead (a deliberate deviation).
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise UnsupportedOperationError(
            f"hvdlite: the gradient of {what} with op={op.name} is not defined; detach the "
            f"input or use Sum/Average.")


def _set_of(process_set: ProcessSet | None) -> ProcessSet:
    return global_process_set if process_set is None else process_set


def _allreduce_now(tensor, name, op, prescale_factor, postscale_factor, process_set):
    """The reduction itself, without autograd: submit and wait."""
    return synchronize(allreduce_async(tensor, name=name, op=op,
                                       prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor,
                                       process_set=process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return _allreduce_now(tensor, name, op, prescale_factor, postscale_factor, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        _check_grad_op(ctx.op, "allreduce")
        grad = allreduce(grad_output, op=ctx.op, prescale_factor=ctx.scales[0],
                         postscale_factor=ctx.scales[1], process_set=ctx.process_set)
        return grad, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``tensor`` reduced across all ranks (default: averaged).  Differentiable: the
    gradient of an Average/Sum allreduce is the same allreduce of the incoming gradient.
    ``compression`` (e.g. ``Compression.fp16``) shrinks the data on the wire."""
    with core.announced(ALLREDUCE, name, process_set):
        op = resolve_op(op, average)
        compressed, ctx = compression.compress(tensor)
    # Nothing to differentiate (metrics, say): skip autograd's ~10 us per call.  A non-tensor
    # takes the autograd path too, whose checks raise the TypeError for it.
    through_autograd = not isinstance(compressed, torch.Tensor) or (
        compressed.requires_grad and torch.is_grad_enabled())
    reduce = _Allreduce.apply if through_autograd else _allreduce_now
    reduced = reduce(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce (not differentiable); returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


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


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        # Horovod's gradient: the incoming gradients averaged over the set, then this rank's
        # rows of it (the other ranks' row counts come with one small allgather).
        grad = allreduce(grad_output, op=ReduceOp.Average, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64),
                         process_set=ctx.process_set)
        offset = int(rows[:_set_of(ctx.process_set).rank()].sum())
        return grad.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenation of every rank's ``tensor`` along dimension 0, in rank order.
    Differentiable (as in Horovod): each rank gets its rows of the incoming gradients averaged
    over the set."""
    out = _Allgather.apply(tensor, name, process_set)
    return out.reshape(-1) if tensor.dim() == 0 else out


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


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        # Horovod's gradient: the incoming gradients averaged over the set for the root, zeros
        # elsewhere.  root_rank is a global rank, also with a process set (as in Horovod).
        grad = allreduce(grad_output, op=ReduceOp.Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank.  Differentiable (as in Horovod): the root
    receives the average of all ranks' gradients, the others zeros."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


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


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _grad_received):
        # Send every received row's gradient back where the row came from (Horovod's: an
        # alltoall of the gradient with the received splits; itself differentiable).
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received,
                           process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Scatter slices of ``tensor`` to every rank and gather the slices sent to this rank.

    Returns the gathered tensor, or ``(tensor, received_splits)`` when ``splits`` is given
    (Horovod's convention).  Differentiable (as in Horovod): the gradient travels back the same
    way, an alltoall of the incoming gradient with the received splits.
    """
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


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


def _scatter_grad_factor(op: ReduceOp, scales, process_set) -> float:
    """What Horovod multiplies a reducescatter's incoming gradient by before gathering it: the
    set's size for Sum (not divided by it for Average), and both scale factors."""
    _check_grad_op(op, "reducescatter")
    factor = scales[0] * scales[1]
    if op == ReduceOp.Sum:
        factor *= _set_of(process_set).size()
    return factor


def _scaled(grad: torch.Tensor, factor: float) -> torch.Tensor:
    return grad * factor if factor != 1.0 else grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        factor = _scatter_grad_factor(ctx.op, ctx.scales, ctx.process_set)
        grad = allgather(_scaled(grad_output.contiguous(), factor), process_set=ctx.process_set)
        return grad, None, None, None, None, None


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
    reduced = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor,
                                   process_set)
    return compression.decompress(reduced, cctx)


# --- grouped ops -----------------------------------------------------------------------------
def _differentiable(grads) -> list[int]:
    """Positions of a grouped op's members that can have a gradient (floating point)."""
    return [i for i, g in enumerate(grads) if g is not None and g.dtype.is_floating_point]


def _group_views(tensors, what: str, in_place: bool = False):
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
    srcs, arrays, dtypes = _group_views(tensors, f"grouped_allreduce {name or ''}".strip())
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in srcs]
    handle = core.submit_group(
        ALLREDUCE, arrays, name=name, outputs=[as_core_array(o)[0] for o in outs], dtypes=dtypes,
        reduce_op=resolve_op(op, average), prescale_factor=prescale_factor,
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


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return tuple(synchronize(grouped_allreduce_async(
            list(tensors), name=name, op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, process_set=process_set)))

    @staticmethod
    def backward(ctx, *grads):
        _check_grad_op(ctx.op, "grouped_allreduce")
        members = _differentiable(grads)
        out = [None] * len(grads)
        if members:
            reduced = grouped_allreduce([grads[i].contiguous() for i in members], op=ctx.op,
                                        prescale_factor=ctx.scales[0],
                                        postscale_factor=ctx.scales[1],
                                        process_set=ctx.process_set)
            for i, g in zip(members, reduced):
                out[i] = g
        return (None, None, None, None, None, *out)


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
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *compressed)
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


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        # Horovod's gradient, as for allgather: the incoming gradients averaged over the set
        # (one grouped allreduce), then this rank's rows of each (every member's row counts
        # from every rank come with one small allgather).  Members of a dtype without
        # gradients take no part (their dtype, hence the choice, is the same on every rank).
        members = _differentiable(grads)
        if not members:
            return (None, None, *[None] * len(grads))
        reduced = grouped_allreduce([grads[i].contiguous() for i in members],
                                    op=ReduceOp.Average, process_set=ctx.process_set)
        rows = [ctx.shapes[i][0] if len(ctx.shapes[i]) else 1 for i in members]
        everyone = allgather(torch.tensor(rows, dtype=torch.int64), process_set=ctx.process_set)
        offsets = everyone.view(-1, len(rows))[:_set_of(ctx.process_set).rank()].sum(0)
        out = [None] * len(grads)
        for i, g, offset, n in zip(members, reduced, offsets.tolist(), rows):
            out[i] = g.narrow(0, offset, n).reshape(ctx.shapes[i])
        return (None, None, *out)


def grouped_allgather(tensors, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather a list of tensors as one unit.  Differentiable, like :func:`allgather` (each
    member's gradient as allgather's)."""
    tensors = list(tensors)
    if not tensors:   # (still validates process_set)
        return synchronize(grouped_allgather_async(tensors, name, process_set))
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


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


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        # As for reducescatter, member by member, in one grouped allgather.
        factor = _scatter_grad_factor(ctx.op, ctx.scales, ctx.process_set)
        members = _differentiable(grads)
        out = [None] * len(grads)
        if members:
            gathered = grouped_allgather([_scaled(grads[i].contiguous(), factor)
                                          for i in members], process_set=ctx.process_set)
            for i, g in zip(members, gathered):
                out[i] = g
        return (None, None, None, None, None, *out)


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
    reduced = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor,
                                          process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, ctxs)]


# --- handles, barrier, join ------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """True if the asynchronous operation behind ``handle`` has completed."""
    if not isinstance(handle, (Handle, GroupHandle)):   # (Horovod: a TypeError, too)
        raise TypeError(f"poll() expects a handle returned by an *_async call, got "
                        f"{type(handle).__name__}.")
    return handle.poll()


def synchronize(handle: Handle):
    """Wait for ``handle``; return its output tensor (raises the operation's error)."""
    return core.synchronize(handle)


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
