"""The engine's first stage: taking entries from user threads and handing them to the loop.

User threads check and register entries in the in-flight table (duplicate names and a stopped
engine are refused here, before anything is in flight) and queue them; the engine thread takes
what was queued at the start of each round, waiting briefly for more while a producer announced
a stream of submissions (gradient hooks during backward).
"""
from __future__ import annotations

import functools
import queue
import threading
import time
from typing import Callable

from hvdlite.common.config import Config
from hvdlite.common.engine.completion import Completion
from hvdlite.common.engine.controller import IDLE_TICK_SECONDS
from hvdlite.common.engine.handle import Entry, GroupSink, Handle
from hvdlite.common.engine.in_flight import InFlight
from hvdlite.common.errors import DuplicateNameError
from hvdlite.common.runtime.waiting import poll_briefly

# A training loop's next submission usually follows within microseconds of a completion; the
# engine polls its queue this long (yielding the core) before blocking, which saves a thread
# wake-up (~50 us here) per lone operation.
IDLE_POLL_SECONDS = 200e-6


class Admission:
    """Entries submitted to one engine, from their submission to their round.

    ``busy()``: whether the engine has work pending (then it does not block for new entries);
    ``config.cycle_seconds``: how long a round gathers a stream's entries; ``completion``: the
    stage that completes a grouped allreduce's handle once its members have."""

    def __init__(self, in_flight: InFlight, rank: int, busy: Callable[[], bool],
                 config: Config, completion: Completion) -> None:
        self.in_flight = in_flight
        self.rank = rank
        # the table's lock and entries under short names for the submission hot path
        self._lock, self._entries = in_flight.lock, in_flight.entries
        self._busy = busy
        self.config = config
        self._completion = completion
        self._queue: queue.SimpleQueue = queue.SimpleQueue()   # entries (or None = wake up)
        # Producers that announced a stream of submissions (DistributedOptimizer during
        # backward): while any is open, a round waits up to a cycle time for more entries.
        self.open_streams = 0
        self._stream_closed = threading.Event()

    # --- user threads ------------------------------------------------------------------------
    def submit(self, entry: Entry) -> Handle:
        """Register and queue one entry; its handle."""
        name = entry.request.name
        # Taken before the entry is queued: once queued, the engine thread may run the whole
        # operation and complete it (Completion.complete hands ``entry.handle`` over and sets it
        # to None) before this thread runs again.  Read after the put, a loaded machine then
        # returned None: an empty GroupHandle, whose wait() gave [] at once, so the caller (a
        # DistributedOptimizer) kept its unreduced gradients while the peers used this rank's.
        handle = entry.handle
        with self._lock:
            if self.in_flight.closed:
                raise self.in_flight.refusal()
            if name in self._entries:
                raise DuplicateNameError(
                    f"A tensor named {name!r} is already in flight on rank {self.rank}. "
                    f"Names must be unique among pending operations: wait for the first one "
                    f"(hvd.synchronize) or give the second a different name.")
            self._entries[name] = entry
        self._queue.put(entry)
        return handle

    def submit_group(self, entry: Entry) -> Handle:
        """Submit a grouped operation, negotiated as one request (``entry``, whose ``members``
        are the members' entries): one entry, one cache slot and one handle for the whole
        group, whose result is the list of the members' results."""
        members = entry.members
        sink = GroupSink(entry.name, len(members),
                         functools.partial(self._completion.finish_group, entry))
        for member in members:
            member.handle = sink
        return self.submit(entry)

    def stream_open(self) -> None:
        """A caller starts submitting a burst of entries, one at a time (gradient hooks during
        backward).  Until :meth:`stream_close`, the engine lets each round gather entries for
        up to one cycle time instead of negotiating every entry as it arrives: a round's fixed
        cost (tens of microseconds of Python) paid per gradient competes with backward for the
        interpreter, and the hooks and the rounds then take turns.  Lone operations and
        synchronous loops, which open no stream, keep their latency."""
        with self._lock:
            self.open_streams += 1

    def stream_close(self) -> None:
        """The burst announced by :meth:`stream_open` is over (or abandoned)."""
        with self._lock:
            self.open_streams = max(0, self.open_streams - 1)
        self._stream_closed.set()

    def request_shutdown(self) -> None:
        """Refuse new entries from now on, and wake the engine thread to shut down."""
        with self._lock:
            self.in_flight.request_shutdown()
        self.wake()

    def wake(self) -> None:
        """Wake the engine thread if it waits for entries."""
        self._queue.put(None)

    # --- engine thread -----------------------------------------------------------------------
    def take_work(self, pause: float) -> tuple[list[Entry], bool]:
        """New entries since the last round, and whether a shutdown was requested; blocks only
        when there is nothing to negotiate (``pause``: wait that long first)."""
        q = self._queue
        new: list[Entry] = []
        if (q.empty() and not (pause == 0.0 and self._busy())
                and (pause > 0 or not poll_briefly(lambda: not q.empty(), IDLE_POLL_SECONDS))):
            try:
                item = q.get(timeout=pause if pause > 0 else IDLE_TICK_SECONDS)
                if item is not None:
                    new.append(item)
            except queue.Empty:
                pass
        self._drain(new)
        if new and self.open_streams and pause == 0.0:
            self._gather_stream(new)
        return new, self.in_flight.shutdown_requested

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
        while self.open_streams:
            left = deadline - time.perf_counter()
            if left <= 0 or not self._stream_closed.wait(left):
                break
            self._stream_closed.clear()
        self._drain(new)
