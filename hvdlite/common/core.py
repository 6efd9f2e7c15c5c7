"""The one door the framework adapters (``hvdlite``, ``hvdlite.torch``, ``hvdlite.tensorflow``,
``hvdlite.keras``) and the launcher use into the core: everything they need, from every layer,
under one name.  ``from hvdlite.common.core import *`` gives the framework-neutral public API
(lifecycle, topology and build queries, process sets, errors, reduce ops, object helpers) that
every adapter re-exports; the rest is reached as ``core.<name>``.

Layers below (imports run one way only; ``tests/unit/test_layers.py`` checks it):
vocabulary (errors, reduce ops, dtypes, config, memory) -> gpu (CUDA runtime binding) ->
runtime (process state, init/shutdown, topology, process sets, liveness, waiting) ->
intranode (shared-memory window, direct copies) -> engine (background thread, negotiation,
handles, fusion planning) -> data_paths (the data paths) -> api (the numpy API, and what the
adapters share about gradients: scale factors, SyncBN moments, the layout vote) -> this door.
"""
from hvdlite.common.api import ops as _ops
from hvdlite.common.api.elastic import ObjectState, State, run_fn as elastic_run_fn
from hvdlite.common.api.elastic_sampler import ElasticSamplerBase
from hvdlite.common.api.grad_layouts import vote_layouts, vote_layouts_async
from hvdlite.common.api.gradients import (global_moments, moment_sums, predivide_factors,
                                          sparse_postscale)
from hvdlite.common.api.grouped import (announce_group_failure, announced_group, announcing_group,
                                        grouped_allgather, grouped_allgather_async,
                                        grouped_allreduce, grouped_allreduce_,
                                        grouped_allreduce_async, grouped_allreduce_async_,
                                        grouped_reducescatter, grouped_reducescatter_async,
                                        submit_group)
from hvdlite.common.api.init import init
from hvdlite.common.api.objects import allgather_object, broadcast_object
from hvdlite.common.api.announce import announce_failure, announced, announcing
from hvdlite.common.api.compression import (BF16_DOC, FP16_DOC, Compressor, NoneCompressor,
                                            casting_compressor)
from hvdlite.common.api.ops import (allgather, allgather_async, allreduce, allreduce_,
                                    allreduce_async, allreduce_async_, alltoall, alltoall_async,
                                    barrier, broadcast, broadcast_, broadcast_async,
                                    broadcast_async_, join, on_join, poll, reducescatter,
                                    reducescatter_async, synchronize)
from hvdlite.common.api.submission import fast_host_allreduce, prepare_allreduce, submit
from hvdlite.common.api import powersgd as powersgd_policy  # PowerSGD's shared policy
from hvdlite.common.data_paths.adasum import check_adasum_size
from hvdlite.common.config import KNOBS, Flag, Knob
from hvdlite.common.dtypes import dtype_info
from hvdlite.common.engine.handle import GroupHandle, Handle
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST,
                                            REDUCESCATTER, split_rows)
from hvdlite.common.engine.execution import FUSE_BELOW_BYTES
from hvdlite.common.errors import (DuplicateNameError, FailedOnRankError, GpuUnavailableError,
                                   HorovodInternalError, HostsUpdatedInterrupt, HvdliteError,
                                   LaunchError, NotInitializedError, RankChildProcessError, RankExitedError,
                                   ShutdownError, StallError, TensorMismatchError,
                                   UnsupportedDtypeError, UnsupportedOperationError)
from hvdlite.common.gpu import cuda
from hvdlite.common.intranode import cma
from hvdlite.common.memory import result_empty
from hvdlite.common.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum, resolve_op
from hvdlite.common.runtime.build import (ccl_built, cuda_built, ddl_built, gloo_built,
                                          gloo_enabled, mpi_built, mpi_enabled,
                                          mpi_library_version, nccl_built, rocm_built,
                                          sycl_built)
from hvdlite.common.runtime import elastic_wire, hydra_member, launch_env, warm_start
from hvdlite.common.runtime.env_world import rank_order
from hvdlite.common.runtime.hydra_world import MpiWorld, WorldError
from hvdlite.common.runtime.child_process import LAUNCHER_RANK_VARIABLES
from hvdlite.common.runtime.elastic_wire import (EXIT_RESET, Codec, HostUpdateResult,
                                                 register_codec)
from hvdlite.common.runtime.lifecycle import shutdown, start_timeline, stop_timeline
from hvdlite.common.runtime.liveness import departed_ranks
from hvdlite.common.runtime.process_sets import ProcessSet, global_process_set
from hvdlite.common.runtime.registry import (add_process_set, comm_process_set,
                                             get_process_set_ids_and_ranks, process_set_engine,
                                             remove_process_set)
from hvdlite.common.runtime.state import (cross_rank, cross_size, engine, is_homogeneous,
                                          is_initialized, local_rank, local_size,
                                          mpi_threads_supported, rank, size)

# The framework-neutral public API that every adapter re-exports with ``import *``.
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
    "FailedOnRankError", "HostsUpdatedInterrupt", "LaunchError",
    "allgather_object", "broadcast_object",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
]

# Not re-exported by `import *` (adapters define their own framework versions of these), but
# part of the door: the numpy API's operations, for the top-level ``hvdlite`` package.
NUMPY_OPERATIONS = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather",
    "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "barrier", "join",
    "poll", "synchronize", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "Handle", "GroupHandle",
]
del _ops
