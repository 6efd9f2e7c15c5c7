"""The engine: one background thread that owns all collective communication of a process set.

User threads only submit entries and wait on handles.  The engine thread loops over rounds, each
through its stages, one module each:

1. :mod:`.admission` -- take what user threads submitted since the last round;
2. :mod:`.controller` -- negotiate with the other ranks which operations run, in which order;
3. :mod:`.execution` -- run the agreed responses on the data paths (fusing small allreduces);
4. :mod:`.completion` -- complete the handles (and, when the engine stops, fail the rest).

Every collective the engine itself runs goes through one
:class:`~hvdlite.common.engine.transport.Transport` (MPI in a job, an in-process fake in unit
tests, where N engines run a whole round end to end: tests/unit/engine/test_engine_round.py).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from hvdlite.common.config import Config
from hvdlite.common.engine.admission import Admission
from hvdlite.common.engine.completion import Completion
from hvdlite.common.engine.controller import Controller
from hvdlite.common.engine.data_path import PathContext
from hvdlite.common.engine.execution import Execution
from hvdlite.common.engine.handle import Handle
from hvdlite.common.engine.in_flight import InFlight
from hvdlite.common.engine.transport import MPITransport, Transport
from hvdlite.common.errors import HvdliteError, RankExitedError
from hvdlite.common.runtime import timeline as _timeline
from hvdlite.common.runtime.affinity import pin_engine_thread

log = logging.getLogger("hvdlite")


class Engine:
    """One background thread serving one process set (the global set, or a subset of ranks
    with its own communicator), so that disjoint sets never wait on each other."""

    def __init__(self, comm, config: Config, global_ranks: list[int] | None,
                 make_paths: Callable[[PathContext], list],
                 transport: Transport | None = None) -> None:
        """``make_paths(context)``: the data paths this engine asks, in order, which one serves
        a batch (see :mod:`.data_path`).  ``transport``: how the engine's own collectives
        reach the other ranks (default: MPI over ``comm``)."""
        self.comm = comm
        self.config = config
        self.in_flight = InFlight()
        self.controller = controller = Controller(
            transport if transport is not None else MPITransport(comm), config,
            self.in_flight.negotiating, global_ranks)
        self.rank = controller.label   # global rank, for messages
        self.size = controller.size    # ranks in this engine's process set
        self.completion = Completion(self.in_flight, self.rank)
        self.admission = Admission(self.in_flight, self.rank, lambda: controller.busy, config,
                                   self.completion)
        self.execution = Execution(controller, config, self.completion, make_paths, comm)
        self.paths = self.execution.paths
        # The user threads' entry points, bound once: a submission costs no extra call here.
        self.submit = self.admission.submit
        self.submit_group = self.admission.submit_group
        self.stream_open = self.admission.stream_open
        self.stream_close = self.admission.stream_close
        self.path = self.execution.path
        self.rounds_with_work = 0   # negotiation rounds that took new entries (tests, benchmarks)
        # Autotune (the global set only, as in Horovod): switches settings between rounds.
        self.retuner = None
        if config.autotune and global_ranks is None:
            self.retuner = _new_retuner(self, comm)
        self._thread = threading.Thread(target=self._run, name="hvdlite-engine", daemon=True)

    # --- user threads ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def new_handle(self, name: str) -> Handle:
        return Handle(name, self.alive)

    @property
    def open_streams(self) -> int:
        """Streams of submissions announced and not closed yet (see Admission.stream_open)."""
        return self.admission.open_streams

    @property
    def early_on(self) -> bool:
        """Early reductions switched on here (see :mod:`.early`); may be flipped at run time
        (tests, benchmarks): it takes effect, on every rank at once, from the round after the
        one in which every rank's switch agrees."""
        return self.execution.early_on

    @early_on.setter
    def early_on(self, on: bool) -> None:
        self.execution.early_on = on

    @property
    def early_reductions(self) -> int:
        """How many early reductions stood so far."""
        return self.execution.early_reductions

    def peers_departed(self, departures) -> None:
        """Ranks gone without shutting down (the watchdog's report, on its thread): if any was
        a member of this engine's set, fail everything in flight now, naming them, and refuse
        new operations; the engine thread, which may be waiting for them, finds out at its next
        check (within a second) and stops."""
        members = set(self.controller.global_ranks)
        mine = [d for d in departures if d.rank in members and d.rank != self.rank]
        if not mine:
            return
        what = "; ".join(d.describe() for d in mine)
        self.completion.fail_departed(
            f"{what}; no further collective operations are possible in this job. Look at that "
            f"rank's output and its host's system log for the cause.")
        self.admission.wake()   # the engine thread, if it sleeps

    def shutdown(self, timeout: float | None = None) -> None:
        self.admission.request_shutdown()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def use_config(self, config: Config) -> None:
        """Run with ``config`` from the next round on: autotune calls it between rounds, at the
        same round on every rank (a switch inside a round would mix settings)."""
        self.config = config
        self.admission.config = config
        cache_emptied = self.controller.use_config(config)
        self.execution.use_config(config, cache_emptied)

    # --- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        pin_engine_thread()   # HOROVOD_THREAD_AFFINITY / --thread-affinity, if set
        take_work, controller = self.admission.take_work, self.controller
        execution, completion = self.execution, self.completion
        pause = 0.0
        try:
            while True:
                new, shutdown = take_work(pause)
                if new:
                    self.rounds_with_work += 1
                tl = _timeline.ACTIVE
                if tl is not None:
                    tl.cycle()
                    for entry in new:
                        tl.negotiate_start(entry.name, entry.request.kind, entry.submitted_at)
                outcome = controller.run_round(new, shutdown, execution.early_next(),
                                               execution.early_on)
                execution.run(outcome)
                if outcome.joined is not None:
                    join_entry, last_rank = outcome.joined
                    completion.complete(join_entry, last_rank)
                if outcome.shutdown_ranks:
                    everyone = len(outcome.shutdown_ranks) == controller.size
                    # Every rank of the set takes this same round's outcome at the same point,
                    # those that asked to shut down and those that did not: collective releases
                    # (the shared window) reach all of them (a window freed locally left
                    # MPI_Finalize to abort under MPICH's OFI netmod with RMA resources open).
                    execution.close_paths(collective=True,
                                          abort=self.rank not in outcome.shutdown_ranks
                                          or not everyone)
                    completion.stop_after_shutdown(outcome.shutdown_ranks)
                    return
                if self.retuner is not None:
                    self.retuner.after_round(outcome)
                # Everyone has work but nothing matched (tensors submitted in different orders):
                # pace the rounds by the cycle time instead of spinning.
                pause = (self.config.cycle_seconds
                         if (not outcome.progress and outcome.everyone_busy and not new) else 0.0)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiters
            if isinstance(exc, HvdliteError):
                reason = str(exc)
                error: BaseException = exc
            else:
                log.exception("hvdlite background thread failed")
                reason = f"hvdlite's background thread failed: {type(exc).__name__}: {exc}"
                error = HvdliteError(reason)
            execution.close_device_work(abort=True)
            per_entry = None
            if isinstance(error, RankExitedError):   # name each waiter's tensor, as at shutdown
                per_entry = lambda e: RankExitedError(   # noqa: E731
                    f"Tensor {e.name!r} was still pending on rank {self.rank}: {reason}")
            completion.fail_everything(error, reason, per_entry=per_entry)
            # after the waiters are told: a broken MPI must not keep them waiting
            execution.close_paths(collective=False, abort=True)


def _new_retuner(engine: Engine, comm):
    """The autotune driver of ``engine`` (collective: every rank of the set builds one)."""
    from hvdlite.common.engine.retune import (Retuner, configured_setting, spans_hosts,
                                              tuning_options)
    from hvdlite.common.tuning.bayes import require_sklearn
    from hvdlite.common.tuning.manager import ParameterManager
    from hvdlite.common.tuning.parameter_space import ParameterSpace
    require_sklearn()   # on every rank: a missing package fails init() everywhere alike
    config = engine.config
    space = ParameterSpace.around(configured_setting(config),
                                  spans_hosts(comm) if comm is not None else False)
    manager = ParameterManager(space, tuning_options(config), root=engine.controller.rank == 0)
    return Retuner(engine, manager)
