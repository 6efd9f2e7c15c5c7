"""The framework-neutral part of every adapter's public API, listed once.

``hvdlite``, ``hvdlite.torch``, ``hvdlite.tensorflow`` and ``hvdlite.tensorflow.keras`` all
re-export these names (lifecycle, topology and build queries, errors, reduce ops, object
helpers) with ``from hvdlite.common.api.public import *``.
"""
from hvdlite.common.api.objects import allgather_object, broadcast_object
from hvdlite.common.errors import (DuplicateNameError, FailedOnRankError, GpuUnavailableError,
                                   HorovodInternalError, HvdliteError, NotInitializedError,
                                   RankChildProcessError, RankExitedError, ShutdownError,
                                   StallError, TensorMismatchError, UnsupportedDtypeError,
                                   UnsupportedOperationError)
from hvdlite.common.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from hvdlite.common.runtime.basics import (add_process_set, ccl_built, comm_process_set, cross_rank,
                                           cross_size, cuda_built, ddl_built,
                                           get_process_set_ids_and_ranks, gloo_built, gloo_enabled,
                                           init, is_homogeneous, is_initialized, local_rank,
                                           local_size, mpi_built, mpi_enabled,
                                           mpi_threads_supported, nccl_built, rank,
                                           remove_process_set, rocm_built, shutdown, size,
                                           start_timeline, stop_timeline, sycl_built)
from hvdlite.common.runtime.process_sets import ProcessSet, global_process_set

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built",
    "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "sycl_built", "add_process_set", "remove_process_set",
    "get_process_set_ids_and_ranks", "comm_process_set", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set",
    "HvdliteError", "HorovodInternalError", "NotInitializedError", "ShutdownError",
    "RankExitedError", "TensorMismatchError", "DuplicateNameError", "UnsupportedDtypeError",
    "UnsupportedOperationError", "StallError", "GpuUnavailableError", "RankChildProcessError",
    "FailedOnRankError",
    "allgather_object", "broadcast_object",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
]
