"""TensorFlow 2 adapter with Horovod's API: ``import hvdlite.tensorflow as hvd``.

A Horovod TF2 script runs after changing ``import horovod.tensorflow as hvd`` to this import.
Ops work eagerly and inside ``tf.function`` (see :mod:`hvdlite.tensorflow.mpi_ops` for how
unnamed ops are named in graphs).  Keras users import :mod:`hvdlite.tensorflow.keras`.
"""
from hvdlite.common.core import *  # noqa: F401,F403 - the shared API

from .compression import Compression
from .mpi_ops import (allreduce, grouped_allreduce, allgather, grouped_allgather, broadcast,
                      broadcast_, broadcast_variables, alltoall, reducescatter,
                      grouped_reducescatter, barrier, join, size_op, process_set_included_op,
                      rank_op, local_size_op, local_rank_op, cross_size_op, cross_rank_op)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from . import elastic  # noqa: F401 - hvd.elastic.* raises a clear 'not supported'
from .sync_batch_norm import SyncBatchNormalization


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer (TF2 has no other kind) so that gradients are averaged across
    ranks before they are applied; see :func:`hvdlite.tensorflow.keras.DistributedOptimizer`."""
    from .keras import DistributedOptimizer as _keras_distributed
    return _keras_distributed(optimizer, name=name, device_dense=device_dense,
                              device_sparse=device_sparse, compression=compression,
                              sparse_as_dense=sparse_as_dense,
                              backward_passes_per_step=backward_passes_per_step,
                              average_aggregated_gradients=average_aggregated_gradients, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              num_groups=num_groups, groups=groups, process_set=process_set,
                              scale_local_gradients=scale_local_gradients)


def broadcast_global_variables(root_rank):
    """TF1 graph-mode API: not available in TF2 eager execution (same as Horovod)."""
    raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; use "
                       "hvd.broadcast_variables(model.variables, root_rank) instead.")


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return ``fn(obj)`` that broadcasts a picklable object from ``root_rank`` (Horovod's
    TF API; in TF2 this is :func:`broadcast_object` with the arguments bound)."""
    if session is not None:
        raise ValueError("broadcast_object_fn(session=...) is a TF1 graph-mode API; TF2 runs "
                         "eagerly, so leave session=None.")

    def broadcast_fn(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return broadcast_fn
