"""hvdlite: Horovod-style data-parallel training in pure Python.

``import hvdlite as hvd`` gives the framework-neutral API on numpy arrays; ``hvdlite.torch`` and
``hvdlite.tensorflow`` are the framework adapters with Horovod's names.
"""
from .version import __version__
from .common.basics import (init, shutdown, is_initialized, size, rank, local_size, local_rank,
                            cross_size, cross_rank, is_homogeneous, mpi_threads_supported,
                            mpi_built, mpi_enabled, gloo_built, gloo_enabled, nccl_built,
                            ddl_built, ccl_built, cuda_built, rocm_built)
from .common.errors import (HvdliteError, HorovodInternalError, NotInitializedError,
                            ShutdownError, RankExitedError, TensorMismatchError,
                            DuplicateNameError, UnsupportedDtypeError, StallError)
from .common.reduce_ops import ReduceOp, Average, Sum, Adasum, Min, Max, Product
from .common.handle import Handle
from .common.ops import (allreduce, allreduce_, allreduce_async, allreduce_async_, allgather,
                         allgather_async, broadcast, broadcast_, broadcast_async,
                         broadcast_async_, barrier, poll, synchronize)
