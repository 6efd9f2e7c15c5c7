"""The public reducing and gathering ops on TensorFlow tensors: allreduce, allgather and
reducescatter, each also grouped (one negotiation, one graph node).  Their differentiable cores
and gradients are in :mod:`.autodiff`; how they run and are named, in :mod:`.mpi_ops`."""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from hvdlite.common.core import (ALLGATHER, ALLREDUCE, REDUCESCATTER, ProcessSet, ReduceOp,
                                 global_process_set, resolve_op)

from . import errors as tf_errors
from .autodiff import (differentiable_allgather, differentiable_allreduce,
                       differentiable_reducescatter)
from .compression import Compression
from .errors import public_op
from .graph import op_name, sub_name
from .membership import members_of, size_of


# --- allreduce -------------------------------------------------------------------------------
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
    base = op_name("allreduce", name, process_set)
    values = allgather(slices.values, name=sub_name(base, "values"), process_set=process_set)
    indices = allgather(slices.indices, name=sub_name(base, "indices"),
                        process_set=process_set)
    if op == ReduceOp.Average:
        values = values / tf.cast(size_of(members), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _check_adasum(op: ReduceOp, members, what: str) -> None:
    """Horovod raises NotImplementedError for Adasum on a number of ranks that is not a power
    of two (hvdlite's Adasum also runs on process sets of such a size)."""
    size = size_of(members)
    if op == ReduceOp.Adasum and size & (size - 1):
        raise NotImplementedError(
            f"{what}: op=Adasum needs a power-of-two number of ranks (1, 2, 4, 8, ...), but "
            f"the process set has {size}. Run on a power-of-two number of ranks or use "
            f"op=Average.")


@public_op(kind=ALLREDUCE)
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
    members = members_of(process_set, f"allreduce of {name or 'a tensor'}")
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, prescale_factor, postscale_factor,
                                 process_set, members)
    _check_adasum(op, members, f"allreduce of {name or 'a tensor'}")
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = differentiable_allreduce([compressed], op_name("allreduce", name, process_set), op,
                                       prescale_factor, postscale_factor, process_set,
                                       grouped=False)[0]
    return compression.decompress(reduced, ctx)


@public_op(kind=ALLREDUCE, items="tensors")
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
    members = members_of(process_set, f"grouped_allreduce of {name or 'tensors'}")
    op = resolve_op(op, average)
    out: list = [None] * len(tensors)
    dense_idx = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, sub_name(name, f"sparse.{i}"), op, prescale_factor,
                                       postscale_factor, process_set, members)
        else:
            dense_idx.append(i)
    if dense_idx:
        _check_adasum(op, members, f"grouped_allreduce of {name or 'tensors'}")
        compressed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense_idx]
        reduced = differentiable_allreduce([c for c, _ in compressed],
                                           op_name("grouped_allreduce", name, process_set), op,
                                           prescale_factor, postscale_factor, process_set,
                                           grouped=True)
        for i, r, (_, ctx) in zip(dense_idx, reduced, compressed):
            out[i] = compression.decompress(r, ctx)
    return out


# --- allgather -------------------------------------------------------------------------------
@public_op(kind=ALLGATHER)
def allgather(tensor, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet | None = global_process_set):
    """Concatenation of every rank's ``tensor`` along dimension 0, in rank order (the first
    dimension may differ between ranks; a scalar counts as one row).  Inside ``tf.function``
    the output's first dimension is unknown.  Differentiable, as in Horovod: the upstream
    gradient is averaged over the set, and each rank takes the rows that match its input."""
    members = members_of(process_set, f"allgather of {name or 'a tensor'}")
    tensor = tf.convert_to_tensor(tensor)
    return differentiable_allgather([tensor], op_name("allgather", name, process_set), process_set,
                                    members, grouped=False)[0]


@public_op(kind=ALLGATHER, items="tensors")
def grouped_allgather(tensors: Sequence, name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet | None = global_process_set) -> list:
    """Allgather a list of tensors as one group (one negotiation, one graph node); returns a
    list with one concatenated tensor per input (see :func:`allgather`).  Differentiable."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    members = members_of(process_set, f"grouped_allgather of {name or 'tensors'}")
    return differentiable_allgather(tensors, op_name("grouped_allgather", name, process_set),
                                    process_set, members, grouped=True)


# --- reducescatter ---------------------------------------------------------------------------
def _check_scatter_args(tensors: list, op: ReduceOp, what: str) -> None:
    if op == ReduceOp.Adasum:
        raise tf_errors.aborted(f"{what}: op=Adasum is not supported (Horovod's reducescatter "
                                f"supports only Average and Sum); use Sum or Average.")
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError(f"{what}: a scalar cannot be scattered; pass a tensor with at "
                             f"least one dimension (its rows are split across ranks).")


@public_op(kind=REDUCESCATTER)
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
    members = members_of(process_set, what)
    op = resolve_op(op)
    tensor = tf.convert_to_tensor(tensor)
    _check_scatter_args([tensor], op, what)
    compressed, ctx = compression.compress(tensor)
    out = differentiable_reducescatter([compressed], op_name("reducescatter", name, process_set),
                                       op, prescale_factor, postscale_factor, process_set,
                                       members, grouped=False)[0]
    return compression.decompress(out, ctx)


@public_op(kind=REDUCESCATTER, items="tensors")
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
    members = members_of(process_set, what)
    op = resolve_op(op)
    _check_scatter_args(tensors, op, what)
    compressed = [compression.compress(t) for t in tensors]
    outs = differentiable_reducescatter([c for c, _ in compressed],
                                        op_name("grouped_reducescatter", name, process_set), op,
                                        prescale_factor, postscale_factor, process_set, members,
                                        grouped=True)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]
