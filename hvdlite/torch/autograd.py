"""The gradients of the torch collectives: one ``torch.autograd.Function`` per differentiable
op, with Horovod's gradients (horovod/torch/mpi_ops.py).  They are not always the gradient of
the sum of every rank's loss: allgather's and broadcast's are averaged over the ranks,
reducescatter's is scaled up by the set's size.

Each ``differentiable_*`` function runs one op through its Function (the public ops in
:mod:`.mpi_ops` call them after their argument checks and compression); a backward pass calls
them too, so gradients of gradients work.
"""
from __future__ import annotations

import torch

from hvdlite.common.core import (ProcessSet, ReduceOp, UnsupportedOperationError,
                                 global_process_set, rank)

from .async_ops import (allgather_async, allreduce_async, alltoall_async, broadcast_async,
                        grouped_allgather_async, grouped_allreduce_async,
                        grouped_reducescatter_async, reducescatter_async, synchronize)


def _check_grad_op(op: ReduceOp, what: str) -> None:
    # Horovod's backward would reduce the gradient with the same op (a Max of gradients, say),
    # which is no gradient of anything: refused instead (a deliberate deviation).
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise UnsupportedOperationError(
            f"hvdlite: the gradient of {what} with op={op.name} is not defined; detach the "
            f"input or use Sum/Average.")


def _set_of(process_set: ProcessSet | None) -> ProcessSet:
    return global_process_set if process_set is None else process_set


def _differentiable(grads) -> list[int]:
    """Positions of a grouped op's members that can have a gradient (floating point)."""
    return [i for i, g in enumerate(grads) if g is not None and g.dtype.is_floating_point]


# --- allreduce -------------------------------------------------------------------------------
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
        grad = differentiable_allreduce(grad_output, None, ctx.op, ctx.scales[0], ctx.scales[1],
                                        ctx.process_set)
        return grad, None, None, None, None, None


def differentiable_allreduce(tensor, name, op: ReduceOp, prescale_factor, postscale_factor,
                             process_set):
    """Allreduce ``tensor``; differentiable when it requires a gradient (the gradient of an
    Average/Sum allreduce is the same allreduce of the incoming gradient)."""
    # Nothing to differentiate (metrics, say): skip autograd's ~10 us per call.  A non-tensor
    # takes the autograd path too, whose checks raise the TypeError for it.
    through_autograd = not isinstance(tensor, torch.Tensor) or (
        tensor.requires_grad and torch.is_grad_enabled())
    reduce = _Allreduce.apply if through_autograd else _allreduce_now
    return reduce(tensor, name, op, prescale_factor, postscale_factor, process_set)


# --- allgather -------------------------------------------------------------------------------
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
        grad = differentiable_allreduce(grad_output, None, ReduceOp.Average, 1.0, 1.0,
                                        ctx.process_set)
        rows = differentiable_allgather(torch.tensor([ctx.rows], dtype=torch.int64), None,
                                        ctx.process_set)
        offset = int(rows[:_set_of(ctx.process_set).rank()].sum())
        return grad.narrow(0, offset, ctx.rows), None, None


def differentiable_allgather(tensor, name, process_set):
    """Allgather ``tensor`` (a scalar travels as one row); differentiable."""
    out = _Allgather.apply(tensor, name, process_set)
    return out.reshape(-1) if tensor.dim() == 0 else out


# --- broadcast -------------------------------------------------------------------------------
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        # Horovod's gradient: the incoming gradients averaged over the set for the root, zeros
        # elsewhere.  root_rank is a global rank, also with a process set (as in Horovod).
        grad = differentiable_allreduce(grad_output, None, ReduceOp.Average, 1.0, 1.0,
                                        ctx.process_set)
        if rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def differentiable_broadcast(tensor, root_rank: int, name, process_set):
    """Broadcast ``root_rank``'s ``tensor``; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# --- alltoall --------------------------------------------------------------------------------
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
        grad, _ = differentiable_alltoall(grad_output.contiguous(), ctx.received, None,
                                          ctx.process_set)
        return grad, None, None, None


def differentiable_alltoall(tensor, splits, name, process_set):
    """Alltoall ``tensor``: ``(output, received_splits)``; differentiable in ``output``."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# --- reducescatter ---------------------------------------------------------------------------
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
        grad = differentiable_allgather(_scaled(grad_output.contiguous(), factor), None,
                                        ctx.process_set)
        return grad, None, None, None, None, None


def differentiable_reducescatter(tensor, name, op: ReduceOp, prescale_factor,
                                 postscale_factor, process_set):
    """Reducescatter ``tensor``; differentiable for Sum and Average."""
    return _Reducescatter.apply(tensor, name, op, prescale_factor, postscale_factor,
                                process_set)


# --- grouped ops -----------------------------------------------------------------------------
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
            reduced = differentiable_grouped_allreduce(
                [grads[i].contiguous() for i in members], None, ctx.op, ctx.scales[0],
                ctx.scales[1], ctx.process_set)
            for i, g in zip(members, reduced):
                out[i] = g
        return (None, None, None, None, None, *out)


def differentiable_grouped_allreduce(tensors: list, name, op: ReduceOp, prescale_factor,
                                     postscale_factor, process_set) -> list:
    """Allreduce a non-empty list of tensors as one unit; differentiable for Sum and
    Average."""
    return list(_GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                        process_set, *tensors))


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
        reduced = differentiable_grouped_allreduce([grads[i].contiguous() for i in members],
                                                   None, ReduceOp.Average, 1.0, 1.0,
                                                   ctx.process_set)
        rows = [ctx.shapes[i][0] if len(ctx.shapes[i]) else 1 for i in members]
        everyone = differentiable_allgather(torch.tensor(rows, dtype=torch.int64), None,
                                            ctx.process_set)
        offsets = everyone.view(-1, len(rows))[:_set_of(ctx.process_set).rank()].sum(0)
        out = [None] * len(grads)
        for i, g, offset, n in zip(members, reduced, offsets.tolist(), rows):
            out[i] = g.narrow(0, offset, n).reshape(ctx.shapes[i])
        return (None, None, *out)


def differentiable_grouped_allgather(tensors: list, name, process_set) -> list:
    """Allgather a non-empty list of tensors as one unit; differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


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
            gathered = differentiable_grouped_allgather(
                [_scaled(grads[i].contiguous(), factor) for i in members], None,
                ctx.process_set)
            for i, g in zip(members, gathered):
                out[i] = g
        return (None, None, None, None, None, *out)


def differentiable_grouped_reducescatter(tensors: list, name, op: ReduceOp, prescale_factor,
                                         postscale_factor, process_set) -> tuple:
    """Reducescatter a non-empty list of tensors as one unit; differentiable for Sum and
    Average."""
    return _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor,
                                       process_set, *tensors)
