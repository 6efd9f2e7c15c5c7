"""Gradients of the TensorFlow ops (Horovod's, as each op documents): the ``tf.custom_gradient``
plumbing every differentiable op uses, and the differentiable cores of allreduce, allgather and
reducescatter (one op or one group), which the public ops, the gradient tape and each other's
gradients share.  The gradients of broadcast and alltoall, used by one op each, stay beside that
op.

In a graph, a gradient op is named after its forward op (``<name>.grad``) and every gradient
returned depends on the last collective node its backward built (see :func:`_backward`).
"""
from __future__ import annotations

import tensorflow as tf

from hvdlite.common.core import ALLGATHER, ALLREDUCE, REDUCESCATTER, ReduceOp

from .graph import graph_node, last_node, node_label, set_static_shapes, sub_name
from .membership import rank_in, size_of
from .tensor_bridge import (collective_per_tensor, core_dtype, execute_each, gathered_shape,
                            grouped_collective, scattered_shape)


try:   # TensorFlow internals: whether any gradient tape or forward accumulator is active
    from tensorflow.python.eager.record import could_possibly_record as _could_record
except ImportError:   # moved in some release: always record, as before
    def _could_record() -> bool:
        return True


def is_differentiable(t) -> bool:
    """Whether a gradient can flow through ``t`` (a floating or complex dtype)."""
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
    before = last_node(graph)
    grads = backward_fn(xs, ys, dys)
    last = last_node(graph)
    if last is None or last is before:
        return grads
    with tf.control_dependencies([last]):
        return [None if g is None else tf.identity(g) for g in grads]


def with_custom_gradient(forward_fn, backward_fn, tensors: list) -> list:
    """``forward_fn(list) -> list`` with gradient ``backward_fn(xs, ys, dys) -> list`` over the
    differentiable members of ``tensors`` (the others get no gradient)."""
    diff = [i for i, t in enumerate(tensors) if is_differentiable(t)]
    if not diff or (tf.executing_eagerly() and not _could_record()):
        # Eagerly with no gradient tape or forward accumulator active nothing can ask for a
        # gradient, and tf.custom_gradient's eager wrapper costs ~0.3 ms per call.
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


def alltoall_with_gradient(forward_fn, backward_fn, tensor):
    """``forward_fn([x]) -> (y, received_splits)`` with gradient ``backward_fn`` for ``y``
    only (the received splits are integers): alltoall's two outputs, which
    :func:`with_custom_gradient` (one list of outputs) does not fit."""
    @tf.custom_gradient
    def forward(x):
        y, received = forward_fn([x])

        def grad(dy, *_unused):   # no gradient flows into received_splits (integers)
            dy = tf.zeros_like(y) if dy is None else dy
            return _backward(backward_fn, [x], [y, received], [dy])[0]

        return (y, received), grad

    y, received = forward(tensor)
    return y, received


# --- allreduce -------------------------------------------------------------------------------
def _allreduce_kwargs(op, prescale, postscale) -> dict:
    return {"reduce_op": op, "prescale_factor": prescale, "postscale_factor": postscale}


def differentiable_allreduce(tensors: list, name, op: ReduceOp, prescale: float, postscale: float,
                             process_set, grouped: bool, mismatch_hint: str | None = None) -> list:
    """Differentiable allreduce of ``tensors``: one op (``grouped=False``, one tensor) or one
    core group named ``name``."""
    kwargs = _allreduce_kwargs(op, prescale, postscale)

    def forward(xs):
        if grouped:
            return grouped_collective(ALLREDUCE, xs, name, kwargs, process_set,
                                      mismatch_hint=mismatch_hint)
        return collective_per_tensor(ALLREDUCE, xs, [name], kwargs, process_set)

    def backward(xs, ys, dys):
        _check_grad_op(op, "grouped_allreduce" if grouped else "allreduce")
        idx = [i for i, x in enumerate(xs) if is_differentiable(x)]
        reduced = differentiable_allreduce([dys[i] for i in idx], sub_name(name, "grad"), op,
                                           prescale, postscale, process_set, grouped)
        out = [None] * len(xs)
        for i, r in zip(idx, reduced):
            out[i] = r
        return out

    return with_custom_gradient(forward, backward, [tf.convert_to_tensor(t) for t in tensors])


# --- allgather -------------------------------------------------------------------------------
def _rows(x):
    return tf.reshape(tf.cast(tf.shape(tf.reshape(x, [-1]) if x.shape.rank == 0 else x)[0],
                              tf.int64), [1])


def differentiable_allgather(tensors: list, name, process_set, members, grouped: bool) -> list:
    """Differentiable allgather of ``tensors`` (one op, or one core group)."""
    def forward(xs):
        if grouped:
            return grouped_collective(ALLGATHER, xs, name, {}, process_set,
                                      [gathered_shape(x) for x in xs])
        return collective_per_tensor(ALLGATHER, xs, [name], {}, process_set)

    def backward(xs, ys, dys):
        # Horovod's gradient: this rank's rows of the average over the set of the upstream
        # gradients.
        idx = [i for i, x in enumerate(xs) if is_differentiable(x)]
        gname = sub_name(name, "grad")
        averaged = differentiable_allreduce([dys[i] for i in idx], gname, ReduceOp.Average, 1.0,
                                            1.0, process_set, grouped)
        rows = [_rows(xs[i]) for i in idx]
        if grouped:
            all_rows = grouped_collective(ALLGATHER, rows, sub_name(gname, "rows"), {}, process_set,
                                          [tf.TensorShape([size_of(members)])] * len(rows))
        else:
            all_rows = collective_per_tensor(ALLGATHER, rows, [sub_name(gname, "rows")], {},
                                             process_set)
        me = rank_in(members)
        out = [None] * len(xs)
        for i, a, r, ar in zip(idx, averaged, rows, all_rows):
            offset = tf.reduce_sum(ar[:me])
            out[i] = tf.reshape(a[offset:offset + r[0]], tf.shape(xs[i]))
        return out

    return with_custom_gradient(forward, backward, [tf.convert_to_tensor(t) for t in tensors])


# --- reducescatter ---------------------------------------------------------------------------
def differentiable_reducescatter(tensors: list, name, op: ReduceOp, prescale: float,
                                 postscale: float, process_set, members, grouped: bool) -> list:
    """Differentiable reducescatter of ``tensors`` (one op, or one core group)."""
    kwargs = _allreduce_kwargs(op, prescale, postscale)

    def forward(xs):
        shapes = [scattered_shape(x, members) for x in xs]
        if grouped:
            return grouped_collective(REDUCESCATTER, xs, name, kwargs, process_set, shapes)
        dtypes = [core_dtype(xs[0], f"reducescatter of {name or 'unnamed tensor'}")]
        all_kwargs = dict(kwargs, process_set=process_set)
        outs = graph_node(node_label(REDUCESCATTER, name),
                          lambda a: execute_each(REDUCESCATTER, [a], [name], dtypes, all_kwargs),
                          xs, [xs[0].dtype])
        set_static_shapes(outs, shapes)
        return outs

    def backward(xs, ys, dys):
        # Horovod's gradient: the allgather of the upstream gradients, each multiplied (in
        # this order) by the set's size for Sum, by prescale_factor and by postscale_factor.
        # Horovod does not divide by the size for Average.
        _check_grad_op(op, "grouped_reducescatter" if grouped else "reducescatter")
        idx = [i for i, x in enumerate(xs) if is_differentiable(x)]
        scaled = []
        for i in idx:
            g = dys[i]
            if op == ReduceOp.Sum:
                g = g * size_of(members)
            if prescale != 1.0:
                g = g * prescale
            if postscale != 1.0:
                g = g * postscale
            scaled.append(g)
        gathered = differentiable_allgather(scaled, sub_name(name, "grad"), process_set, members,
                                            grouped)
        out = [None] * len(xs)
        for i, g in zip(idx, gathered):
            out[i] = tf.reshape(g, tf.shape(xs[i]))
        return out

    return with_custom_gradient(forward, backward, tensors)
