"""The process's hvdlite state: whether it is initialized, its topology, and the engine of each
process set it belongs to; plus the guard that keeps a forked child from using its parent's MPI.

Written only by :mod:`lifecycle` (init/shutdown) and :mod:`registry` (process sets); read by
every layer above.  The engines are opaque here: the runtime starts them through the factory that
``init()`` was given, and knows nothing of what they are.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from hvdlite.common.config import Config
from hvdlite.common.errors import NotInitializedError
from hvdlite.common.runtime import child_process

# (communicator, config, global ranks of the set or None for all) -> a started engine
EngineFactory = Callable[[Any, Config, "list[int] | None"], Any]


class ProcessState:
    """What ``init()`` established, until ``shutdown()``."""

    def __init__(self, world, engine, config: Config, topology, threads_multiple: bool,
                 make_engine: EngineFactory, global_set) -> None:
        self.world = world
        self.engine = engine
        self.config = config
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        self.local_rank, self.local_size = topology.local_rank, topology.local_size
        self.cross_rank, self.cross_size = topology.cross_rank, topology.cross_size
        self.homogeneous = topology.homogeneous
        self.threads_multiple = threads_multiple
        self.make_engine = make_engine
        # process_set_id -> (set, its engine or None where this rank is not a member)
        self.sets: dict[int, tuple[Any, Any]] = {0: (global_set, engine)}
        self.next_set_id = 1
        self.watchdog = None   # the cross-host death detector (see watchdog), if running


current: ProcessState | None = None
lock = threading.Lock()
# (parent pid, parent rank) in a child forked from an initialized rank, else None.
forked_from: tuple[int, int] | None = None


def _after_fork_in_child() -> None:
    """In a child forked from this process: no MPI and no background thread here (see
    child_process).  Locks are new: another thread may have held them at the fork."""
    global lock, forked_from
    lock = threading.Lock()
    if current is not None and forked_from is None:
        forked_from = (os.getppid(), current.rank)


os.register_at_fork(after_in_child=_after_fork_in_child)


def refuse_in_forked_child(what: str) -> None:
    if forked_from is not None:
        raise child_process.forked_child_error(what, *forked_from)


def get(what: str) -> ProcessState:
    """The state, or NotInitializedError naming ``what`` was called too early."""
    state = current
    if state is None:
        raise NotInitializedError(what)
    return state


def is_initialized() -> bool:
    return current is not None


def size() -> int:
    """Number of processes in the job."""
    return get("hvd.size()").size


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return get("hvd.rank()").rank


def local_size() -> int:
    """Number of processes on this host."""
    return get("hvd.local_size()").local_size


def local_rank() -> int:
    """This process's rank among the processes on its host (use it to pick a GPU)."""
    return get("hvd.local_rank()").local_rank


def cross_size() -> int:
    """Number of hosts that have a process with this process's local rank."""
    return get("hvd.cross_size()").cross_size


def cross_rank() -> int:
    """This host's index among the hosts (rank in the cross communicator)."""
    return get("hvd.cross_rank()").cross_rank


def is_homogeneous() -> bool:
    """True if every host runs the same number of processes."""
    return get("hvd.is_homogeneous()").homogeneous


def mpi_threads_supported() -> bool:
    """True if the MPI library provides MPI_THREAD_MULTIPLE."""
    return get("hvd.mpi_threads_supported()").threads_multiple


def engine():
    """The global process set's engine, for an operation about to be submitted."""
    state = get("an hvdlite operation")
    if forked_from is not None:   # tested inline: this runs for every operation
        refuse_in_forked_child("A collective operation")
    return state.engine
