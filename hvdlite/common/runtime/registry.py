"""The process-set registry: registering sets (each with its own communicator and engine),
removing them, and finding the engine an operation on a set runs on."""
from __future__ import annotations

import logging
import pickle

import numpy as np

from hvdlite.common.runtime import state as _state
from hvdlite.common.runtime.peer_wait import check_wait, raise_if_gone
from hvdlite.common.runtime.process_sets import ProcessSet, check_ranks, resolve_ranks
from hvdlite.common.runtime.state import ProcessState
from hvdlite.common.runtime.waiting import wait_until

log = logging.getLogger("hvdlite")


def _allgather(state: ProcessState, obj, what: str) -> list:
    """``state.world.allgather(obj)`` that a rank gone without shutting down cannot block:
    refused at once if one is known to be gone, else two non-blocking exchanges (sizes, then
    the pickled objects) whose waits check every second for departed ranks (MPICH's TCP
    netmod can block for ever inside a call posted towards an exited peer) and give up at the
    stall shutdown time."""
    world = state.world
    raise_if_gone(range(state.size), state.rank, what)
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = np.empty(world.Get_size(), dtype=np.int64)
    _wait(world.Iallgather(np.array([data.size], dtype=np.int64), sizes), state, what)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
    from mpi4py import MPI
    _wait(world.Iallgatherv(data, [gathered, sizes, offsets, MPI.BYTE]), state, what)
    return [pickle.loads(gathered[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]


def _wait(request, state: ProcessState, what: str) -> None:
    """Wait for ``request``, watched (see :func:`peer_wait.check_wait`): every rank of the
    world takes part in these exchanges."""
    config = state.config
    wait_until(request.Test, config.wait_sleep_cap,
               on_slow=lambda waited: check_wait(waited, what, state.rank, range(state.size),
                                                 config, "every rank must call it."))


def register(state: ProcessState, process_set: ProcessSet) -> ProcessSet:
    """Collective over all ranks: give ``process_set`` an id, a communicator and an engine."""
    from mpi4py import MPI
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered.")
    comm = process_set.mpi_comm
    mine = None if comm is not None and comm == MPI.COMM_NULL else resolve_ranks(
        process_set, state.world)
    every = _allgather(state, mine, "the exchange that registers a process set")
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
        if set_comm != MPI.COMM_NULL:   # the engine owns (and frees) set_comm
            set_engine = state.make_engine(set_comm, state.config, ranks)
        state.sets[set_id] = (target, set_engine)
    return process_set


def stop(process_set: ProcessSet, set_engine) -> None:
    """Stop a removed (or, at shutdown, every) set's engine and free its communicator."""
    process_set.process_set_id = None
    if set_engine is not None:
        set_engine.shutdown()
        try:
            set_engine.comm.Free()
        except Exception:  # noqa: BLE001 - MPI may already be finalized at interpreter exit
            pass


def add_process_set(process_set: ProcessSet | list[int]) -> ProcessSet:
    """Register a new process set at run time; collective over all ranks (each passes the same
    ranks).  Needs ``HVDLITE_DYNAMIC_PROCESS_SETS=1`` or ``hvd.init(process_sets="dynamic")``.
    Returns the registered :class:`ProcessSet`."""
    state = _state.get("hvd.add_process_set()")
    _state.refuse_in_forked_child("hvd.add_process_set()")
    if not state.config.dynamic_process_sets:
        raise ValueError("add_process_set() needs dynamic process sets: set "
                         "HVDLITE_DYNAMIC_PROCESS_SETS=1 (or HOROVOD_DYNAMIC_PROCESS_SETS=1) or "
                         "call hvd.init(process_sets='dynamic'); or pass the sets to "
                         "hvd.init(process_sets=[...]).")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    with _state.lock:
        return register(state, process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister a process set added at run time; collective over all ranks.  Ranks may pass
    different sets (e.g. each its own part of a ``comm.Split``): every set named by some rank is
    removed.  Operations still pending in a removed set fail.  Returns True if this rank's set
    was registered and is now removed."""
    state = _state.get("hvd.remove_process_set()")
    _state.refuse_in_forked_child("hvd.remove_process_set()")
    if not state.config.dynamic_process_sets:
        raise ValueError("remove_process_set() needs dynamic process sets (set "
                         "HVDLITE_DYNAMIC_PROCESS_SETS=1 or call "
                         "hvd.init(process_sets='dynamic')).")
    set_id = process_set.process_set_id
    every = _allgather(state, set_id, "the exchange of hvd.remove_process_set()")
    if 0 in every:
        raise ValueError(f"the global process set cannot be removed (ranks "
                         f"{[r for r, i in enumerate(every) if i == 0]} tried to).")
    with _state.lock:
        removed = [state.sets.pop(i) for i in sorted({i for i in every if i is not None})
                   if i in state.sets]
    for found in removed:
        stop(*found)
    return any(ps is process_set for ps, _ in removed)


def process_set_engine(process_set: ProcessSet | None, what: str):
    """(engine, member global ranks) for an operation on ``process_set`` (None = global)."""
    state = _state.get(what)
    if _state.forked_from is not None:   # tested inline: this runs for every operation
        _state.refuse_in_forked_child(what)
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
    state = _state.get("hvd.get_process_set_ids_and_ranks()")
    return {set_id: ps.ranks for set_id, (ps, _) in sorted(state.sets.items())}


def comm_process_set(comm) -> ProcessSet:
    """The registered process set whose ranks are those of the mpi4py communicator ``comm``."""
    state = _state.get("hvd.comm_process_set()")
    ranks = resolve_ranks(ProcessSet(comm), state.world)
    for ps, _ in state.sets.values():
        if ps.ranks == ranks:
            return ps
    raise ValueError(f"no registered process set has the ranks {ranks} of this communicator.")
