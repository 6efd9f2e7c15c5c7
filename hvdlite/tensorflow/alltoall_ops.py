"""The public alltoall op on TensorFlow tensors: rows scattered to every rank by ``splits``, with
Horovod's gradient (the alltoall of the output's gradient back to the senders)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvdlite.common.core import ALLTOALL, global_process_set, ProcessSet

from .autodiff import alltoall_with_gradient, is_differentiable
from .errors import public_op
from .graph import graph_node, node_label, op_name, set_static_shapes, sub_name
from .membership import members_of, size_of
from .tensor_bridge import core_dtype, execute_each, gathered_shape


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
    dtype = core_dtype(x, what)
    inputs = [x] if splits is None else [x, splits]
    kwargs = {"process_set": process_set}

    def fn(array, split_array=None):
        received, counts = execute_each(ALLTOALL, [array], [name], [dtype],
                                        dict(kwargs, splits=split_array))[0]
        return [received, np.asarray(counts, dtype=np.int32)]

    out, counts = graph_node(node_label(ALLTOALL, name), fn, inputs, [x.dtype, tf.int32])
    set_static_shapes([out, counts], [gathered_shape(x), tf.TensorShape([size_of(members)])])
    return out, counts


@public_op(kind=ALLTOALL)
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
    members = members_of(process_set, what)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError(f"{what}: a scalar cannot be split; pass a tensor with at least one "
                         f"dimension.")
    rows = tensor.shape[0] if tensor.shape.rank else None
    set_size = size_of(members)
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
    nm = op_name("alltoall", name, process_set)

    def forward(xs):
        return list(_alltoall_raw(xs[0], splits_t, nm, process_set, members))

    def backward(xs, ys, dys):
        grad, _ = _alltoall_raw(dys[0], ys[1], sub_name(nm, "grad"), process_set, members)
        return [tf.reshape(grad, tf.shape(xs[0]))]

    if is_differentiable(tensor):
        out, received = alltoall_with_gradient(forward, backward, tensor)
    else:
        out, received = forward([tensor])
    return out if splits is None else (out, received)
