"""``init()`` and ``shutdown()``: the communicators, the topology, the agreed settings, the
global process set's engine (made by the factory the caller passes, so the runtime does not
depend on what an engine is), the timeline, and the end of the job at interpreter exit."""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Callable

from hvdlite.common.config import Config
from hvdlite.common.errors import HvdliteError, LaunchError
from hvdlite.common.gpu.cuda import reset_process_device
from hvdlite.common.memory import result_pool
from hvdlite.common.runtime import (child_process, elastic_channel, env_world, launch_env,
                                    liveness, output_relay, registry, state as _state,
                                    timeline)
from hvdlite.common.runtime.build import mpi_library_version
from hvdlite.common.runtime.process_sets import ProcessSet, global_process_set
from hvdlite.common.runtime.state import EngineFactory, ProcessState
from hvdlite.common.runtime.topology import discover
from hvdlite.common.runtime.watchdog import Watchdog

log = logging.getLogger("hvdlite")

_atexit_registered = False
# Called after every shutdown, on this rank (e.g. the operations' automatic-name counters).
_shutdown_listeners: list[Callable[[], None]] = []


def on_shutdown(listener: Callable[[], None]) -> None:
    """Have ``listener()`` called at the end of every :func:`shutdown` (every rank shuts down
    and re-initializes together, so per-job counters restart in step)."""
    _shutdown_listeners.append(listener)


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


def settings_error(problems: tuple[str | None, ...], rank: int) -> str:
    """``init()``'s error when some ranks' ``HVDLITE_*``/``HOROVOD_*`` settings are invalid."""
    bad = [r for r, problem in enumerate(problems) if problem]
    mine = problems[rank] and problems[rank].rstrip(".")
    what = (f"{mine} (rank {rank})" if mine else
            f"rank {bad[0]}'s settings are invalid: {problems[bad[0]].rstrip('.')}")
    return (f"hvd.init(): {what}. Invalid settings on ranks {bad}, so every rank stops here; "
            f"correct the environment variable (every rank's, e.g. hvdlite run -x or mpiexec "
            f"-genv) and start the job again.")


def init(comm=None, process_sets=None, *, make_engine: EngineFactory) -> None:
    """Initialize: communicators, topology, settings agreed by every rank, and the global set's
    engine from ``make_engine(comm, config, None)`` (started).  See the public ``hvd.init``
    for ``comm`` and ``process_sets``.  A second call while initialized does nothing."""
    global _atexit_registered
    dynamic = isinstance(process_sets, str)
    if dynamic and process_sets != "dynamic":
        raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet "
                         f"objects or the string 'dynamic'.")
    static = [] if dynamic or process_sets is None else list(process_sets)
    if any(not isinstance(ps, ProcessSet) for ps in static):
        raise TypeError("init(process_sets=...) expects ProcessSet objects, e.g. "
                        "[hvd.ProcessSet([0, 1])].")
    if _state.current is None:   # Horovod's no-op repeat stays one, even in a forked child
        _state.refuse_in_forked_child("hvd.init()")
        child_process.refuse_spawned_child()
    with _state.lock:
        if _state.current is not None:
            return
        launch = launch_env.detect(os.environ) if comm is None else None
        mpi_was_up = _mpi_initialized()
        if launch is not None and not mpi_was_up and launch_env.pmix_launch(launch):
            problem = launch_env.library_error(launch, mpi_library_version())
            if problem:   # before MPI_Init, which would abort with MPICH's own words
                raise LaunchError(problem)
        if launch is not None and launch.kind == launch_env.ENV and (launch.size or 0) > 1 \
                and not mpi_was_up:
            _form_env_world(launch)
        from mpi4py import MPI

        world = MPI.COMM_WORLD if comm is None else comm
        if launch is not None:
            world = _launch_world(launch, mpi_was_up)
        if isinstance(world, (list, tuple)):
            group = MPI.COMM_WORLD.Get_group().Incl(list(world))
            world = MPI.COMM_WORLD.Create(group)
            if world == MPI.COMM_NULL:
                raise ValueError(f"hvd.init(comm={list(comm)}) called on rank "
                                 f"{MPI.COMM_WORLD.Get_rank()}, which is not in that list.")
        ordered, world = world, world.Dup()  # hvdlite's own never collide with the user's
        if launch is not None and ordered != MPI.COMM_WORLD:
            ordered.Free()   # the RANK-ordered copy of an env:// launch's world
        rank = world.Get_rank()
        topology = discover(world)
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
        local_sizes, problems = zip(*world.allgather((topology.local_size, problem)))
        if any(problems):
            timeline.stop()
            world.Free()
            raise ValueError(settings_error(problems, rank))
        topology = dataclasses.replace(topology, homogeneous=len(set(local_sizes)) == 1)
        # rank 0's settings, but this rank's own for the knobs that are each rank's (config.KNOBS)
        config = own.with_rank0(world.bcast(own if rank == 0 else None, root=0))
        if dynamic and not config.dynamic_process_sets:
            config = dataclasses.replace(config, dynamic_process_sets=True)
        result_pool().max_idle_bytes = config.result_pool_bytes
        _configure_logging(config.log_level, rank)
        liveness.forget_departed()
        watchdog = None
        if config.watchdog and world.Get_size() > 1:
            watchdog = Watchdog(rank, world.Get_size(), _peers_departed)
            try:
                watchdog.start(world, config.watchdog_port)   # collective; raises on every rank
            except RuntimeError as exc:
                timeline.stop()
                world.Free()
                raise HvdliteError(str(exc)) from None
        if elastic_channel.driven():   # started by hvdlite run's elastic driver: report in
            _connect_to_elastic_driver(world, watchdog)
            output_relay.install(_to_driver)   # output that outlives this world's launcher
        elif env_world.commit_channel is not None:   # under torchrun: commits in its store
            elastic_channel.install(env_world.commit_channel)
        if own != config and rank != 0:
            log.info("using rank 0's settings %s (this rank's environment says %s)", config, own)
        engine = make_engine(world.Dup(), config, None)
        global_process_set._ranks = list(range(world.Get_size()))
        state = ProcessState(world, engine, config, topology,
                             MPI.Query_thread() == MPI.THREAD_MULTIPLE, make_engine,
                             global_process_set)
        state.watchdog = watchdog
        _state.current = state
        if not _atexit_registered:   # before anything else can raise: exit must shut down
            atexit.register(_at_exit)
            _atexit_registered = True
        for ps in static:
            registry.register(state, ps)
        child_process.mark_rank_process(rank)


def _mpi_initialized() -> bool:
    """Whether MPI is initialised in this process already (without initialising it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized()


def _form_env_world(launch: launch_env.Launch) -> None:
    """Form the world of a torchrun / env:// launch (see :mod:`env_world`); every process
    raises LaunchError when that fails."""
    try:
        timeout = Config.from_env().start_timeout_seconds
    except ValueError as exc:
        raise ValueError(f"hvd.init(): {exc}") from None
    try:
        env_world.form(launch, os.environ, timeout)
    except env_world.FormationError as exc:
        raise LaunchError(str(exc)) from None


def _launch_world(launch: launch_env.Launch, mpi_was_up: bool):
    """``MPI_COMM_WORLD`` checked against what the launcher said (LaunchError on every process
    when they differ: never a world of 1 when the launcher started N); under an env://
    launch, ordered by ``RANK`` (Hydra numbers ranks host by host)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    problem = launch_env.mismatch_error(launch, world.Get_size(), world.Get_rank(), mpi_was_up)
    if problem:
        raise LaunchError(problem)
    if launch.kind == launch_env.ENV and launch.size == world.Get_size() > 1:
        return world.Split(0, launch.rank)   # collective; the same order when hosts are in order
    return world


def _to_driver(fd: int, data: bytes) -> None:
    """Where an elastic worker's output goes once its world's launcher is gone: the driver
    prints it (nowhere, if that is gone too)."""
    channel = elastic_channel.current()
    if channel is not None and not channel.closed:
        channel.tell(("output", fd, data))


def _connect_to_elastic_driver(world, watchdog) -> None:
    """Connect this rank to the elastic driver (collective: if any rank cannot, every rank
    raises, naming it)."""
    problem = elastic_channel.connect(world.Get_rank(), world.Get_size(), socket.gethostname())
    problems = world.allgather(problem)
    if any(problems):
        if watchdog is not None:
            watchdog.close()
        timeline.stop()
        world.Free()
        bad = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
        raise HvdliteError(f"hvd.init(): {bad}. The workers of an elastic job must reach its "
                           f"driver over TCP: the host that runs `hvdlite run`, or under Ray the "
                           f"node of the RayExecutor's driver or of the Ray Train controller.")


# Before aborting a job whose peer vanished, the other survivors get this long to notice it
# themselves (a wait checks the peers after about a second) and report their own errors; an
# immediate abort killed a survivor that was a moment behind before it said anything.
ABORT_GRACE_SECONDS = 3.0


def _at_exit() -> None:
    """At interpreter exit: shut down; and if a peer vanished during the job (found by the
    node-local check or the watchdog), abort it, because MPI_Finalize (which runs next) would
    wait for that peer for ever."""
    if _state.forked_from is not None:
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
    with _state.lock:
        state, _state.current = _state.current, None
    if state is None or _state.forked_from is not None:
        return   # in a forked child the copied state is just dropped: MPI is the parent's
    timeline.stop()
    reset_process_device()
    result_pool().clear()
    for listener in _shutdown_listeners:
        listener()
    for set_id, (ps, set_engine) in sorted(state.sets.items(), reverse=True):
        if set_id != 0:
            registry.stop(ps, set_engine)
    state.engine.shutdown()
    if state.watchdog is not None:   # after the engines: this rank ends cleanly
        state.watchdog.close()
    try:
        state.engine.comm.Free()
        state.world.Free()
    except Exception:  # noqa: BLE001 - MPI may already be finalized at interpreter exit
        pass


def _peers_departed(departures) -> None:
    """The watchdog's report (on its thread): ranks gone without shutting down.  Every engine
    whose set they belonged to fails what waits on them, at once."""
    liveness.record_departed(departures)
    state = _state.current
    if state is None:
        return
    for _, engine in list(state.sets.values()):
        if engine is not None:
            engine.peers_departed(departures)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a Horovod Timeline (Chrome tracing JSON; open it in chrome://tracing or
    https://ui.perfetto.dev) to ``file_path``, as ``HVDLITE_TIMELINE`` / ``HOROVOD_TIMELINE``
    does from ``init()``.  As in Horovod only rank 0 records (it sees every rank's readiness);
    on other ranks this checks the arguments and does nothing.  ``mark_cycles`` marks every
    negotiation round.  A timeline already running is closed and replaced.  Raises
    ``ValueError`` before ``init()`` or if the file cannot be written."""
    state: ProcessState = _state.get("hvd.start_timeline()")
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline needs a file path, got {file_path!r}.")
    if state.rank == 0:
        timeline.start(file_path, mark_cycles=bool(mark_cycles))


def stop_timeline() -> None:
    """Stop recording the timeline and close its file (a complete JSON array).  Nothing happens
    if none is running; ``shutdown()`` stops it too."""
    _state.get("hvd.stop_timeline()")
    timeline.stop()
