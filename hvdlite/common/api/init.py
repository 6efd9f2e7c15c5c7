"""The public ``init()``: the runtime's initialization with the engines this library runs (the
runtime starts whatever engine factory it is given, so it does not depend on the engine)."""
from __future__ import annotations

from hvdlite.common.data_paths.standard import standard_paths
from hvdlite.common.config import Config
from hvdlite.common.engine.engine import Engine
from hvdlite.common.runtime import lifecycle


def new_engine(comm, config: Config, global_ranks: list[int] | None = None) -> Engine:
    """A started engine for one process set (``global_ranks`` None: the global set)."""
    engine = Engine(comm, config, global_ranks, standard_paths)
    engine.start()
    return engine


def init(comm=None, process_sets=None) -> None:
    """Initialize hvdlite: set up the topology and start the background thread.

    ``comm`` may be an mpi4py communicator (default ``MPI.COMM_WORLD``) or a list of world ranks
    to run on, as in Horovod.  ``process_sets`` is a list of :class:`ProcessSet` to register
    now (every rank passes the same list), or ``"dynamic"`` to allow ``add_process_set`` /
    ``remove_process_set`` later (as does ``HVDLITE_DYNAMIC_PROCESS_SETS=1``).  Calling
    ``init()`` again while initialized does nothing.
    """
    lifecycle.init(comm, process_sets, make_engine=new_engine)
