"""Completing GPU operations once the device work behind them has finished.

The engine thread queues device work and moves straight on to the next negotiation round; this
thread waits (asleep: the events use blocking synchronisation) for each batch's event, in order,
and only then completes the handles, so a caller's ``wait()`` returns data the framework can use.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from .errors import HvdliteError
from .handle import Entry

log = logging.getLogger("hvdlite")


class GpuCompletions:
    def __init__(self, runtime, complete: Callable[[list[Entry]], None],
                 fail: Callable[[Entry, BaseException], None]) -> None:
        self._rt = runtime
        self._complete = complete
        self._fail = fail
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="hvdlite-gpu-completion",
                                        daemon=True)
        self._thread.start()

    def put(self, event: Any, entries: list[Entry], keep_alive: Any) -> None:
        """``keep_alive`` (staging buffers, device copies) is held until ``event`` fires."""
        self._queue.put((event, entries, keep_alive))

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish what is queued, then stop."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, entries, _keep_alive = item
            try:
                self._rt.event_wait(event)
            except Exception as exc:   # a CUDA error surfaces here: fail these, keep serving
                log.error("hvdlite: GPU work failed: %s", exc)
                error = HvdliteError(f"GPU work for {[e.name for e in entries]} failed on the "
                                     f"device: {type(exc).__name__}: {exc}")
                for entry in entries:
                    self._fail(entry, error)
                continue
            self._complete(entries)
