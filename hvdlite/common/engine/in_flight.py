"""The one table of an engine's operations in flight: every entry submitted and not yet
completed (by name, for duplicate names and for failing them all when the engine stops), the
part of it still being negotiated (the controller's view), and whether the engine still takes
new entries (admission and completion share both under one lock)."""
from __future__ import annotations

import threading

from hvdlite.common.engine.handle import Entry
from hvdlite.common.errors import ShutdownError


class InFlight:
    def __init__(self) -> None:
        # Guards ``entries`` (user threads admit, the engine thread completes) and the stop
        # state below, which admission checks under the same lock.
        self.lock = threading.Lock()
        self.entries: dict[str, Entry] = {}       # submitted, not completed
        self.negotiating: dict[str, Entry] = {}   # of those, not negotiated yet (engine thread)
        # No new entries are taken (stopped, or shutting down): one test on the submission
        # hot path instead of two.
        self.closed = False
        self.shutdown_requested = False
        self.stopped: str | None = None           # why the engine stopped, once it has
        self.stopped_cls: type[ShutdownError] = ShutdownError

    def refusal(self) -> ShutdownError:
        """The error a new entry meets once the table is closed (caller holds the lock)."""
        if self.stopped is not None:
            return self.stopped_cls(self.stopped)
        return ShutdownError("hvdlite is shutting down; no new operations are accepted.")

    def request_shutdown(self) -> None:
        """Take no new entries: the engine is shutting down (caller holds the lock)."""
        self.shutdown_requested = self.closed = True

    def stop(self, reason: str, cls: type[ShutdownError] | None = None) -> None:
        """The engine stopped for ``reason``; new entries raise ``cls`` (if given) with it
        (caller holds the lock)."""
        self.stopped, self.closed = reason, True
        if cls is not None:
            self.stopped_cls = cls

    def drain(self) -> list[Entry]:
        """Every entry in flight, now forgotten (caller holds the lock)."""
        entries = list(self.entries.values())
        self.entries.clear()
        self.negotiating.clear()
        return entries
