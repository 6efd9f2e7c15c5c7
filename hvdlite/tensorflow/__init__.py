"""TensorFlow 2 adapter with Horovod's API: ``import hvdlite.tensorflow as hvd``.

A Horovod TensorFlow script runs after changing ``import horovod.tensorflow as hvd`` to this
import.  Ops work eagerly, inside ``tf.function`` and in TF1 graphs run by a
``tf.compat.v1.Session`` (see :mod:`hvdlite.tensorflow.mpi_ops` for how unnamed ops are named in
graphs); errors are Horovod's ``tf.errors`` classes (see :mod:`hvdlite.tensorflow.errors`).
Keras users import :mod:`hvdlite.tensorflow.keras`.
"""
import tensorflow as _tf

from hvdlite.common.core import (allgather_object as _common_allgather_object,
                                 broadcast_object as _common_broadcast_object, resolve_op)
from hvdlite.common.core import *  # noqa: F401,F403 - the shared API

from .compression import Compression
from .mpi_ops import (allreduce, grouped_allreduce, allgather, grouped_allgather, broadcast,
                      broadcast_, broadcast_variables, alltoall, reducescatter,
                      grouped_reducescatter, barrier, join, size_op, process_set_included_op,
                      rank_op, local_size_op, local_rank_op, cross_size_op, cross_rank_op)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from . import elastic  # noqa: F401 - hvd.elastic.*: Horovod's elastic API
from .sync_batch_norm import SyncBatchNormalization


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap an optimizer so that gradients are averaged across ranks before they are applied:
    a Keras optimizer (see :func:`hvdlite.tensorflow.keras.DistributedOptimizer`) or, as in
    Horovod, a TF1-style ``tf.compat.v1.train.Optimizer`` (its ``compute_gradients``, which
    ``minimize`` calls, returns the averaged gradients; in TF1 graphs and eagerly)."""
    if isinstance(optimizer, _tf.compat.v1.train.Optimizer):
        return _legacy_optimizer(optimizer, name, use_locking, compression, sparse_as_dense,
                                 backward_passes_per_step, op, gradient_predivide_factor,
                                 num_groups, groups, process_set, scale_local_gradients)
    from .keras import DistributedOptimizer as _keras_distributed
    return _keras_distributed(optimizer, name=name, device_dense=device_dense,
                              device_sparse=device_sparse, compression=compression,
                              sparse_as_dense=sparse_as_dense,
                              backward_passes_per_step=backward_passes_per_step,
                              average_aggregated_gradients=average_aggregated_gradients, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              num_groups=num_groups, groups=groups, process_set=process_set,
                              scale_local_gradients=scale_local_gradients)


def _legacy_optimizer(optimizer, name, use_locking, compression, sparse_as_dense,
                      backward_passes_per_step, op, gradient_predivide_factor, num_groups,
                      groups, process_set, scale_local_gradients):
    from .gradient_tape import check_groups, check_process_set, make_allreduce_grads_fn
    from .legacy_optimizer import DistributedLegacyOptimizer
    check_groups(num_groups, groups)
    check_process_set(process_set)
    if resolve_op(op) == Adasum:
        raise NotImplementedError("hvdlite: op=Adasum with a tf.compat.v1.train.Optimizer "
                                  "(Horovod's delta-based Adasum optimizer) is not supported; "
                                  "use op=Average or Sum.")
    if backward_passes_per_step != 1:
        if _tf.executing_eagerly():   # Horovod's check and class
            raise ValueError("backward_passes_per_step > 1 is not yet supported for "
                             "_LegacyOptimizer with eager execution.")
        raise NotImplementedError("hvdlite: backward_passes_per_step > 1 with a "
                                  "tf.compat.v1.train.Optimizer is not supported; accumulate "
                                  "the gradients yourself, or use a Keras optimizer.")
    label = name or f"Distributed{type(optimizer).__name__}"
    allreduce_grads = make_allreduce_grads_fn(f"DistributedOptimizer.{label}", compression,
                                              sparse_as_dense, op, gradient_predivide_factor,
                                              process_set, scale_local_gradients)
    return DistributedLegacyOptimizer(optimizer, name, use_locking, allreduce_grads)


def broadcast_global_variables(root_rank):
    """Broadcast every global variable (``tf.compat.v1.global_variables()``) from
    ``root_rank``: a TF1 graph-mode API that returns the broadcast op; eagerly it raises
    RuntimeError, as Horovod's does."""
    if _tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; "
                           "use hvd.broadcast_variables(model.variables, root_rank) instead.")
    return broadcast_variables(_tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """Return ``root_rank``'s picklable ``obj`` on every rank of ``process_set`` (Horovod's TF
    signature).  ``session`` is accepted for TF1 scripts and not needed: hvdlite sends the
    object directly, also while a TF1 graph is being built."""
    return _common_broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """List of every rank's picklable ``obj`` (Horovod's TF signature; ``session`` as in
    :func:`broadcast_object`)."""
    return _common_allgather_object(obj, name=name, process_set=process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return ``fn(obj)`` that broadcasts a picklable object from ``root_rank`` (Horovod's
    TF API: :func:`broadcast_object` with the arguments bound; ``session`` is not needed)."""
    def broadcast_fn(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return broadcast_fn
