"""The collectives themselves on JAX arrays, without gradients: each runs through
:func:`hvdlite.jax.bridge.run` (eagerly on numpy views, or as one ordered callback inside a
traced function) and returns JAX arrays.  Their differentiable forms are in :mod:`.autodiff`,
the public functions in :mod:`.mpi_ops`.

Inside a traced function every output needs a static shape, so what depends on the other ranks'
shapes is pinned down there: ``allgather`` needs the same number of rows on every rank (its
result is ``size`` times the rows; the ranks' row counts travel with the data and every rank
checks them, so a rank with other rows makes every rank raise ``TensorMismatchError``), and
``alltoall`` needs even splits (``splits=None``, the rows divisible by the set's size, the
same rows on every rank, checked alike).
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from hvdlite.common import core
from hvdlite.common.core import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER,
                                 ProcessSet, ReduceOp, TensorMismatchError, global_process_set,
                                 split_rows)

from .bridge import check_member, is_traced, run


def _set(process_set: ProcessSet | None) -> ProcessSet | None:
    return None if process_set is None or process_set is global_process_set else process_set


def set_size(process_set: ProcessSet | None) -> int:
    ps = _set(process_set)
    return core.size() if ps is None or ps.process_set_id == 0 else ps.size()


def set_rank(process_set: ProcessSet | None) -> int:
    ps = _set(process_set)
    return core.rank() if ps is None or ps.process_set_id == 0 else ps.rank()


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _same_specs(xs: Sequence) -> list:
    return [_spec(x.shape, x.dtype) for x in xs]


def _traced_check(xs: Sequence, process_set, what: str) -> None:
    if is_traced(*xs):
        check_member(_set(process_set), what)


# --- allreduce -------------------------------------------------------------------------------
def allreduce(xs: list, name: str | None, op: ReduceOp, prescale: float, postscale: float,
              process_set: ProcessSet | None, grouped: bool) -> list:
    """Allreduce the arrays ``xs`` (one operation, or one grouped operation)."""
    ps = _set(process_set)
    _traced_check(xs, ps, "allreduce")

    def compute(label, *arrays):
        if grouped:
            return core.grouped_allreduce(list(arrays), name=label, op=op,
                                          prescale_factor=prescale, postscale_factor=postscale,
                                          process_set=ps)
        return [core.allreduce(arrays[0], name=label, op=op, prescale_factor=prescale,
                               postscale_factor=postscale, process_set=ps)]

    return run(f"grouped_{ALLREDUCE}" if grouped else ALLREDUCE, name, ps, compute, xs,
               lambda: _same_specs(xs))


# --- broadcast -------------------------------------------------------------------------------
def broadcast(xs: list, root_rank: int, name: str | None, process_set: ProcessSet | None
              ) -> list:
    """Broadcast the one array of ``xs`` from ``root_rank``."""
    ps = _set(process_set)
    _traced_check(xs, ps, "broadcast")

    def compute(label, array):
        return [core.broadcast(array, root_rank, name=label, process_set=ps)]

    return run(BROADCAST, name, ps, compute, xs, lambda: _same_specs(xs))


def broadcast_named(xs: list, names: list[str], root_rank: int,
                    process_set: ProcessSet | None) -> list:
    """Broadcast each array under its own name (all submitted, then waited for; one callback
    inside a traced function)."""
    ps = _set(process_set)
    _traced_check(xs, ps, "broadcast")

    def compute(_label, *arrays):
        handles = [core.broadcast_async(a, root_rank, name=n, process_set=ps)
                   for a, n in zip(arrays, names)]
        return [h.wait() for h in handles]

    return run(BROADCAST, "", ps, compute, xs, lambda: _same_specs(xs))


# --- allgather -------------------------------------------------------------------------------
def _rows(x) -> int:
    return x.shape[0] if x.ndim else 1


def allgather(xs: list, name: str | None, process_set: ProcessSet | None, grouped: bool,
              row_counts: list[list[int]] | None = None, with_counts: bool = False):
    """Gather the arrays ``xs`` along dimension 0 (a scalar is one row).  Returns the gathered
    arrays, and with ``with_counts`` also an int32 array ``(set size, len(xs))`` of every
    rank's rows.  Traced (or ``with_counts``), the row counts travel with the data as one more
    member of a grouped allgather; traced, ``row_counts`` (per member, per rank; default: this
    rank's rows on every rank) are the promised ones, checked on every rank."""
    ps = _set(process_set)
    traced = is_traced(*xs)
    _traced_check(xs, ps, "allgather")
    n = len(xs)
    kind = f"grouped_{ALLGATHER}" if grouped else ALLGATHER
    if not traced and not with_counts:
        def plain(label, *arrays):
            if grouped:
                return core.grouped_allgather(list(arrays), name=label, process_set=ps)
            return [core.allgather(arrays[0], name=label, process_set=ps)]
        return run(kind, name, ps, plain, xs, None)
    size = set_size(ps)
    mine = [_rows(x) for x in xs]
    promised = row_counts if row_counts is not None else [[r] * size for r in mine]

    def compute(label, *arrays):
        members = [a.reshape(1) if a.ndim == 0 else a for a in arrays]
        members.append(np.asarray(mine, dtype=np.int32))
        out = core.grouped_allgather(members, name=label, process_set=ps)
        counts = out[-1].reshape(size, n)
        if traced and [list(c) for c in counts.T.tolist()] != [list(p) for p in promised]:
            raise TensorMismatchError(
                f"hvdlite: {kind} {label!r} inside a traced function (jax.jit, ...) needs a "
                f"result shape known when tracing, but the ranks sent "
                f"{counts.T.tolist()} rows (per member, per rank of the set) where "
                f"{[list(p) for p in promised]} were expected: give every rank the same "
                f"number of rows, or gather outside the traced function.")
        return [*out[:-1], counts]

    def specs():
        return [_spec((sum(p), *x.shape[1:]), x.dtype) for x, p in zip(xs, promised)] + [
            _spec((size, n), np.int32)]

    outs = run(kind, name, ps, compute, xs, specs)
    return (outs[:-1], outs[-1]) if with_counts else outs[:-1]


# --- alltoall --------------------------------------------------------------------------------
def alltoall(x, splits, name: str | None, process_set: ProcessSet | None):
    """``(received rows, received_splits as int32)``.  Traced: even splits only (see the
    module docstring)."""
    ps = _set(process_set)
    traced = is_traced(x)
    if not traced:
        def plain(label, array):
            out, received = core.alltoall(array, splits=splits, name=label, process_set=ps)
            return [out, np.asarray(received, dtype=np.int32)]
        return tuple(run(ALLTOALL, name, ps, plain, [x], None))
    check_member(ps, "alltoall")
    size = set_size(ps)
    rows = _rows(x)
    even = [rows // size] * size
    if splits is not None:
        if is_traced(splits) or [int(s) for s in np.asarray(splits).reshape(-1)] != even:
            raise NotImplementedError(
                "hvdlite: alltoall with explicit uneven (or traced) splits inside a traced "
                "function (jax.jit, ...): the result's shape depends on what the other ranks "
                "send, which is unknown when tracing. Use splits=None (the rows divided evenly) "
                "inside jit, or call alltoall outside it.")
    if x.ndim == 0 or rows % size:
        raise ValueError(f"hvdlite: alltoall without splits needs dimension 0 ({rows}) "
                         f"divisible by the number of ranks ({size}).")

    def compute(label, array):
        out, received = core.alltoall(array, splits=None, name=label, process_set=ps)
        received = np.asarray(received, dtype=np.int32)
        if received.tolist() != even:
            raise TensorMismatchError(
                f"hvdlite: alltoall {label!r} inside a traced function (jax.jit, ...) needs "
                f"the same number of rows on every rank (its result's shape is fixed when "
                f"tracing), but received {received.tolist()} rows from the ranks where "
                f"{even} were expected.")
        return [out, received]

    return tuple(run(ALLTOALL, name, ps, compute, [x],
                     lambda: [_spec(x.shape, x.dtype), _spec((size,), np.int32)]))


# --- reducescatter ---------------------------------------------------------------------------
def scatter_rows(rows: int, process_set) -> list[int]:
    return split_rows(rows, set_size(process_set))


def reducescatter(xs: list, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                  process_set: ProcessSet | None, grouped: bool) -> list:
    """This rank's rows of each array of ``xs`` reduced across the set."""
    ps = _set(process_set)
    _traced_check(xs, ps, "reducescatter")
    for x in xs if is_traced(*xs) else ():   # (eagerly the core checks, and announces)
        if x.ndim == 0:
            raise ValueError("hvdlite: reducescatter of a scalar; pass an array with at least "
                             "one dimension (its rows are split across the ranks).")

    def compute(label, *arrays):
        if grouped:
            return core.grouped_reducescatter(list(arrays), name=label, op=op,
                                              prescale_factor=prescale,
                                              postscale_factor=postscale, process_set=ps)
        return [core.reducescatter(arrays[0], name=label, op=op, prescale_factor=prescale,
                                   postscale_factor=postscale, process_set=ps)]

    def specs():
        me = set_rank(ps)
        return [_spec((scatter_rows(x.shape[0], ps)[me], *x.shape[1:]), x.dtype) for x in xs]

    return run(f"grouped_{REDUCESCATTER}" if grouped else REDUCESCATTER, name, ps, compute, xs,
               specs)
