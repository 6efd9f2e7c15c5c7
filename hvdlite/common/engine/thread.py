"""The background thread that owns all collective communication.

User threads only enqueue entries and wait on handles.  The engine thread loops: take what was
submitted, run a negotiation round (see :mod:`controller`), execute the agreed responses in the
agreed order through the backend (fusing small allreduces), and complete the handles.
"""
from __future__ import annotations

import functools
import logging
import operator
import queue
import threading
import time
from typing import Callable

import numpy as np

from hvdlite.common.config import Config
from hvdlite.common.engine.controller import IDLE_TICK_SECONDS, Controller
from hvdlite.common.engine.data_paths import PathContext, select
from hvdlite.common.engine.early import EARLY_MAX_BYTES, EarlyPlan
from hvdlite.common.engine.fusion import plan_batches
from hvdlite.common.engine.handle import Entry, GroupSink, Handle
from hvdlite.common.engine.in_flight import InFlight
from hvdlite.common.engine.transport import MPITransport
from hvdlite.common.engine.messages import ALLREDUCE, ERROR_FAILED_ON_RANK, ERROR_STALL, Response
from hvdlite.common.errors import (DuplicateNameError, FailedOnRankError, HvdliteError,
                                   RankExitedError, ShutdownError, StallError, TensorMismatchError)
from hvdlite.common.gpu import cuda
from hvdlite.common.gpu.completion import GpuCompletions
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime import timeline as _timeline
from hvdlite.common.runtime.waiting import poll_briefly, wait_until

log = logging.getLogger("hvdlite")


# Tensors this large gain nothing from batching (the transfer dwarfs the call overhead), so
# they are reduced in place and skip the two copies through the fusion buffer.
FUSE_BELOW_BYTES = 1 << 20


# A training loop's next submission usually follows within microseconds of a completion; the
# engine polls its queue this long (yielding the core) before blocking, which saves a thread
# wake-up (~50 us here) per lone operation.
IDLE_POLL_SECONDS = 200e-6

_fusion_fields = operator.itemgetter(2, 4, 6, 7, 8)   # dtype, op, device, pre/postscale
assert Response._fields[2:9] == ("dtype", "shape", "reduce_op", "root", "device", "prescale",
                                 "postscale")


# How a negotiation's error response is raised (anything else is a mismatch).
_ERROR_CLASSES = {ERROR_STALL: StallError, ERROR_FAILED_ON_RANK: FailedOnRankError}


def _fusion_key(item: tuple[Response, Entry]):
    response, entry = item
    if response[1] != ALLREDUCE or entry.nbytes >= FUSE_BELOW_BYTES:   # [1]: kind, the fast way
        return None
    return _fusion_fields(response)


def _nbytes(item: tuple[Response, Entry]) -> int:
    return item[1].nbytes


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


class Engine:
    """One background thread serving one process set (the global set, or a subset of ranks
    with its own communicator), so that disjoint sets never wait on each other."""

    def __init__(self, comm, config: Config, global_ranks: list[int] | None,
                 make_paths: Callable[[PathContext], list]) -> None:
        """``make_paths(context)``: the data paths this engine asks, in order, which one serves
        a batch (see :mod:`.data_paths`)."""
        self.comm = comm
        self.config = config
        self.in_flight = InFlight()
        # the table's lock (it guards the stop state below too) and entries, under short names
        # for the submission hot path
        self._lock, self._in_flight = self.in_flight.lock, self.in_flight.entries
        self.controller = Controller(MPITransport(comm), config, self.in_flight.negotiating,
                                     global_ranks)
        self.rank = self.controller.label   # global rank, for messages
        self.paths = make_paths(PathContext(
            comm=comm, global_ranks=self.controller.global_ranks, config=config,
            rank=self.rank, max_sleep=self.controller.max_sleep, on_slow=self._data_stall,
            agree=self._agree_prepared))
        # Each batch asks only the paths of its kind of memory, in the registry's order (a lone
        # host tensor then skips the GPU paths' checks, ~1 us each on every operation).
        self._host_paths = [p for p in self.paths if not p.device]
        self._device_paths = [p for p in self.paths if p.device]
        self._gpu_completions = None   # the GPU completion thread, made on first use
        self._queue: queue.SimpleQueue = queue.SimpleQueue()   # entries (or None = wake up)
        self._shutdown_requested = False
        # Producers that announced a stream of submissions (DistributedOptimizer during
        # backward): while any is open, a round waits up to a cycle time for more entries.
        self._streams = 0
        self._stream_closed = threading.Event()
        self.rounds_with_work = 0   # negotiation rounds that took new entries (tests, benchmarks)
        # Early reductions (see :mod:`.early`): the plan, the path that serves them, the
        # largest tensor taken (0: none; the same on every rank), and how many stood.
        # ``early_on`` may be flipped at run time (tests, benchmarks): it takes effect, on every
        # rank at once, from the round after the one in which every rank's switch agrees.
        self._early = EarlyPlan(self.controller.cache.held)
        self._early_path = next((p for p in self._host_paths if p.reduces_early), None)
        self._early_max_bytes = (EARLY_MAX_BYTES if config.early_reductions
                                 and self._early_path is not None else 0)
        self.early_on = self._early_max_bytes > 0
        self._early_allowed = False   # the last round's verdict: every rank's switch is on
        self.early_reductions = 0
        self._stopped: str | None = None        # why the engine stopped, once it has
        self._stopped_cls: type[ShutdownError] = ShutdownError
        self._thread = threading.Thread(target=self._run, name="hvdlite-engine", daemon=True)

    def _data_stall(self, waited: float) -> None:
        """Called while a batch's data exchange waits long for peers (see Controller)."""
        self.controller.local_stall(waited, "an allreduce's data exchange")

    # --- user threads ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def new_handle(self, name: str) -> Handle:
        return Handle(name, self.alive)

    def submit(self, entry: Entry) -> Handle:
        name = entry.name
        with self._lock:   # one entry: the checks of _admit, without its loops (hot path)
            if self._stopped is not None or self._shutdown_requested or name in self._in_flight:
                self._admit((entry,))   # raises the right error
            self._in_flight[name] = entry
        self._queue.put(entry)
        return entry.handle

    def submit_packed(self, entry: Entry) -> Handle:
        """Submit a grouped allreduce negotiated as one request (``entry``, whose ``members``
        are the members' entries): one entry, one cache slot and one handle for the whole
        group, whose result is the list of the members' results."""
        members = entry.members
        sink = GroupSink(entry.name, len(members),
                         functools.partial(self._finish_packed, entry))
        for member in members:
            member.handle = sink
        return self.submit(entry)

    def submit_group(self, entries: list[Entry]) -> list[Handle]:
        """Submit a grouped operation: its members reach the controller in one piece."""
        for entry in entries:
            entry.group = entries
        with self._lock:
            self._admit(entries)
        self._queue.put(entries)
        return [entry.handle for entry in entries]

    def _admit(self, entries) -> None:
        """Check and register new entries (caller holds the lock); all or nothing."""
        if self._stopped is not None:
            raise self._stopped_cls(self._stopped)
        if self._shutdown_requested:
            raise ShutdownError("hvdlite is shutting down; no new operations are accepted.")
        names = [entry.name for entry in entries]
        repeated = set() if len(set(names)) == len(names) else {   # a set: groups are large
            name for name in names if names.count(name) > 1}
        for name in names:
            if name in self._in_flight or name in repeated:
                raise DuplicateNameError(
                    f"A tensor named {name!r} is already in flight on rank {self.rank}. "
                    f"Names must be unique among pending operations: wait for the first one "
                    f"(hvd.synchronize) or give the second a different name.")
        for entry in entries:
            self._in_flight[entry.name] = entry

    def stream_open(self) -> None:
        """A caller starts submitting a burst of entries, one at a time (gradient hooks during
        backward).  Until :meth:`stream_close`, the engine lets each round gather entries for
        up to one cycle time instead of negotiating every entry as it arrives: a round's fixed
        cost (tens of microseconds of Python) paid per gradient competes with backward for the
        interpreter, and the hooks and the rounds then take turns.  Lone operations and
        synchronous loops, which open no stream, keep their latency."""
        with self._lock:
            self._streams += 1

    def stream_close(self) -> None:
        """The burst announced by :meth:`stream_open` is over (or abandoned)."""
        with self._lock:
            self._streams = max(0, self._streams - 1)
        self._stream_closed.set()

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
        reason = (f"{what}; no further collective operations are possible in this job. Look "
                  f"at that rank's output and its host's system log for the cause.")
        with self._lock:   # the engine thread's own tables stay its own: it clears them
            self._stopped, self._stopped_cls = reason, RankExitedError
            entries = list(self._in_flight.values())
        for entry in entries:
            handle = entry.handle
            if handle is not None:
                handle._complete(None, RankExitedError(
                    f"Tensor {entry.name!r} was still pending on rank {self.rank}: {reason}"))
        self._queue.put(None)   # wake the engine thread if it sleeps

    def shutdown(self, timeout: float | None = None) -> None:
        with self._lock:
            self._shutdown_requested = True
        self._queue.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- engine thread -----------------------------------------------------------------------
    def _take_work(self, pause: float) -> tuple[list[Entry], bool]:
        """New entries since the last round; blocks only when there is nothing to negotiate."""
        q = self._queue
        new: list[Entry] = []
        if (q.empty() and not (self.controller.busy and pause == 0.0)
                and (pause > 0 or not poll_briefly(lambda: not q.empty(), IDLE_POLL_SECONDS))):
            try:
                item = q.get(timeout=pause if pause > 0 else IDLE_TICK_SECONDS)
                if item is not None:
                    new.append(item)
            except queue.Empty:
                pass
        self._drain(new)
        if new and self._streams and pause == 0.0:
            self._gather_stream(new)
        if any(type(item) is list for item in new):   # grouped ops arrive as lists
            new = [e for item in new for e in (item if type(item) is list else (item,))]
        return new, self._shutdown_requested

    def _drain(self, new: list) -> None:
        """Move everything queued now into ``new`` (``None`` only wakes the thread)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                new.append(item)

    def _gather_stream(self, new: list) -> None:
        """While a stream is open, add what arrives within one cycle time to ``new``."""
        deadline = time.perf_counter() + self.config.cycle_seconds
        self._stream_closed.clear()
        while self._streams:
            left = deadline - time.perf_counter()
            if left <= 0 or not self._stream_closed.wait(left):
                break
            self._stream_closed.clear()
        self._drain(new)

    def _run(self) -> None:
        pause = 0.0
        try:
            while True:
                new, shutdown = self._take_work(pause)
                if new:
                    self.rounds_with_work += 1
                tl = _timeline.ACTIVE
                if tl is not None:
                    tl.cycle()
                    for entry in new:
                        tl.negotiate_start(entry.name, entry.request.kind, entry.submitted_at)
                outcome = self.controller.run_round(
                    new, shutdown, self._early.next if self._early_allowed else None,
                    self.early_on)
                self._early_allowed = outcome.early_allowed
                if outcome.early is not None:
                    self._complete_early(*outcome.early)
                sole_path = self._execute(outcome.ready)
                self._early.after_round(outcome.sole_slot, outcome.progress,
                                        lambda: self._early_start(outcome, sole_path))
                if outcome.joined is not None:
                    join_entry, last_rank = outcome.joined
                    self._complete(join_entry, last_rank)
                if outcome.shutdown_ranks:
                    everyone = len(outcome.shutdown_ranks) == self.controller.size
                    # Every rank of the set takes this same round's outcome at the same point,
                    # those that asked to shut down and those that did not: collective releases
                    # (the shared window) reach all of them (a window freed locally left
                    # MPI_Finalize to abort under MPICH's OFI netmod with RMA resources open).
                    self._close_paths(collective=True,
                                      abort=self.rank not in outcome.shutdown_ranks
                                      or not everyone)
                    self._stop_after_shutdown(outcome.shutdown_ranks)
                    return
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
            self._close_device_work(abort=True)
            per_entry = None
            if isinstance(error, RankExitedError):   # name each waiter's tensor, as at shutdown
                per_entry = lambda e: RankExitedError(   # noqa: E731
                    f"Tensor {e.name!r} was still pending on rank {self.rank}: {reason}")
            self._fail_everything(error, reason, per_entry=per_entry)
            # after the waiters are told: a broken MPI must not keep them waiting
            self._close_paths(collective=False, abort=True)

    def _execute(self, ready: list[tuple[Response, Entry | None]]):
        """Run the round's agreed responses; return the path that ran them if they were one
        runnable response (early reductions learn from it), else None."""
        tl = _timeline.ACTIVE
        if tl is not None:
            for response, entry in ready:
                kind = entry.request.kind if entry is not None else response.kind
                tl.negotiate_end(response.name, kind, response.error)
                if response.members:   # a group negotiated as one: its members' rows go on
                    tl.op_end([response.name])
                    for member in response.members:
                        tl.negotiate_end(member.name, kind)
        runnable = ready
        if any(response.error is not None for response, _ in ready):
            runnable = []
            for response, entry in ready:
                if response.error is not None:
                    cls = _ERROR_CLASSES.get(response.error_kind, TensorMismatchError)
                    self._complete(entry, error=cls(response.error))
                else:
                    runnable.append((response, entry))
        if any(response.members for response, _ in runnable):
            # grouped allreduces negotiated as one: the paths execute their members, exactly
            # as they would execute the members of a group negotiated tensor by tensor
            runnable = [pair for response, entry in runnable
                        for pair in (zip(response.members, entry.members) if response.members
                                     else ((response, entry),))]
        sole_path = None
        for batch in plan_batches(runnable, _fusion_key, _nbytes, self.config.fusion_threshold):
            path = select(self._device_paths if batch[0][0].device >= 0 else self._host_paths,
                          batch)
            if len(runnable) == 1:
                sole_path = path
            if path.device:
                self._execute_on_device(path, batch)
                continue
            if tl is not None and batch[0][0].kind != ALLREDUCE:   # the paths mark those
                tl.activity([r.name for r, _ in batch], f"MPI_{batch[0][0].kind.upper()}")
            path.execute(batch)
            self._complete_batch([entry for _, entry in batch])
        return sole_path

    def _early_start(self, outcome, path):
        """How later rounds start the tensor that ran alone in this one early (on ``path``),
        or None if it cannot be (see :mod:`.early`); decided from what every rank agreed on."""
        if outcome.early is not None or len(outcome.ready) != 1:
            return None
        response, entry = outcome.ready[0]
        if (path is not self._early_path or entry is None or response.members
                or response.kind != ALLREDUCE or response.device >= 0
                or response.reduce_op == ReduceOp.Adasum or entry.request.group
                or not 0 < entry.nbytes <= self._early_max_bytes or self.controller.size < 2):
            return None
        return functools.partial(self._early_path.start_early, response)

    def _complete_early(self, response: Response, entry: Entry) -> None:
        """An early reduction stood: its result is in the early exchange's buffer."""
        tl = _timeline.ACTIVE
        if tl is not None:
            tl.negotiate_end(response.name, ALLREDUCE, None)
            tl.activity([response.name], "MPI_ALLREDUCE")
        self._early_path.finish_early(response, entry)
        self.early_reductions += 1
        self._complete_batch([entry])

    def path(self, name: str):
        """This engine's data path called ``name`` (tests and benchmarks look inside)."""
        return next(p for p in self.paths if p.name == name)

    def _execute_on_device(self, path, batch: list[tuple[Response, Entry]]) -> None:
        """Queue the batch's device work; its handles complete when the work has finished (or,
        under asynchronous completion, now: their wait() orders the caller's stream after it)."""
        if self._gpu_completions is None:
            self._gpu_completions = GpuCompletions(cuda.runtime(), self._complete_batch,
                                                   lambda e, err: self._complete(e, error=err))
        entries = [entry for _, entry in batch]
        tl = _timeline.ACTIVE
        if tl is not None:
            tl.activity([e.name for e in entries],
                        f"{path.name.upper()}_{batch[0][0].kind.upper()}")
        try:
            work = path.execute(batch)
        except Exception as exc:   # noqa: BLE001 - a CUDA/NCCL failure fails this batch only
            error = exc if isinstance(exc, HvdliteError) else HvdliteError(
                f"GPU operation on {[e.name for e in entries]} failed on rank {self.rank}: "
                f"{type(exc).__name__}: {exc}")
            for entry in entries:
                self._complete(entry, error=error)
            return
        if self.config.gpu_async_completion:
            # Complete now; each handle's wait() makes the framework's stream wait for the
            # event, so the host never waits for the GPU (a sync per step idles the device).
            ready = functools.partial(cuda.wait_for_device_work, work.event, work.device)
            for entry in entries:
                entry.handle._device_ready = ready
            self._complete_batch(entries)
            self._gpu_completions.put(work.event, entries, work.keep, completed=True)
            return
        self._gpu_completions.put(work.event, entries, work.keep)

    def _agree_prepared(self, error: BaseException | None) -> None:
        """Before a GPU batch's collective: did every rank prepare its part (device copies,
        buffers)?  If any failed, every rank raises (naming those ranks) and none enters the
        collective, so a local failure cannot leave the others waiting inside it."""
        if self.controller.size == 1:   # nobody else to tell: no collective, no arrays
            if error is None:
                return
            failed = [self.rank]
        else:
            mine = np.array([0 if error is None else 1], dtype=np.int32)
            every = np.empty(self.controller.size, dtype=np.int32)
            request = self.comm.Iallgather(mine, every)
            wait_until(request.Test, self.controller.max_sleep)
            failed = [self.controller.global_ranks[i] for i in np.flatnonzero(every)]
        if not failed:
            return
        if error is not None:
            raise HvdliteError(f"GPU operation failed on rank {self.rank} before its collective: "
                               f"{type(error).__name__}: {error}. No rank ran it (failed on "
                               f"ranks {failed}).") from error
        raise HvdliteError(f"GPU operation failed on rank(s) {failed} before its collective, so "
                           f"no rank ran it; their output says why.")

    def _close_paths(self, collective: bool, abort: bool) -> None:
        """Let queued device work finish (unless ``abort``: peers may be gone), then release
        every path's resources (``collective``: every rank of the set is here too)."""
        self._close_device_work(abort)
        for path in self.paths:
            try:
                path.close(collective=collective, abort=abort)
            except Exception:   # noqa: BLE001 - teardown must not mask the original outcome
                log.exception("hvdlite: closing the %s data path failed", path.name)

    def _close_device_work(self, abort: bool) -> None:
        """Stop the GPU completion thread: after the queued device work finished, or, when
        ``abort``, after aborting the device paths (NCCL kernels may wait for gone peers)."""
        completions, self._gpu_completions = self._gpu_completions, None
        if completions is None:
            return
        if not abort:
            completions.close()
            return
        for path in self.paths:
            if path.device:
                try:
                    path.close(collective=False, abort=True)
                except Exception:   # noqa: BLE001 - teardown must not mask the original outcome
                    log.exception("hvdlite: closing the %s data path failed", path.name)
        completions.close(timeout=5.0)

    def _complete_batch(self, entries: list[Entry]) -> None:
        """Complete successful entries with one lock round-trip for the whole batch."""
        sink = entries[0].handle
        if type(sink) is GroupSink and all(entry.handle is sink for entry in entries):
            # members of one grouped allreduce, which are not in the table (their group is)
            tl = _timeline.ACTIVE
            if tl is not None:
                tl.op_end([entry.name for entry in entries])
            sink.completed(len(entries))
            return
        in_flight = self._in_flight
        pop = in_flight.pop
        with self._lock:
            for entry in entries:
                other = pop(entry.request[0], None)   # [0]: the name
                if other is not entry and other is not None:
                    # a grouped allreduce's member is not in the table (its group is); this
                    # is another operation under the member's name
                    in_flight[entry.request[0]] = other
        tl = _timeline.ACTIVE
        if tl is not None:
            tl.op_end([entry.name for entry in entries])
        for entry in entries:
            entry.group = None   # see _complete
            entry.handle._complete(entry.output, None)

    def _complete(self, entry: Entry, result=None, error: BaseException | None = None) -> None:
        with self._lock:
            other = self._in_flight.pop(entry.name, None)
            if other is not entry and other is not None:   # (see _complete_batch)
                self._in_flight[entry.name] = other
        tl = _timeline.ACTIVE
        if tl is not None:
            tl.op_end([entry.name])
        # A grouped entry and its group's member list refer to each other; left in place, the
        # cycle keeps every member's input and result alive until Python's cyclic collector
        # runs (many steps later: a training loop then gets fresh, page-faulting memory for
        # every result, and the framework's gradient buffers are not reused either).
        entry.group = None
        entry.members = None   # (a grouped allreduce's members refer back to it: see above)
        # The entry may outlive this call (the round that completed it still lists it), and an
        # error raised to the user carries the user's frames in its traceback: hand the handle
        # over instead of keeping it, so that nothing here keeps those frames alive.
        handle, entry.handle = entry.handle, None
        if handle is not None:
            handle._complete(result, error)

    def _finish_packed(self, entry: Entry, error: BaseException | None,
                       device_ready: list[Callable[[], None]]) -> None:
        """Every member of the grouped allreduce ``entry`` has completed (see GroupSink)."""
        members, entry.members = entry.members, None   # (members -> sink -> entry: no cycle)
        handle = entry.handle
        if error is None and device_ready and handle is not None:
            handle._device_ready = functools.partial(_run_all, device_ready)
        self._complete(entry, None if error is not None else [m.output for m in members], error)

    def _stop_after_shutdown(self, ranks: tuple[int, ...]) -> None:
        if self.rank in ranks:
            reason = "hvdlite has been shut down; call hvd.init() to use it again."
            self._fail_everything(ShutdownError(reason), reason, per_entry=lambda e: ShutdownError(
                f"hvdlite was shut down on rank {self.rank} while {e.name!r} was pending."))
            return
        others = [r for r in ranks if r != self.rank]
        reason = (f"hvdlite stopped because rank(s) {others} shut down (their script ended, "
                  f"raised an exception, or called hvd.shutdown()); no further collective "
                  f"operations are possible in this job. Look at rank(s) {others}'s output for "
                  f"the cause.")
        self._fail_everything(RankExitedError(reason), reason, per_entry=lambda e: RankExitedError(
            f"Rank(s) {others} shut down hvdlite (their script ended, raised an exception, or "
            f"called hvd.shutdown()) while tensor {e.name!r} was still pending on rank "
            f"{self.rank}. Look at rank(s) {others}'s output for the cause."))

    def _fail_everything(self, error: BaseException, reason: str, per_entry=None) -> None:
        with self._lock:
            self._stopped = reason
            if isinstance(error, ShutdownError):
                self._stopped_cls = type(error)
            entries = self.in_flight.drain()
        for entry in entries:
            self._complete(entry, error=per_entry(entry) if per_entry else error)
