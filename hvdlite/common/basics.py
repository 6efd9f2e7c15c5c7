"""Process-wide state: init/shutdown, topology queries and build/feature queries."""
from __future__ import annotations

import atexit
import importlib.util
import logging
import sys
import threading

from .config import Config
from .errors import NotInitializedError

log = logging.getLogger("hvdlite")


class _State:
    def __init__(self, world, engine, config: Config, local_rank: int, local_size: int,
                 cross_rank: int, cross_size: int, homogeneous: bool, threads_multiple: bool):
        self.world = world
        self.engine = engine
        self.config = config
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        self.homogeneous = homogeneous
        self.threads_multiple = threads_multiple


_state: _State | None = None
_lock = threading.Lock()
_atexit_registered = False


def _configure_logging(level: str, rank: int) -> None:
    if any(getattr(h, "_hvdlite", False) for h in log.handlers):
        log.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._hvdlite = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(f"[hvdlite rank {rank}] %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def init(comm=None, process_sets=None) -> None:
    """Initialize hvdlite: set up the topology and start the background thread.

    ``comm`` may be an mpi4py communicator (default ``MPI.COMM_WORLD``) or a list of world ranks
    to run on, as in Horovod.  Calling ``init()`` again while initialized does nothing.
    """
    global _state, _atexit_registered
    if process_sets:
        raise NotImplementedError("process sets are not available in hvdlite yet; "
                                  "call hvd.init() without process_sets.")
    with _lock:
        if _state is not None:
            return
        from mpi4py import MPI
        from .engine import Engine

        world = MPI.COMM_WORLD if comm is None else comm
        if isinstance(world, (list, tuple)):
            group = MPI.COMM_WORLD.Get_group().Incl(list(world))
            world = MPI.COMM_WORLD.Create(group)
            if world == MPI.COMM_NULL:
                raise ValueError(f"hvd.init(comm={list(comm)}) called on rank "
                                 f"{MPI.COMM_WORLD.Get_rank()}, which is not in that list.")
        world = world.Dup()  # hvdlite's own communicators never collide with the user's
        rank = world.Get_rank()
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank, local_size = local.Get_rank(), local.Get_size()
        cross = world.Split(color=local_rank, key=rank)
        cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
        local_sizes = world.allgather(local_size)
        config = world.bcast(Config.from_env() if rank == 0 else None, root=0)
        own = Config.from_env()
        local.Free()
        cross.Free()
        _configure_logging(own.log_level, rank)
        if own != config and rank != 0:
            log.info("using rank 0's settings %s (this rank's environment says %s)", config, own)
        engine = Engine(world.Dup(), config)
        engine.start()
        _state = _State(world, engine, config, local_rank, local_size, cross_rank, cross_size,
                        len(set(local_sizes)) == 1,
                        MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def shutdown() -> None:
    """Stop the background thread after telling the other ranks; pending operations fail.

    Called automatically at interpreter exit, so a rank whose script ends (or dies with an
    exception) while others still wait on it makes them raise instead of hanging.
    """
    global _state
    with _lock:
        state, _state = _state, None
    if state is None:
        return
    state.engine.shutdown()
    try:
        state.engine.comm.Free()
        state.world.Free()
    except Exception:  # noqa: BLE001 - MPI may already be finalized at interpreter exit
        pass


def is_initialized() -> bool:
    return _state is not None


def _get(what: str) -> _State:
    state = _state
    if state is None:
        raise NotInitializedError(what)
    return state


def size() -> int:
    """Number of processes in the job."""
    return _get("hvd.size()").size


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return _get("hvd.rank()").rank


def local_size() -> int:
    """Number of processes on this host."""
    return _get("hvd.local_size()").local_size


def local_rank() -> int:
    """This process's rank among the processes on its host (use it to pick a GPU)."""
    return _get("hvd.local_rank()").local_rank


def cross_size() -> int:
    """Number of hosts that have a process with this process's local rank."""
    return _get("hvd.cross_size()").cross_size


def cross_rank() -> int:
    """This host's index among the hosts (rank in the cross communicator)."""
    return _get("hvd.cross_rank()").cross_rank


def is_homogeneous() -> bool:
    """True if every host runs the same number of processes."""
    return _get("hvd.is_homogeneous()").homogeneous


def mpi_threads_supported() -> bool:
    """True if the MPI library provides MPI_THREAD_MULTIPLE."""
    return _get("hvd.mpi_threads_supported()").threads_multiple


def engine():
    return _get("an hvdlite operation").engine


# --- build / feature queries: truthful about this installation ---------------------------------
def mpi_built() -> bool:
    """True if mpi4py (the MPI controller and data path) can be imported."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True if MPI is used by the running job (always, once initialized)."""
    return is_initialized()


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """NCCL version (as an int, Horovod style) if a NCCL binding is usable, else 0."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False
