"""Grouped operations: several tensors negotiated and executed as one unit.

A group's members reach the engine together, are announced through the response cache only when
all of them hit it, and are released by the coordinator together, so they always run in the same
round (and small allreduces of one dtype share one fused buffer).  If one member fails
validation, every member fails with an error naming it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from . import basics
from .handle import GroupHandle
from .messages import ALLGATHER, ALLREDUCE, REDUCESCATTER
from .ops import _auto_name, _contiguous, make_entry
from .process_sets import ProcessSet
from .reduce_ops import ReduceOp, resolve_op


def submit_group(kind: str, arrays: Sequence[np.ndarray], *, name: str | None = None,
                 outputs: Sequence[np.ndarray | None] | None = None,
                 allocates: Sequence | None = None, dtypes: Sequence[str | None] | None = None,
                 process_set: ProcessSet | None = None, **kwargs) -> GroupHandle:
    """Submit ``arrays`` as one grouped ``kind`` operation (contiguous numpy views, as for
    :func:`hvdlite.common.ops.submit`); the handle yields the list of results."""
    engine, members = basics.process_set_engine(process_set, f"grouped {kind}")
    set_id = 0 if members is None else process_set.process_set_id
    n = len(arrays)
    if n == 0:
        return GroupHandle(name or f"grouped_{kind}", [])
    base = name if name is not None else _auto_name(f"grouped_{kind}", set_id)
    group = f"{base}.group{n}"
    entries = [make_entry(engine, members, kind, array,
                          name=f"{base}.{i}" if name is not None else None,
                          output=None if outputs is None else outputs[i],
                          allocate=None if allocates is None else allocates[i],
                          dtype=None if dtypes is None else dtypes[i], set_id=set_id,
                          group=group, group_size=n, **kwargs)
               for i, array in enumerate(arrays)]
    return GroupHandle(group, engine.submit_group(entries))


def grouped_allreduce_async(arrays, average: bool | None = None, name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None) -> GroupHandle:
    """Allreduce a list of arrays as one unit; the handle yields a list of new arrays."""
    return submit_group(ALLREDUCE, [_contiguous(a) for a in arrays], name=name,
                        reduce_op=resolve_op(op, average), prescale_factor=prescale_factor,
                        postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce_async_(arrays, average: bool | None = None, name: str | None = None,
                             op: ReduceOp | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None) -> GroupHandle:
    """In-place grouped allreduce: each (contiguous, writable) array is overwritten."""
    for a in arrays:
        if not (a.flags.c_contiguous and a.flags.writeable):
            raise ValueError("grouped_allreduce_ needs contiguous, writable arrays; use the "
                             "out-of-place grouped_allreduce for others.")
    return submit_group(ALLREDUCE, list(arrays), name=name, outputs=list(arrays),
                        reduce_op=resolve_op(op, average), prescale_factor=prescale_factor,
                        postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce(arrays, average: bool | None = None, name: str | None = None,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Blocking :func:`grouped_allreduce_async`."""
    return grouped_allreduce_async(arrays, average, name, op, prescale_factor,
                                   postscale_factor, process_set).wait()


def grouped_allreduce_(arrays, average: bool | None = None, name: str | None = None,
                       op: ReduceOp | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Blocking :func:`grouped_allreduce_async_`; returns the arrays."""
    return grouped_allreduce_async_(arrays, average, name, op, prescale_factor,
                                    postscale_factor, process_set).wait()


def grouped_allgather_async(arrays, name: str | None = None,
                            process_set: ProcessSet | None = None) -> GroupHandle:
    """Allgather a list of arrays as one unit; the handle yields a list of gathered arrays."""
    prepared = []
    for a in arrays:
        a = _contiguous(a)
        prepared.append(a.reshape(1) if a.ndim == 0 else a)
    return submit_group(ALLGATHER, prepared, name=name, process_set=process_set)


def grouped_allgather(arrays, name: str | None = None,
                      process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Blocking :func:`grouped_allgather_async`."""
    return grouped_allgather_async(arrays, name, process_set).wait()


def grouped_reducescatter_async(arrays, name: str | None = None, op: ReduceOp | None = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet | None = None) -> GroupHandle:
    """Reducescatter a list of arrays as one unit (see
    :func:`hvdlite.common.ops.reducescatter_async` for how rows are divided)."""
    return submit_group(REDUCESCATTER, [_contiguous(a) for a in arrays], name=name,
                        reduce_op=resolve_op(op), prescale_factor=prescale_factor,
                        postscale_factor=postscale_factor, process_set=process_set)


def grouped_reducescatter(arrays, name: str | None = None, op: ReduceOp | None = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Blocking :func:`grouped_reducescatter_async`."""
    return grouped_reducescatter_async(arrays, name, op, prescale_factor, postscale_factor,
                                       process_set).wait()
