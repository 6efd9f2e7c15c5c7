"""The engine's last stage: completing handles, and failing everything when the engine stops.

Entries leave the in-flight table here (one lock round-trip per executed batch), their handles
get their results or errors, and the references that would keep a step's tensors alive (a
group's member lists, the handle's frames) are dropped.  When the engine stops (shutdown, a
departed peer, a broken engine thread) every waiter is told why, naming its tensor.
"""
from __future__ import annotations

import functools
from typing import Callable

from hvdlite.common.engine.handle import Entry, GroupSink
from hvdlite.common.engine.in_flight import InFlight
from hvdlite.common.errors import RankExitedError, ShutdownError
from hvdlite.common.runtime import timeline as _timeline


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


class Completion:
    """Completes the entries of one engine (``rank``: its global rank, for messages)."""

    def __init__(self, in_flight: InFlight, rank: int) -> None:
        self.in_flight = in_flight
        self.rank = rank
        # the table's lock and entries under short names: completing a batch is a hot path
        self._lock, self._entries = in_flight.lock, in_flight.entries

    def complete_batch(self, entries: list[Entry]) -> None:
        """Complete successful entries with one lock round-trip for the whole batch."""
        sink = entries[0].handle
        if type(sink) is GroupSink and all(entry.handle is sink for entry in entries):
            # members of one group, which are not in the table (their group is)
            tl = _timeline.ACTIVE
            if tl is not None:
                tl.op_end([entry.name for entry in entries])
            sink.completed(len(entries))
            return
        in_flight = self._entries
        pop = in_flight.pop
        with self._lock:
            for entry in entries:
                name = entry.request.name
                other = pop(name, None)
                if other is not entry and other is not None:
                    # a group's member is not in the table (the group is); this
                    # is another operation under the member's name
                    in_flight[name] = other
        tl = _timeline.ACTIVE
        if tl is not None:
            tl.op_end([entry.name for entry in entries])
        for entry in entries:
            entry.handle._complete(entry.output, None)

    def complete(self, entry: Entry, result=None, error: BaseException | None = None) -> None:
        """Complete one entry with ``result`` or ``error``."""
        with self._lock:
            other = self._entries.pop(entry.name, None)
            if other is not entry and other is not None:   # (see complete_batch)
                self._entries[entry.name] = other
        tl = _timeline.ACTIVE
        if tl is not None:
            tl.op_end([entry.name])
        # A group's entry and its members refer to each other (through the members' GroupSink);
        # left in place, the cycle keeps every member's input and result alive until Python's
        # cyclic collector runs (many steps later: a training loop then gets fresh,
        # page-faulting memory for every result, and the framework's gradient buffers are not
        # reused either).
        entry.members = None
        # The entry may outlive this call (the round that completed it still lists it), and an
        # error raised to the user carries the user's frames in its traceback: hand the handle
        # over instead of keeping it, so that nothing here keeps those frames alive.
        handle, entry.handle = entry.handle, None
        if handle is not None:
            handle._complete(result, error)

    def finish_group(self, entry: Entry, error: BaseException | None,
                     device_ready: list[Callable[[], None]]) -> None:
        """Every member of the group ``entry`` has completed (see GroupSink)."""
        members, entry.members = entry.members, None   # (members -> sink -> entry: no cycle)
        handle = entry.handle
        if error is None and device_ready and handle is not None:
            handle._device_ready = functools.partial(_run_all, device_ready)
        self.complete(entry, None if error is not None else [m.output for m in members], error)

    def fail_departed(self, reason: str) -> None:
        """Peers are gone (any thread): refuse new entries and fail every one in flight now,
        naming its tensor.  The engine thread's own tables stay its own: it clears them."""
        with self._lock:
            self.in_flight.stop(reason, RankExitedError)
            entries = list(self._entries.values())
        for entry in entries:
            handle = entry.handle
            if handle is not None:
                handle._complete(None, RankExitedError(
                    f"Tensor {entry.name!r} was still pending on rank {self.rank}: {reason}"))

    def stop_after_shutdown(self, ranks: tuple[int, ...]) -> None:
        """The ranks ``ranks`` shut down in this round: fail what is left, saying who did."""
        if self.rank in ranks:
            reason = "hvdlite has been shut down; call hvd.init() to use it again."
            self.fail_everything(ShutdownError(reason), reason, per_entry=lambda e: ShutdownError(
                f"hvdlite was shut down on rank {self.rank} while {e.name!r} was pending."))
            return
        others = [r for r in ranks if r != self.rank]
        reason = (f"hvdlite stopped because rank(s) {others} shut down (their script ended, "
                  f"raised an exception, or called hvd.shutdown()); no further collective "
                  f"operations are possible in this job. Look at rank(s) {others}'s output for "
                  f"the cause.")
        self.fail_everything(RankExitedError(reason), reason, per_entry=lambda e: RankExitedError(
            f"Rank(s) {others} shut down hvdlite (their script ended, raised an exception, or "
            f"called hvd.shutdown()) while tensor {e.name!r} was still pending on rank "
            f"{self.rank}. Look at rank(s) {others}'s output for the cause."))

    def fail_everything(self, error: BaseException, reason: str,
                        per_entry: Callable[[Entry], BaseException] | None = None) -> None:
        """Stop taking entries (for ``reason``) and fail every one in flight with ``error``,
        or with ``per_entry(entry)`` if given."""
        with self._lock:
            self.in_flight.stop(reason, type(error) if isinstance(error, ShutdownError)
                                else None)
            entries = self.in_flight.drain()
        for entry in entries:
            self.complete(entry, error=per_entry(entry) if per_entry else error)
