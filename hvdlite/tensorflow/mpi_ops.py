"""Horovod-compatible collective ops on TensorFlow tensors: eagerly, inside ``tf.function``, and
in TF1-style graphs run by a ``tf.compat.v1.Session``.

Eagerly, a CPU tensor goes to the core as ``tensor.numpy()`` (which shares the tensor's buffer)
and the result comes back with ``tf.convert_to_tensor``.  In a graph every call becomes one
stateful ``tf.numpy_function`` node that submits its tensor(s) and waits (a grouped op is one
node that submits the whole group).  Each node has a control dependency on the graph's previous
one, so that every rank starts them in the same order (a ``tf.function`` runs them all; in a
TF1 graph, fetching a node also runs the nodes built before it, except the broadcasts of
variables, which stay out of that chain: see ``_chained``).

Names.  Ranks match collectives by name.  ``name=None`` means:
  * eagerly: the core's per-kind call counter (``allreduce.noname.N``): unnamed ops must be
    issued in the same order on every rank, as in Horovod;
  * in a graph: a name fixed when the op is created, ``<kind>.tf.<function>.<k>``, with ``k``
    counting the hvdlite ops of that graph in program order (ops on a process set other than
    the global one count separately and are named ``<kind>.tf.set<id>.<function>.<k>``, so
    that only members need to run them).  Identical programs trace identically on every rank,
    so the names agree; they are reused on every call of the function, which lets the core's
    response cache skip negotiation in steady state.
Gradient ops are named after their forward op (``<name>.grad``).  Gradients are Horovod's
(see each op); a graph's gradient always runs the collectives it was built with, on every rank.

Process sets.  Every op takes ``process_set`` (default :data:`global_process_set`, all ranks;
``None`` means the same).  Only members of a set may run ops on it; ``root_rank`` of a
broadcast is a global rank that must be a member; ``Average`` divides by the set's size.

Errors are Horovod's ``tf.errors`` classes (see :mod:`.errors`): eagerly a cross-rank mismatch
raises ``FailedPreconditionError`` (also a ``hvd.TensorMismatchError``); argument errors
(unknown process set, non-member rank, bad ``root_rank``, bad ``splits``, scalars where rows
are needed) raise ``InvalidArgumentError`` (also a ``ValueError``) when the op is created, also
while a graph is built.  Inside a graph TensorFlow reports a collective's failure by Python type
(a mismatch as ``InvalidArgumentError``), with hvdlite's message.
"""
from __future__ import annotations

import functools
import itertools
import re
import weakref
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

try:   # TensorFlow internals: tells whether a graph is being built for XLA
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:   # moved in some release: XLA then reports it itself
    GraphOrParentsInXlaContext = None

from hvdlite.common import core
from hvdlite.common.core import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, dtype_info,
                                 global_process_set, ProcessSet, ReduceOp, REDUCESCATTER,
                                 resolve_op, split_rows, TensorMismatchError)

from . import errors as tf_errors
from .compression import Compression

_graph_state: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _GraphState:
    __slots__ = ("counters", "last")

    def __init__(self) -> None:
        self.counters: dict[int, itertools.count] = {}   # process set id -> op counter
        self.last = None       # last chained hvdlite node of this graph (see _chained)

    def next_index(self, set_id: int) -> int:
        counter = self.counters.get(set_id)
        if counter is None:
            counter = self.counters[set_id] = itertools.count()
        return next(counter)


def _state_of(graph) -> _GraphState:
    state = _graph_state.get(graph)
    if state is None:
        state = _graph_state[graph] = _GraphState()
    return state


def _graph_label(graph) -> str:
    name = getattr(graph, "name", "graph") or "graph"
    # Drop a trailing unique id (cond/while branch graphs get one) to stay equal across ranks.
    return re.sub(r"_\d+$", "", re.sub(r"[^A-Za-z0-9_.]", "_", name))


# --- ordering of the graph nodes -----------------------------------------------------------------
# A node blocks a TensorFlow thread while its collective waits for the other ranks, so every
# rank must start its nodes in the same order: each node gets a control dependency on the
# graph's previous node (its chain).  TensorFlow's own order of independent nodes can differ
# between ranks (a TF1 session's executor does), so the chain is needed in TF1 graphs too,
# although there it makes a session.run that fetches a node also run the nodes built before it.
# The broadcasts of variables (broadcast_variables, broadcast_global_variables, broadcast_) stay
# out of a TF1 graph's chain: they are run on their own, typically once after the training step
# is built, and must not run (or need the feeds of) that step's collectives.
def _chained(graph) -> bool:
    """Whether a variables broadcast built now joins the chain (see above)."""
    return getattr(graph, "building_function", False)


def _last_node(graph):
    return _state_of(graph).last


def _public(fn):
    """Decorator for the public ops: never converted by AutoGraph (they are plain Python that
    builds graph nodes); errors reach the caller as Horovod's TensorFlow error classes (see
    :mod:`.errors`), raised directly (AutoGraph would otherwise re-wrap some of them as
    StagingError)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised as Horovod's class
            converted = tf_errors.to_tf_error(exc)
            try:
                converted.ag_pass_through = True
            except AttributeError:
                pass
            if converted is exc:
                raise
            raise converted from None

    return tf.autograph.experimental.do_not_convert(wrapper)


# --- process sets --------------------------------------------------------------------------------
def _is_global(process_set) -> bool:
    return process_set is None or (isinstance(process_set, ProcessSet)
                                   and process_set.process_set_id == 0)


def _members(process_set, what: str) -> list[int] | None:
    """Global ranks of ``process_set`` (None for the global set).  Raises the core's error
    if the set is not registered or this rank is not a member."""
    return core.process_set_engine(process_set, what)[1]


def _set_id(process_set) -> int:
    return 0 if _is_global(process_set) else int(process_set.process_set_id)


def _set_size(members: list[int] | None) -> int:
    return core.size() if members is None else len(members)


def _set_rank(members: list[int] | None) -> int:
    return core.rank() if members is None else members.index(core.rank())


# --- names, dtypes and graph nodes ----------------------------------------------------------------
def _op_name(kind: str, name, process_set=None) -> str | None:
    """The name the core sees: the user's, or (inside tf.function) a trace-time derived one."""
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        return name
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    set_id = _set_id(process_set)
    scope = "" if set_id == 0 else f"set{set_id}."
    return f"{kind}.tf.{scope}{_graph_label(graph)}.{_state_of(graph).next_index(set_id)}"


def _sub_name(name: str | None, suffix: str) -> str | None:
    return None if name is None else f"{name}.{suffix}"


def _dtype_name(tensor, what: str) -> str:
    """Canonical core dtype name; raises the core's UnsupportedDtypeError for other dtypes."""
    dt = tensor.dtype
    if dt == tf.bfloat16:
        return dtype_info("bfloat16", what).name
    try:
        np_dtype = dt.as_numpy_dtype
    except TypeError:
        np_dtype = dt.name
    return dtype_info(np_dtype, what).name


def _contiguous(array) -> np.ndarray:
    array = np.asarray(array)
    if not array.flags.c_contiguous:   # (np.ascontiguousarray would turn 0-d into 1-d)
        array = np.ascontiguousarray(array).reshape(array.shape)
    return array


def _execute(kind: str, arrays, names, dtypes, kwargs: dict) -> list:
    """Submit every array as its own op, then wait for all; raise the first error after all
    finished."""
    handles, error = [], None
    for array, name, dtype in zip(arrays, names, dtypes):
        try:
            handles.append(core.submit(kind, _contiguous(array), name=name, dtype=dtype,
                                       **kwargs))
        except Exception as exc:  # noqa: BLE001 - re-raised below once submitted ones finished
            error = exc
            break
    results = []
    for handle in handles:
        try:
            results.append(handle.wait())
        except Exception as exc:  # noqa: BLE001
            if error is None:
                error = exc
    if error is not None:
        raise error
    return results


def _execute_group(kind: str, arrays, name, dtypes, kwargs: dict) -> list:
    """Submit the arrays as one core group (negotiated and executed as a unit) and wait."""
    return core.submit_group(kind, [_contiguous(a) for a in arrays], name=name,
                                     dtypes=list(dtypes), **kwargs).wait()


def _label(kind: str, name) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", f"hvdlite_{kind}_{name or ''}")[:60]


def _node(label: str, fn: Callable[..., list], inputs: list, touts: list,
          chained: bool = True) -> list:
    """Run ``fn(*numpy inputs) -> list of numpy outputs`` now (eagerly) or as one stateful
    ``tf.numpy_function`` node, chained after the graph's previous hvdlite node unless
    ``chained`` is False (see _chained).  Eager failures are raised as Horovod's TF error
    classes."""
    if tf.executing_eagerly():
        try:
            outs = fn(*[np.asarray(t.numpy()) for t in inputs])
        except Exception as exc:  # noqa: BLE001 - re-raised as Horovod's class
            converted = tf_errors.to_tf_error(exc)
            if converted is exc:
                raise
            raise converted from None
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, touts)]

    def run(*arrays):
        return [np.asarray(o) for o in fn(*arrays)]

    graph = tf.compat.v1.get_default_graph()
    _refuse_xla(graph, label)
    state = _state_of(graph)
    deps = [state.last] if chained and state.last is not None else []
    with tf.control_dependencies(deps):
        outs = tf.numpy_function(run, inputs, touts, stateful=True, name=label)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if outs and chained:
        state.last = outs[0].op
    return outs


def _refuse_xla(graph, label: str) -> None:
    """Fail when traced for XLA (every rank traces alike, so every rank fails, before any
    collective): XLA cannot compile the Python node, and TensorFlow's own error (tf2xla
    conversion failed, deep in the first step) does not say why."""
    if GraphOrParentsInXlaContext is not None and GraphOrParentsInXlaContext(graph):
        raise NotImplementedError(
            f"hvdlite: the collective {label!r} cannot run inside an XLA-compiled function: "
            f"hvdlite's collectives run in Python, which XLA cannot compile. Pass "
            f"jit_compile=False to tf.function, or to model.compile (Keras's default "
            f"jit_compile=\"auto\" may pick XLA on a GPU).")


def _set_shapes(outs, shapes) -> None:
    if tf.executing_eagerly():
        return
    for out, shape in zip(outs, shapes):
        if shape is not None:
            out.set_shape(shape)


def _gathered_shape(t) -> tf.TensorShape | None:
    """Static shape of an allgather/alltoall output: first dimension unknown."""
    if t.shape.rank is None:
        return None
    return tf.TensorShape([None] + (t.shape.as_list()[1:] if t.shape.rank else []))


def _scattered_shape(t, members) -> tf.TensorShape | None:
    """Static shape of this rank's reducescatter output."""
    if t.shape.rank is None or t.shape.rank == 0:
        return None
    dims = t.shape.as_list()
    rows = dims[0]
    if rows is not None:
        rows = split_rows(rows, _set_size(members))[_set_rank(members)]
    return tf.TensorShape([rows] + dims[1:])


def _collective(kind: str, tensors: list, names: list, kwargs: dict,
                process_set=None, chained: bool = True) -> list:
    """One ``kind`` op per tensor (submitted together, waited together, one graph node)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    dtypes = [_dtype_name(t, f"{kind} of {n or 'unnamed tensor'}")
              for t, n in zip(tensors, names)]
    kwargs = dict(kwargs, process_set=process_set)

    def fn(*arrays):
        return _execute(kind, arrays, names, dtypes, kwargs)

    outs = _node(_label(kind, names[0]), fn, tensors, [t.dtype for t in tensors], chained)
    _set_shapes(outs, [_gathered_shape(t) if kind == ALLGATHER else t.shape for t in tensors])
    return outs


def _group(kind: str, tensors: list, name, kwargs: dict, process_set=None,
           shapes=None, mismatch_hint: str | None = None) -> list:
    """One grouped ``kind`` op over ``tensors`` (one graph node).  ``mismatch_hint`` is added
    to the message of a TensorMismatchError (what this rank knows about the likely cause)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    dtypes = [_dtype_name(t, f"grouped {kind} of {name or 'unnamed tensors'}.{i}")
              for i, t in enumerate(tensors)]
    kwargs = dict(kwargs, process_set=process_set)

    def fn(*arrays):
        try:
            return _execute_group(kind, arrays, name, dtypes, kwargs)
        except TensorMismatchError as exc:
            if mismatch_hint is None:
                raise
            raise TensorMismatchError(f"{exc}\n{mismatch_hint}") from exc

    outs = _node(_label(f"grouped_{kind}", name), fn, tensors, [t.dtype for t in tensors])
    _set_shapes(outs, shapes if shapes is not None else [t.shape for t in tensors])
    return outs


def _differentiable(t) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def _check_grad_op(op: ReduceOp, what: str) -> None:
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise NotImplementedError(
            f"hvdlite: the gradient of {what} with op={ReduceOp(op).name} is not defined; use "
            f"tf.stop_gradient on its input or use Sum/Average.")


def _backward(backward_fn, xs, ys, dys) -> list:
    """``backward_fn(xs, ys, dys)``; in a graph, every returned gradient also depends on the
    last collective node the backward created (those before it are chained to it).  A graph
    runs only what the fetched gradients need, and which nodes those are can differ between
    ranks (a broadcast's non-root gradient needs no collective; constant folding may drop one
    on some ranks only): without this, some ranks would skip a collective that others wait in
    for ever."""
    if tf.executing_eagerly():
        return backward_fn(xs, ys, dys)
    graph = tf.compat.v1.get_default_graph()
    before = _last_node(graph)
    grads = backward_fn(xs, ys, dys)
    last = _last_node(graph)
    if last is None or last is before:
        return grads
    with tf.control_dependencies([last]):
        return [None if g is None else tf.identity(g) for g in grads]


def _custom_gradient(forward_fn, backward_fn, tensors: list) -> list:
    """``forward_fn(list) -> list`` with gradient ``backward_fn(xs, ys, dys) -> list`` over the
    differentiable members of ``tensors`` (the others get no gradient)."""
    diff = [i for i, t in enumerate(tensors) if _differentiable(t)]
    if not diff:
        return forward_fn(tensors)

    @tf.custom_gradient
    def forward(*xs):
        ys = forward_fn(list(xs))

        def grad(*dys):
            dys = [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, ys)]
            return _backward(backward_fn, list(xs), ys, dys)

        return ys, grad

    out = forward(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


# --- allreduce -------------------------------------------------------------------------------
def _allreduce_kwargs(op, prescale, postscale) -> dict:
    return {"reduce_op": op, "prescale_factor": prescale, "postscale_factor": postscale}


def _allreduce_raw(tensors: list, name, op: ReduceOp, prescale: float, postscale: float,
                   process_set, grouped: bool, mismatch_hint: str | None = None) -> list:
    """Differentiable allreduce of ``tensors``: one op (``grouped=False``, one tensor) or one
    core group named ``name``."""
    kwargs = _allreduce_kwargs(op, prescale, postscale)

    def forward(xs):
        if grouped:
            return _group(ALLREDUCE, xs, name, kwargs, process_set,
                          mismatch_hint=mismatch_hint)
        return _collective(ALLREDUCE, xs, [name], kwargs, process_set)

    def backward(xs, ys, dys):
        _check_grad_op(op, "grouped_allreduce" if grouped else "allreduce")
        idx = [i for i, x in enumerate(xs) if _differentiable(x)]
        reduced = _allreduce_raw([dys[i] for i in idx], _sub_name(name, "grad"), op, prescale,
                                 postscale, process_set, grouped)
        out = [None] * len(xs)
        for i, r in zip(idx, reduced):
            out[i] = r
        return out

    return _custom_gradient(forward, backward, [tf.convert_to_tensor(t) for t in tensors])


def _sparse_allreduce(slices: tf.IndexedSlices, name, op: ReduceOp, prescale, postscale,
                      process_set, members):
    """IndexedSlices: gather every rank's values and indices, and divide the values by the set's
    size for Average (Horovod's sparse allreduce: ``values / size`` in the values' dtype, so
    integer values become floats, as TensorFlow's division makes them)."""
    if op == ReduceOp.Adasum:
        raise NotImplementedError("allreduce of tf.IndexedSlices: the Adasum reduction does not "
                                  "support sparse tensors; pass sparse_as_dense=True to the "
                                  "DistributedOptimizer (or convert with tf.convert_to_tensor).")
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise NotImplementedError(f"allreduce of tf.IndexedSlices supports only Average and Sum, "
                                  f"not {ReduceOp(op).name}; pass sparse_as_dense=True or "
                                  f"convert with tf.convert_to_tensor.")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(f"allreduce of tf.IndexedSlices: prescale_factor="
                                  f"{prescale} and postscale_factor={postscale} are not "
                                  f"supported with sparse tensors (as in Horovod); scale the "
                                  f"values yourself or convert with tf.convert_to_tensor.")
    base = _op_name("allreduce", name, process_set)
    values = allgather(slices.values, name=_sub_name(base, "values"), process_set=process_set)
    indices = allgather(slices.indices, name=_sub_name(base, "indices"),
                        process_set=process_set)
    if op == ReduceOp.Average:
        values = values / tf.cast(_set_size(members), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _check_adasum(op: ReduceOp, members, what: str) -> None:
    """Horovod raises NotImplementedError for Adasum on a number of ranks that is not a power
    of two (hvdlite's Adasum also runs on process sets of such a size)."""
    size = _set_size(members)
    if op == ReduceOp.Adasum and size & (size - 1):
        raise NotImplementedError(
            f"{what}: op=Adasum needs a power-of-two number of ranks (1, 2, 4, 8, ...), but "
            f"the process set has {size}. Run on a power-of-two number of ranks or use "
            f"op=Average.")


@_public
def allreduce(tensor, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression=Compression.none,
              op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet | None = global_process_set,
              ignore_name_scope: bool = False):
    """Reduce ``tensor`` across the ranks of ``process_set`` (default: average over all ranks);
    returns a new tensor of the same shape and dtype.

    ``op``: Average, Sum, Min, Max, Product or Adasum (float tensors, power-of-two number of
    ranks); ``average=`` is Horovod's deprecated spelling.  ``prescale_factor`` multiplies the
    input before the reduction, ``postscale_factor`` the result.  ``tf.IndexedSlices`` are
    allgathered (values and indices; Average and Sum only, no scale factors, as in Horovod);
    Average divides the gathered values by the set's size in TensorFlow, so integer values
    become floats.  Differentiable for Average/Sum: the gradient is the same allreduce of the
    upstream gradient (other ops raise NotImplementedError when differentiated).
    ``device_dense``/``device_sparse`` and ``ignore_name_scope`` are accepted for compatibility
    (CPU only; names ignore scopes).
    """
    members = _members(process_set, f"allreduce of {name or 'a tensor'}")
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, prescale_factor, postscale_factor,
                                 process_set, members)
    _check_adasum(op, members, f"allreduce of {name or 'a tensor'}")
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce_raw([compressed], _op_name("allreduce", name, process_set), op,
                             prescale_factor, postscale_factor, process_set, grouped=False)[0]
    return compression.decompress(reduced, ctx)


@_public
def grouped_allreduce(tensors: Sequence, average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression=Compression.none,
                      op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list:
    """Allreduce a list of tensors as one group: the core negotiates and executes them as one
    unit (inside ``tf.function``: one graph node), fusing small ones.  Arguments as in
    :func:`allreduce`; ``tf.IndexedSlices`` entries are allgathered (as in :func:`allreduce`),
    wherever they are in the list.  Returns a list."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    members = _members(process_set, f"grouped_allreduce of {name or 'tensors'}")
    op = resolve_op(op, average)
    out: list = [None] * len(tensors)
    dense_idx = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, _sub_name(name, f"sparse.{i}"), op, prescale_factor,
                                       postscale_factor, process_set, members)
        else:
            dense_idx.append(i)
    if dense_idx:
        _check_adasum(op, members, f"grouped_allreduce of {name or 'tensors'}")
        compressed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense_idx]
        reduced = _allreduce_raw([c for c, _ in compressed],
                                 _op_name("grouped_allreduce", name, process_set), op,
                                 prescale_factor, postscale_factor, process_set, grouped=True)
        for i, r, (_, ctx) in zip(dense_idx, reduced, compressed):
            out[i] = compression.decompress(r, ctx)
    return out


# --- allgather -------------------------------------------------------------------------------
def _rows(x):
    return tf.reshape(tf.cast(tf.shape(tf.reshape(x, [-1]) if x.shape.rank == 0 else x)[0],
                              tf.int64), [1])


def _allgather_raw(tensors: list, name, process_set, members, grouped: bool) -> list:
    """Differentiable allgather of ``tensors`` (one op, or one core group)."""
    def forward(xs):
        if grouped:
            return _group(ALLGATHER, xs, name, {}, process_set,
                          [_gathered_shape(x) for x in xs])
        return _collective(ALLGATHER, xs, [name], {}, process_set)

    def backward(xs, ys, dys):
        # Horovod's gradient: this rank's rows of the average over the set of the upstream
        # gradients.
        idx = [i for i, x in enumerate(xs) if _differentiable(x)]
        gname = _sub_name(name, "grad")
        averaged = _allreduce_raw([dys[i] for i in idx], gname, ReduceOp.Average, 1.0, 1.0,
                                  process_set, grouped)
        rows = [_rows(xs[i]) for i in idx]
        if grouped:
            all_rows = _group(ALLGATHER, rows, _sub_name(gname, "rows"), {}, process_set,
                              [tf.TensorShape([_set_size(members)])] * len(rows))
        else:
            all_rows = _collective(ALLGATHER, rows, [_sub_name(gname, "rows")], {},
                                   process_set)
        me = _set_rank(members)
        out = [None] * len(xs)
        for i, a, r, ar in zip(idx, averaged, rows, all_rows):
            offset = tf.reduce_sum(ar[:me])
            out[i] = tf.reshape(a[offset:offset + r[0]], tf.shape(xs[i]))
        return out

    return _custom_gradient(forward, backward, [tf.convert_to_tensor(t) for t in tensors])


@_public
def allgather(tensor, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet | None = global_process_set):
    """Concatenation of every rank's ``tensor`` along dimension 0, in rank order (the first
    dimension may differ between ranks; a scalar counts as one row).  Inside ``tf.function``
    the output's first dimension is unknown.  Differentiable, as in Horovod: the upstream
    gradient is averaged over the set, and each rank takes the rows that match its input."""
    members = _members(process_set, f"allgather of {name or 'a tensor'}")
    tensor = tf.convert_to_tensor(tensor)
    return _allgather_raw([tensor], _op_name("allgather", name, process_set), process_set,
                          members, grouped=False)[0]


@_public
def grouped_allgather(tensors: Sequence, name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet | None = global_process_set) -> list:
    """Allgather a list of tensors as one group (one negotiation, one graph node); returns a
    list with one concatenated tensor per input (see :func:`allgather`).  Differentiable."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    members = _members(process_set, f"grouped_allgather of {name or 'tensors'}")
    return _allgather_raw(tensors, _op_name("grouped_allgather", name, process_set),
                          process_set, members, grouped=True)


# --- broadcast -------------------------------------------------------------------------------
def _check_root(root_rank, members, what: str) -> int:
    try:
        root = int(root_rank)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: root_rank must be an int, got {root_rank!r}") from None
    if members is None:
        if not 0 <= root < core.size():
            raise ValueError(f"{what}: root_rank={root} is out of range for a job of "
                             f"{core.size()} ranks.")
    elif root not in members:
        raise ValueError(f"{what}: root_rank={root} is not a member of the process set "
                         f"(global ranks {members}); root_rank is a global rank.")
    return root


@_public
def broadcast(tensor, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet | None = global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank of ``process_set`` (``root_rank`` is a
    global rank, a member of the set).  Differentiable, as in Horovod: the root receives the
    average over the set of the upstream gradients, the other ranks that average times 0."""
    what = f"broadcast of {name or 'a tensor'}"
    members = _members(process_set, what)
    root_rank = _check_root(root_rank, members, what)
    tensor = tf.convert_to_tensor(tensor)
    nm = _op_name("broadcast", name, process_set)
    kwargs = {"root_rank": root_rank}

    def forward(xs):
        return _collective(BROADCAST, xs, [nm], kwargs, process_set)

    def backward(xs, ys, dys):
        averaged = _allreduce_raw(dys, _sub_name(nm, "grad"), ReduceOp.Average, 1.0, 1.0,
                                  process_set, grouped=False)[0]
        # "* 0", not zeros: Horovod's numbers (a non-finite average stays NaN).
        return [averaged if core.rank() == root_rank else averaged * 0]

    return _custom_gradient(forward, backward, [tensor])[0]


def _var_label(v, i: int) -> str:
    label = getattr(v, "path", None) or getattr(v, "name", None) or "var"
    return f"{i}.{label}"


def _broadcast_assign(variables: list, root_rank, base: str, process_set, what: str) -> list:
    """Broadcast every variable's value from ``root_rank`` (submitted together) and assign it;
    returns the assign ops (None where the variable type returns none)."""
    members = _members(process_set, what)
    root_rank = _check_root(root_rank, members, what)
    names = [f"{base}.{_var_label(v, i)}" for i, v in enumerate(variables)]
    chained = tf.executing_eagerly() or _chained(tf.compat.v1.get_default_graph())
    values = _collective(BROADCAST, [_read(v) for v in variables], names,
                         {"root_rank": root_rank}, process_set, chained)
    return [v.assign(x) for v, x in zip(variables, values)]


@_public
def broadcast_variables(variables, root_rank: int,
                        process_set: ProcessSet | None = global_process_set,
                        inplace: bool = False):
    """Assign ``root_rank``'s value to every variable (tf.Variable or Keras variable) on every
    rank of ``process_set``.  All broadcasts are submitted together.  The variable list must be
    the same (same order, shapes, dtypes) on every rank.  Returns the group of assign ops in
    graph mode.  ``inplace`` is accepted for Horovod compatibility: hvdlite always assigns in
    place."""
    variables = list(variables)
    if not variables:
        return None
    base = _op_name("broadcast_variables", None, process_set) or "broadcast_variables"
    assigns = _broadcast_assign(variables, root_rank, base, process_set, "broadcast_variables")
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


@_public
def broadcast_(variables, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = global_process_set) -> list:
    """In-place broadcast (Horovod's ``hvd.broadcast_``): assign ``root_rank``'s value of every
    variable in ``variables`` (a list of tf.Variable or Keras variables, or one variable) to
    that variable on every rank of ``process_set``, and return the updated values as a list of
    tensors (in graph mode they read the variables after the assignments).  The ops are keyed
    by ``name`` combined with each variable's position and name, so the list must be the same
    (same order, shapes, dtypes) on every rank."""
    variables = list(variables) if isinstance(variables, (list, tuple)) else [variables]
    if not variables:
        return []
    base = _op_name("broadcast_", name, process_set) or "broadcast_"
    assigns = _broadcast_assign(variables, root_rank, base, process_set, f"broadcast_ {base}")
    if tf.executing_eagerly():
        return [_read(v) for v in variables]
    with tf.control_dependencies([a for a in assigns if a is not None]):
        return [tf.identity(_read(v)) for v in variables]


def _read(v):
    value = getattr(v, "value", None)
    if value is not None and not callable(value):
        v = value   # Keras 3 variable -> its tf.Variable
    return tf.convert_to_tensor(v)


# --- alltoall --------------------------------------------------------------------------------
def _splits_tensor(splits, set_size: int, rows: int | None, what: str):
    """``splits`` as a 1-D integer tensor, checked as far as it is known now."""
    if splits is None:
        return None
    if not isinstance(splits, (tf.Tensor, tf.Variable)):
        values = np.asarray(splits)
        if values.dtype.kind not in "iu" and values.size:
            raise ValueError(f"{what}: splits must be integers, got {list(values.reshape(-1))}.")
        values = values.astype(np.int64).reshape(-1)
        if values.shape[0] != set_size or (values < 0).any():
            raise ValueError(f"{what}: splits {values.tolist()} must have one non-negative "
                             f"entry per rank of the process set ({set_size}).")
        if rows is not None and int(values.sum()) > rows:
            raise ValueError(f"{what}: splits {values.tolist()} sum to {int(values.sum())}, "
                             f"more than the first dimension ({rows}).")
        return tf.constant(values, dtype=tf.int64)
    splits = tf.convert_to_tensor(splits)
    if not splits.dtype.is_integer:
        raise ValueError(f"{what}: splits must be an integer tensor, got {splits.dtype.name}.")
    if splits.shape.rank is not None and splits.shape.num_elements() is not None \
            and splits.shape.num_elements() != set_size:
        raise ValueError(f"{what}: splits has {splits.shape.num_elements()} entries; it needs "
                         f"one per rank of the process set ({set_size}).")
    return splits


def _alltoall_raw(x, splits, name, process_set, members):
    """(output, received_splits) of one alltoall; ``splits`` is a tensor or None."""
    what = f"alltoall of {name or 'unnamed tensor'}"
    dtype = _dtype_name(x, what)
    inputs = [x] if splits is None else [x, splits]
    kwargs = {"process_set": process_set}

    def fn(array, split_array=None):
        received, counts = _execute(ALLTOALL, [array], [name], [dtype],
                                    dict(kwargs, splits=split_array))[0]
        return [received, np.asarray(counts, dtype=np.int32)]

    out, counts = _node(_label(ALLTOALL, name), fn, inputs, [x.dtype, tf.int32])
    _set_shapes([out, counts], [_gathered_shape(x), tf.TensorShape([_set_size(members)])])
    return out, counts


@_public
def alltoall(tensor, splits=None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet | None = global_process_set):
    """Scatter slices of ``tensor`` to every rank of ``process_set`` and gather the slices the
    other ranks sent to this one.

    ``splits`` (a list or 1-D integer tensor, one entry per rank of the set) says how many rows
    (along dimension 0, in order) go to each rank; rows past their sum are not sent, as in
    Horovod.  Without it the first dimension is divided evenly (it must then be divisible by
    the set's size).  The output holds the received rows in rank order; the other dimensions
    must match across ranks.  Returns the output, or ``(output, received_splits)`` (an int32
    tensor: rows received from each rank) when ``splits`` is given, as Horovod does.  Inside
    ``tf.function`` the output's first dimension is unknown.  Differentiable, as in Horovod:
    the gradient is the alltoall of the output's gradient with the received splits (each
    received row's gradient goes back to its sender).  Bad splits raise
    ``tf.errors.InvalidArgumentError``.
    """
    what = f"alltoall of {name or 'a tensor'}"
    members = _members(process_set, what)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError(f"{what}: a scalar cannot be split; pass a tensor with at least one "
                         f"dimension.")
    rows = tensor.shape[0] if tensor.shape.rank else None
    set_size = _set_size(members)
    splits_t = _splits_tensor(splits, set_size, rows, what)
    if splits_t is None and rows is not None and rows % set_size:
        raise ValueError(f"{what}: without splits the first dimension ({rows}) must be "
                         f"divisible by the number of ranks ({set_size}); pass "
                         f"splits=[rows for each rank].")
    if splits_t is not None:
        # As in Horovod, splits may cover fewer rows than the tensor has: the rest stay here
        # (and get a zero gradient).
        if isinstance(splits, (tf.Tensor, tf.Variable)) or rows is None:
            tensor = tensor[:tf.cast(tf.reduce_sum(splits_t), tf.int32)]
        elif int(np.sum(splits)) < rows:
            tensor = tensor[:int(np.sum(splits))]
    nm = _op_name("alltoall", name, process_set)

    def forward(xs):
        return list(_alltoall_raw(xs[0], splits_t, nm, process_set, members))

    def backward(xs, ys, dys):
        grad, _ = _alltoall_raw(dys[0], ys[1], _sub_name(nm, "grad"), process_set, members)
        return [tf.reshape(grad, tf.shape(xs[0]))]

    if _differentiable(tensor):
        out, received = _alltoall_grad_wrapper(forward, backward, tensor)
    else:
        out, received = forward([tensor])
    return out if splits is None else (out, received)


def _alltoall_grad_wrapper(forward_fn, backward_fn, tensor):
    @tf.custom_gradient
    def forward(x):
        y, received = forward_fn([x])

        def grad(dy, *_unused):   # no gradient flows into received_splits (integers)
            dy = tf.zeros_like(y) if dy is None else dy
            return _backward(backward_fn, [x], [y, received], [dy])[0]

        return (y, received), grad

    y, received = forward(tensor)
    return y, received


# --- reducescatter ---------------------------------------------------------------------------
def _check_scatter_args(tensors: list, op: ReduceOp, what: str) -> None:
    if op == ReduceOp.Adasum:
        raise tf_errors.aborted(f"{what}: op=Adasum is not supported (Horovod's reducescatter "
                                f"supports only Average and Sum); use Sum or Average.")
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError(f"{what}: a scalar cannot be scattered; pass a tensor with at "
                             f"least one dimension (its rows are split across ranks).")


def _reducescatter_raw(tensors: list, name, op: ReduceOp, prescale: float, postscale: float,
                       process_set, members, grouped: bool) -> list:
    """Differentiable reducescatter of ``tensors`` (one op, or one core group)."""
    kwargs = _allreduce_kwargs(op, prescale, postscale)

    def forward(xs):
        shapes = [_scattered_shape(x, members) for x in xs]
        if grouped:
            return _group(REDUCESCATTER, xs, name, kwargs, process_set, shapes)
        dtypes = [_dtype_name(xs[0], f"reducescatter of {name or 'unnamed tensor'}")]
        all_kwargs = dict(kwargs, process_set=process_set)
        outs = _node(_label(REDUCESCATTER, name),
                     lambda a: _execute(REDUCESCATTER, [a], [name], dtypes, all_kwargs),
                     xs, [xs[0].dtype])
        _set_shapes(outs, shapes)
        return outs

    def backward(xs, ys, dys):
        # Horovod's gradient: the allgather of the upstream gradients, each multiplied (in
        # this order) by the set's size for Sum, by prescale_factor and by postscale_factor.
        # Horovod does not divide by the size for Average.
        _check_grad_op(op, "grouped_reducescatter" if grouped else "reducescatter")
        idx = [i for i, x in enumerate(xs) if _differentiable(x)]
        scaled = []
        for i in idx:
            g = dys[i]
            if op == ReduceOp.Sum:
                g = g * _set_size(members)
            if prescale != 1.0:
                g = g * prescale
            if postscale != 1.0:
                g = g * postscale
            scaled.append(g)
        gathered = _allgather_raw(scaled, _sub_name(name, "grad"), process_set, members, grouped)
        out = [None] * len(xs)
        for i, g in zip(idx, gathered):
            out[i] = tf.reshape(g, tf.shape(xs[i]))
        return out

    return _custom_gradient(forward, backward, tensors)


@_public
def reducescatter(tensor, device_dense: str = "", compression=Compression.none,
                  op: ReduceOp | int | None = ReduceOp.Average, name: str | None = None,
                  process_set: ProcessSet | None = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0):
    """Reduce ``tensor`` (same shape on every rank) across ``process_set`` and return this
    rank's share of the rows.

    ``op``: Average (default), Sum, Min, Max or Product; ``prescale_factor`` multiplies the
    input before the reduction, ``postscale_factor`` the result.  With R rows and N ranks the
    first R % N ranks of the set get R // N + 1 rows and the others R // N (Horovod's rule); the
    other dimensions are kept.  Differentiable for Sum/Average, as in Horovod: the gradient of
    the input is the allgather of every rank's output gradient, times the set's size for Sum and
    times ``prescale_factor`` and ``postscale_factor`` (Horovod does not divide by the size for
    Average).  ``op=Adasum`` raises ``tf.errors.AbortedError`` (Horovod's class).
    """
    what = f"reducescatter of {name or 'a tensor'}"
    members = _members(process_set, what)
    op = resolve_op(op)
    tensor = tf.convert_to_tensor(tensor)
    _check_scatter_args([tensor], op, what)
    compressed, ctx = compression.compress(tensor)
    out = _reducescatter_raw([compressed], _op_name("reducescatter", name, process_set), op,
                             prescale_factor, postscale_factor, process_set, members,
                             grouped=False)[0]
    return compression.decompress(out, ctx)


@_public
def grouped_reducescatter(tensors: Sequence, device_dense: str = "",
                          compression=Compression.none,
                          op: ReduceOp | int | None = ReduceOp.Average,
                          process_set: ProcessSet | None = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None, ignore_name_scope: bool = False) -> list:
    """Reducescatter a list of tensors as one group (one negotiation, one graph node); returns
    one tensor per input, each split by rows as in :func:`reducescatter`.  Differentiable for
    Sum/Average."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    what = f"grouped_reducescatter of {name or 'tensors'}"
    members = _members(process_set, what)
    op = resolve_op(op)
    _check_scatter_args(tensors, op, what)
    compressed = [compression.compress(t) for t in tensors]
    outs = _reducescatter_raw([c for c, _ in compressed],
                              _op_name("grouped_reducescatter", name, process_set), op,
                              prescale_factor, postscale_factor, process_set, members,
                              grouped=True)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


# --- barrier, join and topology ops ----------------------------------------------------------
def _control_op(label: str, fn: Callable[[], int]):
    """Eager: run ``fn`` now; graph: one chained node.  Returns an int32 scalar tensor."""
    out = _node(label, lambda: [np.int32(fn())], [], [tf.int32])[0]
    _set_shapes([out], [tf.TensorShape([])])
    return out


@_public
def barrier(process_set: ProcessSet | None = global_process_set):
    """Block until every rank of ``process_set`` reaches the barrier.  Eagerly returns None;
    inside ``tf.function`` it is a graph node (returned, an int32 scalar)."""
    _members(process_set, "barrier")
    if tf.executing_eagerly():
        core.barrier(process_set)
        return None

    def run() -> int:
        core.barrier(process_set)
        return 0

    return _control_op("hvdlite_barrier", run)


@_public
def join(process_set: ProcessSet | None = global_process_set):
    """Declare that this rank has run out of data and block until every rank (of
    ``process_set``) has joined.

    Until then this rank keeps taking part in the other ranks' allreduces, contributing zeros
    (so Average still divides by the full number of ranks, as in Horovod); other collectives
    cannot run while a rank is joined.  Returns an int32 scalar tensor: the global rank of the
    last rank to join (eagerly and inside ``tf.function``).
    """
    _members(process_set, "join")
    return _control_op("hvdlite_join", lambda: core.join(process_set))


# Horovod's size_op and process_set_included_op return this code for an unknown process set.
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _set_ranks(process_set_id: int) -> list[int] | None:
    return core.get_process_set_ids_and_ranks().get(int(process_set_id))


@_public
def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """Number of ranks in the process set ``process_set_id`` (default: the job), as an int32
    tensor; -3 for a set id that is not registered (Horovod's error code).  The value is
    fixed when the op is created (Horovod's op reads it when it runs)."""
    if process_set_id == 0:
        return tf.constant(core.size(), dtype=tf.int32, name=name)
    ranks = _set_ranks(process_set_id)
    size = PROCESS_SET_ERROR_UNKNOWN_SET if ranks is None else len(ranks)
    return tf.constant(size, dtype=tf.int32, name=name)


@_public
def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank is a member of the process set ``process_set_id``, else 0 (int32); -3
    for a set id that is not registered (Horovod's error code)."""
    if process_set_id == 0:
        included = 1
    else:
        ranks = _set_ranks(process_set_id)
        included = (PROCESS_SET_ERROR_UNKNOWN_SET if ranks is None
                    else int(core.rank() in ranks))
    return tf.constant(included, dtype=tf.int32, name=name)


@_public
def rank_op(name: str | None = None) -> tf.Tensor:
    """This rank (int32 tensor)."""
    return tf.constant(core.rank(), dtype=tf.int32, name=name)


@_public
def local_size_op(name: str | None = None) -> tf.Tensor:
    """Number of ranks on this host (int32 tensor)."""
    return tf.constant(core.local_size(), dtype=tf.int32, name=name)


@_public
def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This rank's index on its host (int32 tensor)."""
    return tf.constant(core.local_rank(), dtype=tf.int32, name=name)


@_public
def cross_size_op(name: str | None = None) -> tf.Tensor:
    """Number of hosts (int32 tensor)."""
    return tf.constant(core.cross_size(), dtype=tf.int32, name=name)


@_public
def cross_rank_op(name: str | None = None) -> tf.Tensor:
    """This host's index (int32 tensor)."""
    return tf.constant(core.cross_rank(), dtype=tf.int32, name=name)
