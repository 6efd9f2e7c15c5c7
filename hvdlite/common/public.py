"""The framework-neutral part of every adapter's public API, listed once.

``hvdlite``, ``hvdlite.torch``, ``hvdlite.tensorflow`` and ``hvdlite.tensorflow.keras`` all
re-export these names (lifecycle, topology and build queries, errors, reduce ops, object
helpers) with ``from hvdlite.common.public import *``.
"""
from .basics import (init, shutdown, is_initialized, size, rank, local_size, local_rank,
                     cross_size, cross_rank, is_homogeneous, mpi_threads_supported, mpi_built,
                     mpi_enabled, gloo_built, gloo_enabled, nccl_built, ddl_built, ccl_built,
                     cuda_built, rocm_built, sycl_built, add_process_set, remove_process_set,
                     get_process_set_ids_and_ranks, comm_process_set, start_timeline,
                     stop_timeline)
from .process_sets import ProcessSet, global_process_set
from .errors import (HvdliteError, HorovodInternalError, NotInitializedError, ShutdownError,
                     RankExitedError, TensorMismatchError, DuplicateNameError,
                     UnsupportedDtypeError, UnsupportedOperationError, StallError,
                     GpuUnavailableError, RankChildProcessError, FailedOnRankError)
from .objects import allgather_object, broadcast_object
from .reduce_ops import ReduceOp, Average, Sum, Adasum, Min, Max, Product

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
