"""PyTorch adapter with Horovod's API: ``import hvdlite.torch as hvd``.

A Horovod script runs after changing ``import horovod.torch as hvd`` to this import.
"""
from hvdlite.common.core import *  # noqa: F401,F403 - the shared, framework-neutral API

from .compression import Compression
from .mpi_ops import (allreduce, allreduce_, allreduce_async, allreduce_async_, allgather,
                      allgather_async, broadcast, broadcast_, broadcast_async, broadcast_async_,
                      alltoall, alltoall_async, reducescatter, reducescatter_async,
                      grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                      grouped_allreduce_async_, grouped_allgather, grouped_allgather_async,
                      grouped_reducescatter, grouped_reducescatter_async, poll, synchronize,
                      barrier, join)
from .sparse import sparse_allreduce, sparse_allreduce_async
from .sync_batch_norm import SyncBatchNorm
from .optimizer import DistributedOptimizer
from .functions import broadcast_parameters, broadcast_optimizer_state
from . import elastic  # noqa: F401 - hvd.elastic.*: Horovod's elastic API
