"""Process-wide state: init/shutdown, topology queries and build/feature queries."""
from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import sys
import threading
import time

from hvdlite.common.config import Config
from hvdlite.common.errors import NotInitializedError
from hvdlite.common.memory import result_pool
from hvdlite.common.runtime import child_process, liveness, timeline
from hvdlite.common.runtime.process_sets import (ProcessSet, check_ranks, global_process_set,
                                                 resolve_ranks)

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
        # process_set_id -> (set, its engine or None where this rank is not a member)
        self.sets: dict[int, tuple[ProcessSet, object]] = {0: (global_process_set, engine)}
        self.next_set_id = 1


_state: _State | None = None
_lock = threading.Lock()
_atexit_registered = False
# (parent pid, parent rank) in a child forked from an initialized rank, else None.
_forked_from: tuple[int, int] | None = None


def _after_fork_in_child() -> None:
    """In a child forked from this process: no MPI and no background thread here (see
    child_process).  Locks are new: another thread may have held them at the fork."""
    global _lock, _forked_from
    _lock = threading.Lock()
    if _state is not None and _forked_from is None:
        _forked_from = (os.getppid(), _state.rank)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _refuse_in_forked_child(what: str) -> None:
    if _forked_from is not None:
        raise child_process.forked_child_error(what, *_forked_from)


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


def _settings_error(problems: tuple[str | None, ...], rank: int) -> str:
    """``init()``'s error when some ranks' ``HVDLITE_*``/``HOROVOD_*`` settings are invalid."""
    bad = [r for r, problem in enumerate(problems) if problem]
    mine = problems[rank] and problems[rank].rstrip(".")
    what = (f"{mine} (rank {rank})" if mine else
            f"rank {bad[0]}'s settings are invalid: {problems[bad[0]].rstrip('.')}")
    return (f"hvd.init(): {what}. Invalid settings on ranks {bad}, so every rank stops here; "
            f"correct the environment variable (every rank's, e.g. hvdlite run -x or mpiexec "
            f"-genv) and start the job again.")


def init(comm=None, process_sets=None) -> None:
    """Initialize hvdlite: set up the topology and start the background thread.

    ``comm`` may be an mpi4py communicator (default ``MPI.COMM_WORLD``) or a list of world ranks
    to run on, as in Horovod.  ``process_sets`` is a list of :class:`ProcessSet` to register
    now (every rank passes the same list), or ``"dynamic"`` to allow :func:`add_process_set` /
    :func:`remove_process_set` later (as does ``HVDLITE_DYNAMIC_PROCESS_SETS=1``).  Calling
    ``init()`` again while initialized does nothing.
    """
    global _state, _atexit_registered
    dynamic = isinstance(process_sets, str)
    if dynamic and process_sets != "dynamic":
        raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet "
                         f"objects or the string 'dynamic'.")
    static = [] if dynamic or process_sets is None else list(process_sets)
    if any(not isinstance(ps, ProcessSet) for ps in static):
        raise TypeError("init(process_sets=...) expects ProcessSet objects, e.g. "
                        "[hvd.ProcessSet([0, 1])].")
    if _state is None:   # Horovod's no-op repeat stays one, even in a forked child
        _refuse_in_forked_child("hvd.init()")
        child_process.refuse_spawned_child()
    with _lock:
        if _state is not None:
            return
        from mpi4py import MPI

        from hvdlite.common.engine.thread import Engine

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
        liveness.record(local.allgather((rank, *liveness.own_identity())), rank)
        cross = world.Split(color=local_rank, key=rank)
        cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
        # Every rank reads its settings before any rank relies on them: a bad value raises on
        # every rank (none is left waiting in a collective for one that gave up).
        # The timeline file is opened here too, on rank 0 (the one that records), so that a path
        # it cannot write fails init() on every rank instead of rank 0 alone.
        try:
            own, problem = Config.from_env(), None
            if own.timeline_filename and rank == 0:
                timeline.start(own.timeline_filename, mark_cycles=own.timeline_mark_cycles)
        except ValueError as exc:
            own, problem = None, str(exc)
        local_sizes, problems = zip(*world.allgather((local_size, problem)))
        if any(problems):
            timeline.stop()
            for c in (local, cross, world):
                c.Free()
            raise ValueError(_settings_error(problems, rank))
        # rank 0's settings, but this rank's own for the knobs that are each rank's (config.KNOBS)
        config = own.with_rank0(world.bcast(own if rank == 0 else None, root=0))
        if dynamic and not config.dynamic_process_sets:
            import dataclasses
            config = dataclasses.replace(config, dynamic_process_sets=True)
        result_pool().max_idle_bytes = config.result_pool_bytes
        local.Free()
        cross.Free()
        _configure_logging(config.log_level, rank)
        if own != config and rank != 0:
            log.info("using rank 0's settings %s (this rank's environment says %s)", config, own)
        engine = Engine(world.Dup(), config)
        engine.start()
        global_process_set._ranks = list(range(world.Get_size()))
        _state = _State(world, engine, config, local_rank, local_size, cross_rank, cross_size,
                        len(set(local_sizes)) == 1,
                        MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        if not _atexit_registered:   # before anything else can raise: exit must shut down
            atexit.register(_at_exit)
            _atexit_registered = True
        for ps in static:
            _register(_state, ps)
        child_process.mark_rank_process(rank)


# Before aborting a job whose peer vanished, the other survivors get this long to notice it
# themselves (a wait checks the peers after about a second) and report their own errors; an
# immediate abort killed a survivor that was a moment behind before it said anything.
ABORT_GRACE_SECONDS = 3.0


def _at_exit() -> None:
    """At interpreter exit: shut down; and if a node-local peer vanished during the job, abort
    it, because MPI_Finalize (which runs next) would wait for that peer for ever."""
    if _forked_from is not None:
        return   # a forked child: the job is its parent's to end
    shutdown()
    gone = liveness.vanished_seen()
    if gone:
        from mpi4py import MPI
        log.error("hvdlite: rank(s) %s exited without shutting down; aborting the job in %g s "
                  "so that no rank waits for them in MPI_Finalize.", gone, ABORT_GRACE_SECONDS)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_SECONDS)
        MPI.COMM_WORLD.Abort(1)


def shutdown() -> None:
    """Stop the background thread after telling the other ranks; pending operations fail.

    Called automatically at interpreter exit, so a rank whose script ends (or dies with an
    exception) while others still wait on it makes them raise instead of hanging.
    """
    global _state
    with _lock:
        state, _state = _state, None
    if state is None or _forked_from is not None:
        return   # in a forked child the copied state is just dropped: MPI is the parent's
    timeline.stop()
    from hvdlite.common.api.ops import reset_auto_names
    from hvdlite.common.gpu.cuda import reset_process_device
    reset_process_device()
    result_pool().clear()
    reset_auto_names()   # every rank re-inits together, so unnamed ops restart in step
    for set_id, (ps, set_engine) in sorted(state.sets.items(), reverse=True):
        if set_id != 0:
            _stop_set(ps, set_engine)
    state.engine.shutdown()
    try:
        state.engine.comm.Free()
        state.world.Free()
    except Exception:  # noqa: BLE001 - MPI may already be finalized at interpreter exit
        pass


def _stop_set(ps: ProcessSet, set_engine) -> None:
    ps.process_set_id = None
    if set_engine is not None:
        set_engine.shutdown()
        try:
            set_engine.comm.Free()
        except Exception:  # noqa: BLE001 - MPI may already be finalized at interpreter exit
            pass


# --- process sets ------------------------------------------------------------------------------
def _register(state: _State, process_set: ProcessSet) -> ProcessSet:
    """Collective over all ranks: give ``process_set`` an id, a communicator and an engine."""
    from mpi4py import MPI

    from hvdlite.common.engine.thread import Engine
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered.")
    comm = process_set.mpi_comm
    mine = None if comm is not None and comm == MPI.COMM_NULL else resolve_ranks(
        process_set, state.world)
    every = state.world.allgather(mine)
    if comm is None:   # a list of ranks: every rank must pass the same one
        if len({tuple(r) for r in every}) > 1:
            listing = "; ".join(f"rank {i}: {r}" for i, r in enumerate(every))
            raise ValueError(f"add_process_set / init(process_sets=...) was called with "
                             f"different ranks on different processes ({listing}); every rank "
                             f"must register the same process sets in the same order.")
        candidates = [check_ranks(mine, state.size)]
    else:              # communicators (e.g. from Split): each distinct one becomes a set
        candidates = sorted({tuple(r) for r in every if r is not None})
    known = {tuple(ps.ranks): ps for ps, _ in state.sets.values()}
    for ranks in candidates:
        if tuple(ranks) in known:
            raise ValueError(f"a process set with ranks {list(ranks)} is already registered "
                             f"({known[tuple(ranks)]!r}); use that one.")
    for ranks in candidates:
        ranks = list(ranks)
        group = state.world.Get_group().Incl(ranks)
        set_comm = state.world.Create(group)
        group.Free()
        set_id = state.next_set_id
        state.next_set_id += 1
        if mine is not None and list(mine) == ranks:
            target = process_set
        else:
            target = ProcessSet(ranks)
        target._ranks = ranks
        target.process_set_id = set_id
        set_engine = None
        if set_comm != MPI.COMM_NULL:
            set_engine = Engine(set_comm, state.config, ranks)
            set_engine.start()
        state.sets[set_id] = (target, set_engine)   # the engine owns (and frees) set_comm
    return process_set


def add_process_set(process_set: ProcessSet | list[int]) -> ProcessSet:
    """Register a new process set at run time; collective over all ranks (each passes the same
    ranks).  Needs ``HVDLITE_DYNAMIC_PROCESS_SETS=1`` or ``hvd.init(process_sets="dynamic")``.
    Returns the registered :class:`ProcessSet`."""
    state = _get("hvd.add_process_set()")
    _refuse_in_forked_child("hvd.add_process_set()")
    if not state.config.dynamic_process_sets:
        raise ValueError("add_process_set() needs dynamic process sets: set "
                         "HVDLITE_DYNAMIC_PROCESS_SETS=1 (or HOROVOD_DYNAMIC_PROCESS_SETS=1) or "
                         "call hvd.init(process_sets='dynamic'); or pass the sets to "
                         "hvd.init(process_sets=[...]).")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    with _lock:
        return _register(state, process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister a process set added at run time; collective over all ranks.  Ranks may pass
    different sets (e.g. each its own part of a ``comm.Split``): every set named by some rank is
    removed.  Operations still pending in a removed set fail.  Returns True if this rank's set
    was registered and is now removed."""
    state = _get("hvd.remove_process_set()")
    _refuse_in_forked_child("hvd.remove_process_set()")
    if not state.config.dynamic_process_sets:
        raise ValueError("remove_process_set() needs dynamic process sets (set "
                         "HVDLITE_DYNAMIC_PROCESS_SETS=1 or call "
                         "hvd.init(process_sets='dynamic')).")
    set_id = process_set.process_set_id
    every = state.world.allgather(set_id)
    if 0 in every:
        raise ValueError(f"the global process set cannot be removed (ranks "
                         f"{[r for r, i in enumerate(every) if i == 0]} tried to).")
    with _lock:
        removed = [state.sets.pop(i) for i in sorted({i for i in every if i is not None})
                   if i in state.sets]
    for found in removed:
        _stop_set(*found)
    return any(ps is process_set for ps, _ in removed)


def process_set_engine(process_set: ProcessSet | None, what: str):
    """(engine, member global ranks) for an operation on ``process_set`` (None = global)."""
    state = _get(what)
    if _forked_from is not None:   # tested inline: this runs for every operation
        _refuse_in_forked_child(what)
    if process_set is None:
        return state.engine, None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a hvd.ProcessSet, got "
                        f"{type(process_set).__name__}.")
    if process_set.process_set_id == 0:
        return state.engine, None
    set_id = process_set.process_set_id
    found = state.sets.get(set_id) if set_id is not None else None
    if found is None:
        raise ValueError(f"{what}: {process_set!r} is not registered (never added, or "
                         f"removed); register it with hvd.init(process_sets=[...]) or "
                         f"hvd.add_process_set().")
    registered, set_engine = found
    if set_engine is None:
        raise ValueError(f"{what}: rank {state.rank} is not a member of process set "
                         f"{set_id} (ranks {registered.ranks}); only its members may run "
                         f"operations on it.")
    return set_engine, registered.ranks


def get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every registered process set's id and global ranks (Horovod's helper)."""
    state = _get("hvd.get_process_set_ids_and_ranks()")
    return {set_id: ps.ranks for set_id, (ps, _) in sorted(state.sets.items())}


def comm_process_set(comm) -> ProcessSet:
    """The registered process set whose ranks are those of the mpi4py communicator ``comm``."""
    state = _get("hvd.comm_process_set()")
    ranks = resolve_ranks(ProcessSet(comm), state.world)
    for ps, _ in state.sets.values():
        if ps.ranks == ranks:
            return ps
    raise ValueError(f"no registered process set has the ranks {ranks} of this communicator.")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a Horovod Timeline (Chrome tracing JSON; open it in chrome://tracing or
    https://ui.perfetto.dev) to ``file_path``, as ``HVDLITE_TIMELINE`` / ``HOROVOD_TIMELINE``
    does from ``init()``.  As in Horovod only rank 0 records (it sees every rank's readiness);
    on other ranks this checks the arguments and does nothing.  ``mark_cycles`` marks every
    negotiation round.  A timeline already running is closed and replaced.  Raises
    ``ValueError`` before ``init()`` or if the file cannot be written."""
    state = _get("hvd.start_timeline()")
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline needs a file path, got {file_path!r}.")
    if state.rank == 0:
        timeline.start(file_path, mark_cycles=bool(mark_cycles))


def stop_timeline() -> None:
    """Stop recording the timeline and close its file (a complete JSON array).  Nothing happens
    if none is running; ``shutdown()`` stops it too."""
    _get("hvd.stop_timeline()")
    timeline.stop()


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
    """The global process set's engine, for an operation about to be submitted."""
    state = _get("an hvdlite operation")
    if _forked_from is not None:   # tested inline: this runs for every operation
        _refuse_in_forked_child("A collective operation")
    return state.engine


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
    """NCCL's version code (e.g. 22703 for 2.27.3, Horovod style) when the NCCL binding (CuPy's)
    loads, else 0.  Needs no GPU: it says whether GPU tensors can go through NCCL."""
    from hvdlite.common.gpu.cuda import nccl_version
    return nccl_version()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when CuPy (hvdlite's CUDA runtime binding) imports, so CUDA tensors are accepted."""
    from hvdlite.common.gpu.cuda import cupy_importable
    return cupy_importable()


def rocm_built() -> bool:
    return False


def sycl_built() -> bool:
    """False: hvdlite has no SYCL (Intel GPU) data path."""
    return False
