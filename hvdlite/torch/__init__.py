"""PyTorch adapter with Horovod's API: ``import hvdlite.torch as hvd``.

A Horovod script runs after changing ``import horovod.torch as hvd`` to this import.
"""
from hvdlite.common.basics import (init, shutdown, is_initialized, size, rank, local_size,
                                   local_rank, cross_size, cross_rank, is_homogeneous,
                                   mpi_threads_supported, mpi_built, mpi_enabled, gloo_built,
                                   gloo_enabled, nccl_built, ddl_built, ccl_built, cuda_built,
                                   rocm_built)
from hvdlite.common.errors import (HvdliteError, HorovodInternalError, ShutdownError,
                                   RankExitedError, TensorMismatchError, DuplicateNameError,
                                   UnsupportedDtypeError, StallError)
from hvdlite.common.reduce_ops import ReduceOp, Average, Sum, Adasum, Min, Max, Product
from hvdlite.common.objects import broadcast_object, allgather_object

from .compression import Compression
from .mpi_ops import (allreduce, allreduce_, allreduce_async, allreduce_async_, allgather,
                      allgather_async, broadcast, broadcast_, broadcast_async, broadcast_async_,
                      poll, synchronize, barrier)
from .optimizer import DistributedOptimizer
from .functions import broadcast_parameters, broadcast_optimizer_state
