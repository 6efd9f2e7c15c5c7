"""The one table of an engine's operations in flight: every entry submitted and not yet
completed (by name, for duplicate names and for failing them all when the engine stops), and
the part of it still being negotiated (the controller's view)."""
from __future__ import annotations

import threading

from hvdlite.common.engine.handle import Entry


class InFlight:
    def __init__(self) -> None:
        # Guards ``entries`` (user threads admit, the engine thread completes) and the engine's
        # stop state, which admission checks under the same lock.
        self.lock = threading.Lock()
        self.entries: dict[str, Entry] = {}       # submitted, not completed
        self.negotiating: dict[str, Entry] = {}   # of those, not negotiated yet (engine thread)

    def drain(self) -> list[Entry]:
        """Every entry in flight, now forgotten (caller holds the lock)."""
        entries = list(self.entries.values())
        self.entries.clear()
        self.negotiating.clear()
        return entries
