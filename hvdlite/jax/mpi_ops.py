"""Horovod-style collectives on JAX arrays and pytrees, eagerly and inside ``jax.jit``.

Every function takes ``jax.Array``s (numpy arrays and Python scalars are converted) and works
on concrete arrays (eagerly, on zero-copy numpy views) and on traced ones (inside ``jax.jit``,
``jax.grad``, ``lax.cond`` ...: one ordered ``io_callback`` per operation, see
:mod:`hvdlite.jax.bridge`).  ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` and the grouped forms are differentiable with the torch adapter's (Horovod's)
gradients (see :mod:`hvdlite.jax.autodiff`).  Arguments and defaults are those of
``hvdlite.torch``; every op takes ``process_set`` (default: all ranks).

Inside a traced function: ``allgather`` needs the same number of rows on every rank and
``alltoall`` even splits (the result's shape is fixed when tracing; a rank that breaks this
makes every rank raise ``TensorMismatchError``); errors reach the caller as
``jax.errors.JaxRuntimeError`` quoting hvdlite's error (:func:`original_error` returns it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hvdlite.common import core
from hvdlite.common.core import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER,
                                 ProcessSet, ReduceOp, global_process_set, resolve_op)

from . import autodiff
from .bridge import is_traced, original_error
from .compression import Compression

Array = jax.Array


def _array(x) -> Any:
    return x if isinstance(x, (jax.Array, jax.core.Tracer)) else jnp.asarray(x)


def _as_tree(tensor):
    """``(leaves, treedef)`` when ``tensor`` is a pytree container (dict, list, tuple, optax
    state, ...) holding arrays, else None (an array, a scalar, or a list of numbers, which
    becomes one array)."""
    if isinstance(tensor, (jax.Array, jax.core.Tracer, np.ndarray, int, float, complex, bool)):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(tensor)
    if treedef.num_nodes == 1 or not any(
            isinstance(x, (jax.Array, jax.core.Tracer, np.ndarray)) for x in leaves):
        return None
    return leaves, treedef


def _check_name(name) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")


def _announced(kind: str, name, process_set, tensor):
    """Eagerly, an unnamed op whose checks fail takes its name and tells the other ranks (see
    ``core.announced``).  Traced, nothing is announced: the checks run when tracing, alike on
    every rank, and unnamed traced ops are named when they run, apart from the eager ones."""
    if is_traced(tensor):
        return contextlib.nullcontext()
    return core.announced(kind, name, None if process_set is global_process_set else process_set)


# --- allreduce -------------------------------------------------------------------------------
def allreduce(tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Array:
    """Return ``tensor`` reduced across the ranks of ``process_set`` (default: averaged).

    ``op``: Average, Sum, Min, Max, Product or Adasum; ``average=`` is Horovod's deprecated
    spelling.  ``prescale_factor`` multiplies the input before the reduction,
    ``postscale_factor`` the result.  ``compression`` (``Compression.fp16``/``bf16``) casts
    floating-point data for the wire.  Differentiable for Average/Sum: the gradient is the same
    allreduce of the incoming gradient.  A pytree (dict, list, optax state, ...) of arrays is
    reduced leaf by leaf in one :func:`grouped_allreduce` and returned as a tree alike."""
    tree = _as_tree(tensor)
    if tree is not None:
        reduced = grouped_allreduce(tree[0], average, name, compression, op, prescale_factor,
                                    postscale_factor, process_set)
        return jax.tree_util.tree_unflatten(tree[1], reduced)
    with _announced(ALLREDUCE, name, process_set, tensor):
        _check_name(name)
        op = resolve_op(op, average)
        compressed, ctx = compression.compress(_array(tensor))
    (reduced,) = autodiff.allreduce([compressed], name, op, float(prescale_factor),
                                    float(postscale_factor), process_set, grouped=False)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Sequence, average: bool | None = None, name: str | None = None,
                      compression=Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Array]:
    """Allreduce a list of arrays as one unit (one negotiation; small members of one dtype
    share one fused buffer; inside jit one callback).  Arguments as :func:`allreduce`;
    differentiable for Average/Sum."""
    tensors = list(tensors)
    if not tensors:
        return []
    announce = (contextlib.nullcontext() if is_traced(*tensors) else core.announced_group(
        ALLREDUCE, name, None if process_set is global_process_set else process_set,
        len(tensors)))
    with announce:
        _check_name(name)
        op = resolve_op(op, average)
        pairs = [compression.compress(_array(t)) for t in tensors]
    reduced = autodiff.allreduce([p[0] for p in pairs], name, op, float(prescale_factor),
                                 float(postscale_factor), process_set, grouped=True)
    return [compression.decompress(r, p[1]) for r, p in zip(reduced, pairs)]


# --- allgather -------------------------------------------------------------------------------
def allgather(tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Array:
    """Concatenation of every rank's ``tensor`` along dimension 0, in rank order (a scalar is
    one row; eagerly the number of rows may differ per rank, inside jit it must not).
    Differentiable: each rank gets its rows of the incoming gradients averaged over the set.
    A pytree of arrays is gathered leaf by leaf in one :func:`grouped_allgather`."""
    tree = _as_tree(tensor)
    if tree is not None:
        return jax.tree_util.tree_unflatten(tree[1], grouped_allgather(tree[0], name,
                                                                      process_set))
    with _announced(ALLGATHER, name, process_set, tensor):
        _check_name(name)
        tensor = _array(tensor)
    return autodiff.allgather([tensor], name, process_set, grouped=False)[0]


def grouped_allgather(tensors: Sequence, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Array]:
    """Allgather a list of arrays as one unit; differentiable like :func:`allgather`."""
    tensors = [_array(t) for t in tensors]
    if not tensors:
        return []
    _check_name(name)
    return autodiff.allgather(tensors, name, process_set, grouped=True)


# --- broadcast -------------------------------------------------------------------------------
def broadcast(tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Array:
    """Return ``root_rank``'s ``tensor`` on every rank (``root_rank``: a global rank in the
    set).  Differentiable: the root gets the average of every rank's gradient, the others
    zeros.  A pytree of arrays is broadcast leaf by leaf (each leaf as its own differentiable
    broadcast, named ``<name>.<i>`` when named)."""
    tree = _as_tree(tensor)
    if tree is not None:
        leaves = [broadcast(leaf, root_rank, None if name is None else f"{name}.{i}",
                            process_set) for i, leaf in enumerate(tree[0])]
        return jax.tree_util.tree_unflatten(tree[1], leaves)
    with _announced(BROADCAST, name, process_set, tensor):
        _check_name(name)
        tensor = _array(tensor)
    return autodiff.broadcast(tensor, int(root_rank), name, process_set)


# --- alltoall --------------------------------------------------------------------------------
def alltoall(tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Send rows ``splits[j]`` of ``tensor`` (along dimension 0, in order) to rank j of the set
    and receive what every rank sent here, in rank order.  Without ``splits`` the rows are
    divided evenly.  Returns the received array, or ``(array, received_splits)`` when
    ``splits`` is given (Horovod's convention).  Inside jit only even splits are possible.
    Differentiable: each received row's gradient goes back to where the row came from."""
    with _announced(ALLTOALL, name, process_set, tensor):
        _check_name(name)
        tensor = _array(tensor)
    out, received = autodiff.alltoall(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


# --- reducescatter ---------------------------------------------------------------------------
def reducescatter(tensor, name: str | None = None, compression=Compression.none,
                  op: ReduceOp | None = ReduceOp.Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Array:
    """This rank's rows of ``tensor`` (same shape on every rank) reduced across the set: with R
    rows and N ranks the first R % N ranks get R // N + 1 rows, the others R // N.  Sum,
    Average (default), Min, Max, Product.  Differentiable for Sum/Average: the allgather of the
    incoming gradients, times the set's size for Sum, times both scale factors."""
    with _announced(REDUCESCATTER, name, process_set, tensor):
        _check_name(name)
        op = resolve_op(op)
        compressed, ctx = compression.compress(_array(tensor))
    (out,) = autodiff.reducescatter([compressed], name, op, float(prescale_factor),
                                    float(postscale_factor), process_set, grouped=False)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence, name: str | None = None,
                          compression=Compression.none,
                          op: ReduceOp | None = ReduceOp.Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Array]:
    """Reducescatter a list of arrays as one unit; differentiable like
    :func:`reducescatter`."""
    tensors = list(tensors)
    if not tensors:
        return []
    _check_name(name)
    op = resolve_op(op)
    pairs = [compression.compress(_array(t)) for t in tensors]
    outs = autodiff.reducescatter([p[0] for p in pairs], name, op, float(prescale_factor),
                                  float(postscale_factor), process_set, grouped=True)
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# --- barrier, join ---------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of the process set) reaches the barrier (eager only)."""
    core.barrier(None if process_set is global_process_set else process_set)


def join(process_set: ProcessSet = global_process_set) -> int:
    """This rank is out of data: serve the other ranks' allreduces with zeros until every rank
    has joined; returns the rank that joined last (eager only)."""
    return core.join(None if process_set is global_process_set else process_set)


__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter", "barrier", "join",
           "original_error"]
