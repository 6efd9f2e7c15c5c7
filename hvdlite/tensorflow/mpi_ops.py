"""Horovod-compatible collective ops on TensorFlow tensors, eager and inside ``tf.function``.

Eagerly, a CPU tensor goes to the core as ``tensor.numpy()`` (which shares the tensor's buffer)
and the result comes back with ``tf.convert_to_tensor``.  Inside a ``tf.function`` every call
becomes one stateful ``tf.numpy_function`` node that submits its tensor(s) and waits; the
function's automatic control dependencies (plus an explicit chain that hvdlite adds) run these
nodes in program order, so every rank executes its collectives in the same order.

Names.  Ranks match collectives by name.  ``name=None`` means:
  * eagerly: the core's per-kind call counter (``allreduce.noname.N``): unnamed ops must be
    issued in the same order on every rank, as in Horovod;
  * inside ``tf.function``: a name fixed when the function is traced,
    ``<kind>.tf.<function>.<k>``, with ``k`` counting the hvdlite ops of that traced graph in
    program order.  Identical programs trace identically on every rank, so the names agree; they
    are reused on every call of the function, which lets the core's response cache skip
    negotiation in steady state.
Gradient ops are named after their forward op (``<name>.grad``).

Errors of the core (e.g. ``TensorMismatchError``) are raised as they are in eager mode; inside a
``tf.function`` TensorFlow wraps them in a ``tf.errors`` exception whose message contains the
core's message unchanged.
"""
from __future__ import annotations

import itertools
import re
import weakref

import numpy as np
import tensorflow as tf

from hvdlite.common import basics
from hvdlite.common import ops as core
from hvdlite.common.dtypes import dtype_info
from hvdlite.common.messages import ALLGATHER, ALLREDUCE, BROADCAST
from hvdlite.common.reduce_ops import ReduceOp, resolve_op

from .compression import Compression

_graph_state: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _GraphState:
    __slots__ = ("counter", "last")

    def __init__(self) -> None:
        self.counter = itertools.count()
        self.last = None       # last hvdlite op created in this graph (explicit ordering)


def _state_of(graph) -> _GraphState:
    state = _graph_state.get(graph)
    if state is None:
        state = _graph_state[graph] = _GraphState()
    return state


def _graph_label(graph) -> str:
    name = getattr(graph, "name", "graph") or "graph"
    # Drop a trailing unique id (cond/while branch graphs get one) to stay equal across ranks.
    return re.sub(r"_\d+$", "", re.sub(r"[^A-Za-z0-9_.]", "_", name))


def _public(fn):
    """Decorator for the public ops: never converted by AutoGraph (they are plain Python that
    builds graph nodes), and errors raised while tracing reach the caller as the core's own
    exception (AutoGraph would otherwise re-wrap some of them as StagingError)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unchanged
            try:
                exc.ag_pass_through = True
            except AttributeError:
                pass
            raise

    return tf.autograph.experimental.do_not_convert(wrapper)


def _op_name(kind: str, name) -> str | None:
    """The name the core sees: the user's, or (inside tf.function) a trace-time derived one."""
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        return name
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    return f"{kind}.tf.{_graph_label(graph)}.{next(_state_of(graph).counter)}"


def _dtype_name(tensor, what: str) -> str:
    """Canonical core dtype name; raises the core's UnsupportedDtypeError for other dtypes."""
    dt = tensor.dtype
    try:
        np_dtype = dt.as_numpy_dtype
    except TypeError:
        np_dtype = dt.name
    if dt == tf.bfloat16:
        return dtype_info("bfloat16", what).name
    return dtype_info(np_dtype if not isinstance(np_dtype, str) else np_dtype, what).name


def _execute(kind: str, arrays, names, dtypes, kwargs) -> list[np.ndarray]:
    """Submit every array, then wait for all; raise the first error after all finished."""
    handles, error = [], None
    for array, name, dtype in zip(arrays, names, dtypes):
        array = np.asarray(array)
        if not array.flags.c_contiguous:   # (np.ascontiguousarray would turn 0-d into 1-d)
            array = np.ascontiguousarray(array).reshape(array.shape)
        try:
            handles.append(core.submit(kind, array, name=name, dtype=dtype, **kwargs))
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


def _kwargs(kind: str, op=None, prescale=1.0, postscale=1.0, root_rank=-1) -> dict:
    if kind == ALLREDUCE:
        return {"reduce_op": op, "prescale_factor": prescale, "postscale_factor": postscale}
    if kind == BROADCAST:
        return {"root_rank": root_rank}
    return {}


def _collective(kind: str, tensors: list, names: list, kwargs: dict) -> list:
    """Run one collective per tensor (submitted together, waited together)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    dtypes = [_dtype_name(t, f"{kind} of {n or 'unnamed tensor'}")
              for t, n in zip(tensors, names)]
    if kind == BROADCAST and not 0 <= kwargs["root_rank"] < basics.size():
        raise ValueError(f"broadcast: root_rank={kwargs['root_rank']} is out of range for a job "
                         f"of {basics.size()} ranks.")
    if tf.executing_eagerly():
        arrays = [np.asarray(t.numpy()) for t in tensors]
        outs = _execute(kind, arrays, names, dtypes, kwargs)
        return [tf.convert_to_tensor(o, dtype=t.dtype) for o, t in zip(outs, tensors)]

    def run(*arrays):
        outs = _execute(kind, arrays, names, dtypes, kwargs)
        return [np.asarray(o) for o in outs]

    graph = tf.compat.v1.get_default_graph()
    state = _state_of(graph)
    deps = [state.last] if state.last is not None else []
    label = re.sub(r"[^A-Za-z0-9_.]", "_", f"hvdlite_{kind}_{names[0] if names else ''}")[:60]
    with tf.control_dependencies(deps):
        outs = tf.numpy_function(run, tensors, [t.dtype for t in tensors], stateful=True,
                                 name=label)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    outs = list(outs)
    if outs:
        state.last = outs[0].op
    for out, t in zip(outs, tensors):
        if kind == ALLGATHER:
            if t.shape.rank is None:
                continue
            out.set_shape([None] + t.shape.as_list()[1:] if t.shape.rank else [None])
        else:
            out.set_shape(t.shape)
    return outs


def _differentiable(t) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def _grad_names(names):
    return [None if n is None else f"{n}.grad" for n in names]


# --- allreduce -------------------------------------------------------------------------------
def _grouped_allreduce_raw(tensors, names, op: ReduceOp, prescale: float, postscale: float):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    kwargs = _kwargs(ALLREDUCE, op, prescale, postscale)
    if not tensors:
        return []
    if not all(_differentiable(t) for t in tensors):
        return _collective(ALLREDUCE, tensors, names, kwargs)

    @tf.custom_gradient
    def forward(*xs):
        ys = _collective(ALLREDUCE, list(xs), names, kwargs)

        def grad(*dys):
            if op not in (ReduceOp.Average, ReduceOp.Sum):
                raise NotImplementedError(
                    f"hvdlite: the gradient of allreduce with op={ReduceOp(op).name} is not "
                    f"defined; use tf.stop_gradient on its input or use Sum/Average.")
            dys = [tf.zeros_like(x) if dy is None else dy for dy, x in zip(dys, xs)]
            return _grouped_allreduce_raw(dys, _grad_names(names), op, prescale, postscale)

        return ys, grad

    out = forward(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _sparse_allreduce(slices: tf.IndexedSlices, name, op: ReduceOp, prescale, postscale):
    """IndexedSlices: gather every rank's values and indices (Horovod's sparse allreduce)."""
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise NotImplementedError(f"allreduce of tf.IndexedSlices supports only Average and Sum, "
                                  f"not {ReduceOp(op).name}; pass sparse_as_dense=True or "
                                  f"convert with tf.convert_to_tensor.")
    base = _op_name("allreduce", name)
    values = allgather(slices.values, name=None if base is None else f"{base}.values")
    indices = allgather(slices.indices, name=None if base is None else f"{base}.indices")
    scale = prescale * postscale / (basics.size() if op == ReduceOp.Average else 1)
    if scale != 1.0:
        values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_public
def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=None, ignore_name_scope=False):
    """Reduce ``tensor`` across all ranks (default: average); returns a new tensor.

    ``op``: Average, Sum, Min, Max or Product (``average=`` is Horovod's deprecated spelling).
    ``prescale_factor`` multiplies the input before the reduction, ``postscale_factor`` the
    result.  ``tf.IndexedSlices`` are allgathered (values and indices).  Differentiable for
    Average/Sum: the gradient is the same allreduce of the upstream gradient.
    ``device_dense``/``device_sparse`` are accepted for compatibility (CPU only).
    """
    _no_process_sets(process_set)
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, prescale_factor, postscale_factor)
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _grouped_allreduce_raw([compressed], [_op_name("allreduce", name)], op,
                                     prescale_factor, postscale_factor)[0]
    return compression.decompress(reduced, ctx)


@_public
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None, name=None):
    """Allreduce a list of tensors as one group: all are submitted, then all are waited for
    (inside ``tf.function``: one graph node), so the core can fuse them."""
    _no_process_sets(process_set)
    op = resolve_op(op, average)
    tensors = list(tensors)
    out: list = [None] * len(tensors)
    dense_idx = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, None if name is None else f"{name}.{i}", op,
                                       prescale_factor, postscale_factor)
        else:
            dense_idx.append(i)
    compressed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense_idx]
    names = [_op_name("allreduce", None if name is None else f"{name}.{i}") for i in dense_idx]
    reduced = _grouped_allreduce_raw([c for c, _ in compressed], names, op, prescale_factor,
                                     postscale_factor)
    for i, r, (_, ctx) in zip(dense_idx, reduced, compressed):
        out[i] = compression.decompress(r, ctx)
    return out


# --- allgather -------------------------------------------------------------------------------
@_public
def allgather(tensor, name=None, process_set=None, ignore_name_scope=False):
    """Concatenation of every rank's ``tensor`` along dimension 0, in rank order (the first
    dimension may differ between ranks; a scalar counts as one row).  Differentiable: each rank
    gets the rows of the summed gradient that match its own input."""
    _no_process_sets(process_set)
    tensor = tf.convert_to_tensor(tensor)
    nm = _op_name("allgather", name)
    if not _differentiable(tensor):
        return _collective(ALLGATHER, [tensor], [nm], {})[0]

    @tf.custom_gradient
    def forward(x):
        y = _collective(ALLGATHER, [x], [nm], {})[0]

        def grad(dy):
            gname = None if nm is None else f"{nm}.grad"
            summed = _grouped_allreduce_raw([dy], [gname], ReduceOp.Sum, 1.0, 1.0)[0]
            rows = tf.reshape(tf.cast(tf.shape(tf.reshape(x, [-1]) if x.shape.rank == 0 else x)
                                      [0], tf.int64), [1])
            all_rows = _collective(ALLGATHER, [rows],
                                   [None if gname is None else f"{gname}.rows"], {})[0]
            offset = tf.reduce_sum(all_rows[:basics.rank()])
            mine = summed[offset:offset + rows[0]]
            return tf.reshape(mine, tf.shape(x))

        return y, grad

    return forward(tensor)


# --- broadcast -------------------------------------------------------------------------------
@_public
def broadcast(tensor, root_rank, name=None, process_set=None, ignore_name_scope=False):
    """Return ``root_rank``'s ``tensor`` on every rank.  Differentiable: the root receives the
    sum of every rank's gradient, the other ranks zeros."""
    _no_process_sets(process_set)
    tensor = tf.convert_to_tensor(tensor)
    nm = _op_name("broadcast", name)
    kwargs = _kwargs(BROADCAST, root_rank=root_rank)
    if not _differentiable(tensor):
        return _collective(BROADCAST, [tensor], [nm], kwargs)[0]

    @tf.custom_gradient
    def forward(x):
        y = _collective(BROADCAST, [x], [nm], kwargs)[0]

        def grad(dy):
            gname = None if nm is None else f"{nm}.grad"
            summed = _grouped_allreduce_raw([dy], [gname], ReduceOp.Sum, 1.0, 1.0)[0]
            return summed if basics.rank() == root_rank else tf.zeros_like(summed)

        return y, grad

    return forward(tensor)


def _var_label(v, i: int) -> str:
    label = getattr(v, "path", None) or getattr(v, "name", None) or "var"
    return f"{i}.{label}"


@_public
def broadcast_variables(variables, root_rank, process_set=None, inplace=False):
    """Assign ``root_rank``'s value to every variable (tf.Variable or Keras variable) on every
    rank.  All broadcasts are submitted together.  The variable list must be the same (same
    order, shapes, dtypes) on every rank.  Returns the group of assign ops in graph mode."""
    _no_process_sets(process_set)
    variables = list(variables)
    if not variables:
        return None
    base = _op_name("broadcast_variables", None) or "broadcast_variables"
    names = [f"{base}.{_var_label(v, i)}" for i, v in enumerate(variables)]
    values = _collective(BROADCAST, [_read(v) for v in variables], names,
                         _kwargs(BROADCAST, root_rank=root_rank))
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def _read(v):
    value = getattr(v, "value", None)
    if value is not None and not callable(value):
        v = value   # Keras 3 variable -> its tf.Variable
    return tf.convert_to_tensor(v)


# --- barrier and topology ops ----------------------------------------------------------------
@_public
def barrier(process_set=None):
    """Block until every rank reaches the barrier (a graph node inside tf.function)."""
    _no_process_sets(process_set)
    if tf.executing_eagerly():
        core.barrier()
        return None

    def run():
        core.barrier()
        return np.int32(0)

    graph = tf.compat.v1.get_default_graph()
    state = _state_of(graph)
    with tf.control_dependencies([state.last] if state.last is not None else []):
        out = tf.numpy_function(run, [], tf.int32, stateful=True, name="hvdlite_barrier")
    state.last = out.op
    return out


def size_op(process_set_id=0, name=None):
    """Number of ranks, as an int32 tensor."""
    return tf.constant(basics.size(), dtype=tf.int32, name=name)


def rank_op(name=None):
    return tf.constant(basics.rank(), dtype=tf.int32, name=name)


def local_size_op(name=None):
    return tf.constant(basics.local_size(), dtype=tf.int32, name=name)


def local_rank_op(name=None):
    return tf.constant(basics.local_rank(), dtype=tf.int32, name=name)


def cross_size_op(name=None):
    return tf.constant(basics.cross_size(), dtype=tf.int32, name=name)


def cross_rank_op(name=None):
    return tf.constant(basics.cross_rank(), dtype=tf.int32, name=name)


def _no_process_sets(process_set) -> None:
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise NotImplementedError("process sets are not available in hvdlite yet; omit "
                                  "process_set= to use all ranks.")
