"""Grouped operations: several tensors negotiated and executed as one unit.

A group's members reach the engine together, are announced through the response cache only when
all of them hit it, and are released by the coordinator together, so they always run in the same
round (and small allreduces of one dtype share one fused buffer).  If one member fails
validation, every member fails with an error naming it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np

from hvdlite.common.api.announce import (_NOTHING_TO_ANNOUNCE, _announce, _auto_name,
                                         announcing_with)
from hvdlite.common.api.submission import _contiguous, fast_host_allreduce_group, make_entry
from hvdlite.common.engine.handle import GroupHandle
from hvdlite.common.engine.messages import ALLGATHER, ALLREDUCE, REDUCESCATTER
from hvdlite.common.reduce_ops import ReduceOp, resolve_op
from hvdlite.common.runtime import registry
from hvdlite.common.runtime.process_sets import ProcessSet


def submit_group(kind: str, arrays: Sequence[np.ndarray], *, name: str | None = None,
                 outputs: Sequence[np.ndarray | None] | None = None,
                 allocates: Sequence | None = None, dtypes: Sequence[str | None] | None = None,
                 process_set: ProcessSet | None = None, **kwargs) -> GroupHandle:
    """Submit ``arrays`` as one grouped ``kind`` operation (contiguous numpy views, as for
    :func:`hvdlite.common.api.submission.submit`); the handle yields the list of results."""
    engine, members = registry.process_set_engine(process_set, f"grouped {kind}")
    set_id = 0 if members is None else process_set.process_set_id
    n = len(arrays)
    if n == 0:
        return GroupHandle(name or f"grouped_{kind}", [])
    auto_named = name is None
    # Every member's name is taken before any is checked: if one fails in an unnamed group, all
    # are announced as failed, so the other ranks' group fails too and later names stay paired.
    group, names = _group_names(kind, name, set_id, n)
    try:
        entries = None
        if (kind == ALLREDUCE and members is None and allocates is None
                and (dtypes is None or not any(dtypes))
                and kwargs.keys() <= _FAST_GROUP_ARGUMENTS):
            entries = fast_host_allreduce_group(
                engine, arrays, outputs, names, group, not auto_named,
                kwargs.get("reduce_op", ReduceOp.Sum), kwargs.get("prescale_factor", 1.0),
                kwargs.get("postscale_factor", 1.0))
        if entries is None:
            entries = [make_entry(engine, members, kind, array, name=names[i],
                                  output=None if outputs is None else outputs[i],
                                  allocate=None if allocates is None else allocates[i],
                                  dtype=None if dtypes is None else dtypes[i], set_id=set_id,
                                  group=group, group_size=n, auto_named=auto_named,
                                  **kwargs)
                       for i, array in enumerate(arrays)]
    except Exception as exc:
        if auto_named:
            _announce(engine, members, names, exc, group=group)
        raise
    return GroupHandle(group, engine.submit_group(entries))


# The arguments an allreduce group may carry and still take the fast path.
_FAST_GROUP_ARGUMENTS = frozenset({"reduce_op", "prescale_factor", "postscale_factor"})


def _group_names(kind: str, name: str | None, set_id: int, n: int) -> tuple[str, list[str]]:
    """The group's name and its members' names (unnamed groups take them from the counters)."""
    base = _auto_name(f"grouped_{kind}", set_id) if name is None else name
    members = ([_auto_name(kind, set_id) for _ in range(n)] if name is None
               else [f"{base}.{i}" for i in range(n)])
    return f"{base}.group{n}", members


def announcing_group(kind: str, items: str = "arrays"):
    """:func:`hvdlite.common.api.announce.announcing` for grouped operations (``items``: the
    argument holding the group's tensors): an unnamed group that fails before it is submitted
    takes the names the other ranks' group took, and fails there as one unit."""
    def announce(bound: dict, exc: Exception) -> None:
        try:
            count = len(bound[items])
        except Exception:   # noqa: BLE001 - not a sized group: nothing to pair
            return
        announce_group_failure(kind, bound.get("name"), bound.get("process_set"), count, exc)
    return announcing_with(announce)


@contextlib.contextmanager
def announced_group(kind: str, name: str | None, process_set: ProcessSet | None,
                    count: int) -> Iterator[None]:
    """:func:`hvdlite.common.api.announce.announced` for a group of ``count`` tensors."""
    try:
        yield
    except Exception as exc:
        announce_group_failure(kind, name, process_set, count, exc)
        raise


def announce_group_failure(kind: str, name: str | None, process_set: ProcessSet | None,
                           count: int, exc: BaseException) -> None:
    """:func:`hvdlite.common.api.announce.announce_failure` for an unnamed group of ``count``
    tensors."""
    if (name is not None or count == 0 or getattr(exc, "_hvdlite_announced", False)
            or isinstance(exc, _NOTHING_TO_ANNOUNCE)):
        return
    try:
        engine, members = registry.process_set_engine(process_set, f"grouped {kind}")
        set_id = 0 if members is None else process_set.process_set_id
    except Exception:   # noqa: BLE001 - nothing can be submitted here, so nothing is owed
        return
    group, names = _group_names(kind, None, set_id, count)
    _announce(engine, members, names, exc, group=group)


@announcing_group(ALLREDUCE)
def grouped_allreduce_async(arrays, average: bool | None = None, name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None) -> GroupHandle:
    """Allreduce a list of arrays as one unit; the handle yields a list of new arrays."""
    return submit_group(ALLREDUCE, [_contiguous(a) for a in arrays], name=name,
                        reduce_op=resolve_op(op, average), prescale_factor=prescale_factor,
                        postscale_factor=postscale_factor, process_set=process_set)


@announcing_group(ALLREDUCE)
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


@announcing_group(ALLGATHER)
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


@announcing_group(REDUCESCATTER)
def grouped_reducescatter_async(arrays, name: str | None = None, op: ReduceOp | None = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet | None = None) -> GroupHandle:
    """Reducescatter a list of arrays as one unit (see
    :func:`hvdlite.common.api.ops.reducescatter_async` for how rows are divided)."""
    return submit_group(REDUCESCATTER, [_contiguous(a) for a in arrays], name=name,
                        reduce_op=resolve_op(op), prescale_factor=prescale_factor,
                        postscale_factor=postscale_factor, process_set=process_set)


def grouped_reducescatter(arrays, name: str | None = None, op: ReduceOp | None = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Blocking :func:`grouped_reducescatter_async`."""
    return grouped_reducescatter_async(arrays, name, op, prescale_factor, postscale_factor,
                                       process_set).wait()
