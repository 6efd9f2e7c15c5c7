"""The gradients of the JAX collectives: each differentiable op is a ``jax.custom_vjp`` with
the torch adapter's (Horovod's) rules, so ``jax.grad`` through a collective gives the numbers
``hvdlite.torch`` gives (docs/collectives.md, "Gradients of collectives"):

* allreduce (Sum/Average): the same allreduce of the incoming gradient (op, scale factors and
  process set); Min/Max/Product/Adasum raise ``UnsupportedOperationError`` when differentiated;
* allgather: the incoming gradient averaged over the set, then this rank's rows of it;
* broadcast: on the root the incoming gradient averaged over the set, zeros elsewhere;
* alltoall: an alltoall of the incoming gradient with the received splits;
* reducescatter: the allgather of the incoming gradient, times the set's size for Sum (not
  divided by it for Average), times both scale factors;
* grouped forms: member by member, in one grouped operation.

Integer and bool members get no gradient (``None``: JAX's zero).  The backward's collectives
are themselves differentiable, so gradients of gradients work.  Concrete (untraced) inputs skip
``custom_vjp`` altogether: nothing to differentiate, no tracing cost.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hvdlite.common.core import ProcessSet, ReduceOp, UnsupportedOperationError, rank

from . import collectives as raw
from .bridge import is_traced


def _check_grad_op(op: ReduceOp, what: str) -> None:
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise UnsupportedOperationError(
            f"hvdlite: the gradient of {what} with op={ReduceOp(op).name} is not defined; "
            f"wrap the input in jax.lax.stop_gradient or use Sum/Average.")


def _floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _differentiable(fn, primal, backward, xs: list):
    """``fn(xs)`` through a fresh custom_vjp whose backward is ``backward(residuals, grads)``;
    ``primal(xs) -> (outputs, residuals)``.  Untraced inputs run ``fn`` directly."""
    if not is_traced(*xs):
        return fn(xs)

    @jax.custom_vjp
    def op(*args):
        return tuple(fn(list(args)))

    def fwd(*args):
        outs, res = primal(list(args))
        return tuple(outs), res

    def bwd(res, grads):
        return tuple(backward(res, list(grads)))

    op.defvjp(fwd, bwd)
    return list(op(*xs))


# --- allreduce -------------------------------------------------------------------------------
def allreduce(xs: list, name, op: ReduceOp, prescale: float, postscale: float,
              process_set: ProcessSet | None, grouped: bool) -> list:
    """Allreduce (grouped or single); differentiable for Sum and Average."""
    def fn(args):
        return raw.allreduce(args, name, op, prescale, postscale, process_set, grouped)

    def primal(args):
        return fn(args), None

    def backward(_, grads):
        _check_grad_op(op, "grouped_allreduce" if grouped else "allreduce")
        members = [i for i, x in enumerate(xs) if _floating(x)]
        out = [None] * len(xs)
        if members:
            reduced = allreduce([grads[i] for i in members], None, op, prescale, postscale,
                                process_set, grouped)
            for i, g in zip(members, reduced):
                out[i] = g
        return out

    return _differentiable(fn, primal, backward, xs)


# --- allgather -------------------------------------------------------------------------------
def allgather(xs: list, name, process_set: ProcessSet | None, grouped: bool,
              row_counts=None) -> list:
    """Allgather (grouped or single); differentiable: each rank gets its rows of the incoming
    gradients averaged over the set."""
    shapes = [x.shape for x in xs]

    def fn(args):
        return raw.allgather(args, name, process_set, grouped, row_counts)

    def primal(args):
        outs, counts = raw.allgather(args, name, process_set, grouped, row_counts,
                                     with_counts=True)
        me = raw.set_rank(process_set)
        offsets = jnp.sum(counts[:me], axis=0, dtype=jnp.int32) if me else jnp.zeros(
            (len(args),), jnp.int32)
        return outs, offsets

    def backward(offsets, grads):
        members = [i for i, x in enumerate(xs) if _floating(x)]
        out = [None] * len(xs)
        if not members:
            return out
        averaged = allreduce([grads[i] for i in members], None, ReduceOp.Average, 1.0, 1.0,
                             process_set, grouped=len(xs) > 1)
        for i, g in zip(members, averaged):
            rows = shapes[i][0] if len(shapes[i]) else 1
            out[i] = lax.dynamic_slice_in_dim(g, offsets[i], rows, axis=0).reshape(shapes[i])
        return out

    return _differentiable(fn, primal, backward, xs)


# --- broadcast -------------------------------------------------------------------------------
def broadcast(x, root_rank: int, name, process_set: ProcessSet | None):
    """Broadcast; differentiable: the root gets the incoming gradient averaged over the set,
    the other ranks zeros."""
    def fn(args):
        return raw.broadcast(args, root_rank, name, process_set)

    def primal(args):
        return fn(args), None

    def backward(_, grads):
        if not _floating(x):
            return [None]
        (g,) = allreduce(grads, None, ReduceOp.Average, 1.0, 1.0, process_set, False)
        return [g if rank() == root_rank else jnp.zeros_like(g)]

    return _differentiable(fn, primal, backward, [x])[0]


# --- alltoall --------------------------------------------------------------------------------
def alltoall(x, splits, name, process_set: ProcessSet | None):
    """Alltoall: ``(output, received_splits)``; differentiable in the output: each received
    row's gradient goes back to the rank it came from."""
    def fn(args):
        return list(raw.alltoall(args[0], splits, name, process_set))

    def primal(args):
        out, received = fn(args)
        return [out, received], received

    def backward(received, grads):
        if not _floating(x):
            return [None]
        back = None if is_traced(received) else received
        out, _ = alltoall(grads[0], back, None, process_set)
        return [out]

    out, received = _differentiable(fn, primal, backward, [x])
    return out, received


# --- reducescatter ---------------------------------------------------------------------------
def reducescatter(xs: list, name, op: ReduceOp, prescale: float, postscale: float,
                  process_set: ProcessSet | None, grouped: bool) -> list:
    """Reducescatter (grouped or single); differentiable for Sum and Average: the allgather of
    the incoming gradients, times the set's size for Sum, times both scale factors."""
    def fn(args):
        return raw.reducescatter(args, name, op, prescale, postscale, process_set, grouped)

    def primal(args):
        return fn(args), None

    def backward(_, grads):
        _check_grad_op(op, "grouped_reducescatter" if grouped else "reducescatter")
        factor = prescale * postscale
        if op == ReduceOp.Sum:
            factor *= raw.set_size(process_set)
        members = [i for i, x in enumerate(xs) if _floating(x)]
        out = [None] * len(xs)
        if members:
            scaled = [grads[i] * factor if factor != 1.0 else grads[i] for i in members]
            counts = [raw.scatter_rows(xs[i].shape[0], process_set) for i in members]
            gathered = allgather(scaled, None, process_set, grouped=len(xs) > 1,
                                 row_counts=counts)
            for i, g in zip(members, gathered):
                out[i] = g
        return out

    return _differentiable(fn, primal, backward, xs)
