"""Horovod-compatible collective ops on torch CPU tensors.

Contiguous tensors are handed to the core as zero-copy numpy views; non-contiguous ones are
copied to a contiguous buffer (and, for in-place ops, copied back when the handle is waited on).
``allreduce``/``allgather``/``broadcast`` are differentiable.
"""
from __future__ import annotations

import torch

from hvdlite.common import ops as core
from hvdlite.common.basics import rank, size
from hvdlite.common.handle import Handle
from hvdlite.common.messages import ALLGATHER, ALLREDUCE, BROADCAST
from hvdlite.common.reduce_ops import ReduceOp, resolve_op

from .compression import Compression
from .tensor_bridge import as_numpy, check_tensor, empty_numpy_backed


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
    array, dtype = as_numpy(src)
    out_array = array if in_place else (None if dst is None else as_numpy(dst)[0])
    handle = core.submit(kind, array, output=out_array, dtype=dtype, **kwargs)
    if in_place and src is not tensor:
        return handle.then(lambda _: tensor.copy_(src))
    if output is not None and dst is not output:
        return handle.then(lambda _: output.copy_(dst))
    return handle.then(lambda _: output if output is not None else dst)


# --- allreduce -------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set=None) -> Handle:
    """Start averaging (or summing, ...) ``tensor`` across ranks into a new tensor.

    Returns a handle for :func:`poll` / :func:`synchronize`.  ``op`` is Average (default), Sum,
    Min, Max or Product; ``prescale_factor`` multiplies the input before the reduction and
    ``postscale_factor`` the result after it.  ``name`` must be unique among pending ops and the
    same on every rank (unnamed ops must be issued in the same order on every rank).
    """
    _no_process_sets(process_set)
    what = f"allreduce of {name or 'unnamed tensor'}"
    check_tensor(tensor, what)   # before allocating: empty_like fails on e.g. sparse tensors
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit(ALLREDUCE, tensor, output, what,
                   name=name, reduce_op=resolve_op(op, average),
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set=None) -> Handle:
    """In-place :func:`allreduce_async`: ``tensor`` is overwritten with the result."""
    _no_process_sets(process_set)
    return _submit(ALLREDUCE, tensor, tensor, f"allreduce_ of {name or 'unnamed tensor'}",
                   name=name, reduce_op=resolve_op(op, average),
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.op, ctx.scales = op, (prescale_factor, postscale_factor)
        return synchronize(allreduce_async(tensor, name=name, op=op,
                                           prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.op not in (ReduceOp.Average, ReduceOp.Sum):
            raise RuntimeError(f"hvdlite: the gradient of allreduce with op={ctx.op.name} is not "
                               f"defined; detach the input or use Sum/Average.")
        grad = allreduce(grad_output, op=ctx.op, prescale_factor=ctx.scales[0],
                         postscale_factor=ctx.scales[1])
        return grad, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set=None) -> torch.Tensor:
    """Return ``tensor`` reduced across all ranks (default: averaged).  Differentiable: the
    gradient of an Average/Sum allreduce is the same allreduce of the incoming gradient.
    ``compression`` (e.g. ``Compression.fp16``) shrinks the data on the wire."""
    _no_process_sets(process_set)
    op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """In-place allreduce (not differentiable); returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


# --- allgather -------------------------------------------------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set=None) -> Handle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (which may differ in size
    between ranks; the other dimensions must match)."""
    _no_process_sets(process_set)
    what = f"allgather of {name or 'unnamed tensor'}"
    check_tensor(tensor, what)
    holder: list[torch.Tensor] = []

    def allocate(shape, _np_dtype):
        out, array = empty_numpy_backed(shape, tensor)
        holder.append(out)
        return array.view(_np_dtype) if array.dtype != _np_dtype else array

    src = tensor.contiguous()
    array, dtype = as_numpy(src)
    handle = core.submit(ALLGATHER, array, name=name, allocate=allocate, dtype=dtype)
    return handle.then(lambda _: (src, holder[0])[1])


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=ReduceOp.Sum)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64))
        offset = int(rows[:rank()].sum())
        return grad.narrow(0, offset, ctx.rows), None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set=None) -> torch.Tensor:
    """Concatenation of every rank's ``tensor`` along dimension 0, in rank order.
    Differentiable: each rank gets the slice of the summed gradient that matches its rows."""
    _no_process_sets(process_set)
    out = _Allgather.apply(tensor, name)
    return out.reshape(-1) if tensor.dim() == 0 else out


# --- broadcast -------------------------------------------------------------------------------
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set=None) -> Handle:
    """Start broadcasting ``root_rank``'s ``tensor`` into a new tensor on every rank."""
    _no_process_sets(process_set)
    what = f"broadcast of {name or 'unnamed tensor'}"
    check_tensor(tensor, what)   # before allocating: empty_like fails on e.g. sparse tensors
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit(BROADCAST, tensor, output, what,
                   name=name, root_rank=root_rank)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set=None) -> Handle:
    """In-place broadcast: non-root ranks' ``tensor`` is overwritten with the root's."""
    _no_process_sets(process_set)
    return _submit(BROADCAST, tensor, tensor, f"broadcast_ of {name or 'unnamed tensor'}",
                   name=name, root_rank=root_rank)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=ReduceOp.Sum)
        if rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set=None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank.  Differentiable: the root receives the
    sum of all ranks' gradients, the others zeros."""
    _no_process_sets(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set=None) -> torch.Tensor:
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# --- handles ---------------------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """True if the asynchronous operation behind ``handle`` has completed."""
    return handle.poll()


def synchronize(handle: Handle):
    """Wait for ``handle``; return its output tensor (raises the operation's error)."""
    return core.synchronize(handle)


def barrier(process_set=None) -> None:
    """Block until every rank reaches the barrier."""
    _no_process_sets(process_set)
    core.barrier()


def _no_process_sets(process_set) -> None:
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise NotImplementedError("process sets are not available in hvdlite yet; omit "
                                  "process_set= to use all ranks.")


__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather",
           "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "poll", "synchronize", "barrier", "size"]
