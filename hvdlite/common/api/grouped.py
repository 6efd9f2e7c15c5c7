"""Grouped operations: several tensors negotiated and executed as one unit.

A grouped operation (allreduce, allgather or reducescatter) is one operation under the group's
name: one request whose layout lists the members (validated member by member across ranks; an
allgather's members may differ in their first dimension), one response-cache slot, one handle,
one round; the data paths execute its members as they execute single tensors (small allreduces
of one dtype share one fused buffer).  If one member fails validation the whole group fails
with an error naming it.  A named host allreduce group's entries are kept from one submission to
the next (:class:`~hvdlite.common.api.submission.GroupTemplate`), so a training loop's step
builds and checks nothing per member again.
"""
from __future__ import annotations

import contextlib
import functools
import operator
from typing import Iterator, Sequence

import numpy as np

from hvdlite.common.api.announce import (NOTHING_TO_ANNOUNCE, announce_name, auto_name,
                                         announcing_with)
from hvdlite.common.api.submission import (GroupTemplate, contiguous, fast_host_allreduce_group,
                                          make_entry)
from hvdlite.common.engine.handle import Entry, GroupHandle
from hvdlite.common.engine.messages import ALLGATHER, ALLREDUCE, REDUCESCATTER, Request
from hvdlite.common.reduce_ops import ReduceOp, resolve_op
from hvdlite.common.runtime import lifecycle, registry
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
        return GroupHandle(name or f"grouped_{kind}", None)
    auto_named = name is None
    # Every member's name is taken before any is checked: if one fails in an unnamed group, all
    # are announced as failed, so the other ranks' group fails too and later names stay paired.
    group, names = _group_names(kind, name, set_id, n)
    template = None
    try:
        entries = None
        if (kind == ALLREDUCE and members is None and allocates is None
                and (dtypes is None or not any(dtypes))
                and kwargs.keys() <= _FAST_GROUP_ARGUMENTS):
            reduce_op = kwargs.get("reduce_op", ReduceOp.Sum)
            prescale = kwargs.get("prescale_factor", 1.0)
            postscale = kwargs.get("postscale_factor", 1.0)
            if not auto_named:
                template = _templates.pop(group, None)
                if template is not None:
                    entries = template.refill(arrays, outputs, reduce_op, prescale, postscale)
            if entries is None:
                template = None
                entries = fast_host_allreduce_group(arrays, outputs, names, reduce_op,
                                                    prescale, postscale)
                if (entries is not None and not auto_named
                        and (outputs is None or all(map(operator.is_, outputs, arrays)))):
                    template = GroupTemplate(group, entries,
                                             group_request(group, entries, True),
                                             outputs is not None, reduce_op, prescale, postscale)
        if entries is None:
            entries = [make_entry(engine, members, kind, array, name=names[i],
                                  output=None if outputs is None else outputs[i],
                                  allocate=None if allocates is None else allocates[i],
                                  dtype=None if dtypes is None else dtypes[i], set_id=set_id,
                                  auto_named=auto_named, **kwargs)
                       for i, array in enumerate(arrays)]
    except Exception as exc:
        if auto_named:
            announce_name(engine, members, group, exc)
        raise
    request = (template.request if template is not None
               else group_request(group, entries, not auto_named))
    entry = Entry(request, None, None, None, engine.new_handle(group))
    entry.members = entries
    handle = GroupHandle(group, engine.submit_group(entry))
    if template is not None:   # reusable once the results are taken (the group is complete)
        handle.then(functools.partial(_give_back, template))
    return handle


# Named host groups' templates, by group name, while not in flight (see GroupTemplate).
_templates: dict[str, GroupTemplate] = {}
_MAX_TEMPLATES = 1024


def _give_back(template: GroupTemplate, results: list) -> list:
    template.release()   # the results are the caller's now: hold none of their memory
    if len(_templates) < _MAX_TEMPLATES:
        _templates[template.group] = template
    return results


lifecycle.on_shutdown(_templates.clear)


# A member's entry in its group's layout: an itemgetter over the named fields (as fast as
# indexing, and it follows the fields if Request changes).
LAYOUT_FIELDS = ("name", "dtype", "shape", "device")
_layout_fields = operator.itemgetter(*(Request._fields.index(f) for f in LAYOUT_FIELDS))


def group_request(group: str, entries: list[Entry], cacheable: bool) -> Request:
    """The one request a grouped operation is negotiated as: named after the group, of its
    members' kind, with a layout that lists every member (name, dtype, shape, device),
    validated across ranks member by member; one response cache slot, one handle.  The
    members' own entries travel with it and are what the data paths execute (see
    ``Engine.submit_group``)."""
    first = entries[0].request
    return Request(group, first.kind, "", (), first.reduce_op, -1, -1, first.prescale,
                   first.postscale,
                   layout=tuple(map(_layout_fields, [e.request for e in entries])),
                   cacheable=cacheable)


# The arguments an allreduce group may carry and still take the fast path.
_FAST_GROUP_ARGUMENTS = frozenset({"reduce_op", "prescale_factor", "postscale_factor"})


def _group_names(kind: str, name: str | None, set_id: int, n: int) -> tuple[str, list[str]]:
    """The group's name and its members' names (unnamed groups take them from the counters)."""
    base = auto_name(f"grouped_{kind}", set_id) if name is None else name
    members = ([auto_name(kind, set_id) for _ in range(n)] if name is None
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
            or isinstance(exc, NOTHING_TO_ANNOUNCE)):
        return
    try:
        engine, members = registry.process_set_engine(process_set, f"grouped {kind}")
        set_id = 0 if members is None else process_set.process_set_id
    except Exception:   # noqa: BLE001 - nothing can be submitted here, so nothing is owed
        return
    group, _ = _group_names(kind, None, set_id, count)
    announce_name(engine, members, group, exc)   # the group is one request, named so


@announcing_group(ALLREDUCE)
def grouped_allreduce_async(arrays, average: bool | None = None, name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None) -> GroupHandle:
    """Allreduce a list of arrays as one unit; the handle yields a list of new arrays."""
    return submit_group(ALLREDUCE, [contiguous(a) for a in arrays], name=name,
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
        a = contiguous(a)
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
    return submit_group(REDUCESCATTER, [contiguous(a) for a in arrays], name=name,
                        reduce_op=resolve_op(op), prescale_factor=prescale_factor,
                        postscale_factor=postscale_factor, process_set=process_set)


def grouped_reducescatter(arrays, name: str | None = None, op: ReduceOp | None = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Blocking :func:`grouped_reducescatter_async`."""
    return grouped_reducescatter_async(arrays, name, op, prescale_factor, postscale_factor,
                                       process_set).wait()
