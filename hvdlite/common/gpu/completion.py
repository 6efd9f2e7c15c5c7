"""Completing GPU operations once the device work behind them has finished.

The engine thread queues device work and moves straight on to the next negotiation round; this
thread waits (asleep: the events use blocking synchronisation) for each batch's event, in order.
With ``HVDLITE_ENABLE_ASYNC_COMPLETION=0`` it only then completes the handles, so a caller's
``wait()`` returns data that is ready everywhere.  Under asynchronous completion (the default) the
engine has completed them already; this thread then only holds the batch's memory (inputs,
staging buffers) until the device is done with it.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from hvdlite.common.errors import HvdliteError

log = logging.getLogger("hvdlite")


class GpuCompletions:
    def __init__(self, runtime, complete: Callable[[list], None],
                 fail: Callable[[object, BaseException], None]) -> None:
        self._rt = runtime
        self._complete = complete
        self._fail = fail
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="hvdlite-gpu-completion",
                                        daemon=True)
        self._thread.start()

    def put(self, event: Any, entries: list, keep_alive: Any,
            completed: bool = False) -> None:
        """``keep_alive`` (staging buffers, device copies) and the entries' arrays are held
        until ``event`` fires; then the entries complete, unless they were ``completed``
        already (asynchronous completion: only the memory is held here)."""
        self._queue.put((event, entries, keep_alive, completed))

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
            event, entries, _keep_alive, completed = item
            try:
                self._rt.event_wait(event)
            except Exception as exc:   # a CUDA error surfaces here: fail these, keep serving
                if completed:   # handed out already; the framework sees the (sticky) error
                    log.error("hvdlite: GPU work for %s failed after its handles completed: %s "
                              "(asynchronous completion; HVDLITE_ENABLE_ASYNC_COMPLETION=0 "
                              "makes synchronize() raise such errors)",
                              [e.name for e in entries], exc)
                    continue
                log.error("hvdlite: GPU work failed: %s", exc)
                error = HvdliteError(f"GPU work for {[e.name for e in entries]} failed on the "
                                     f"device: {type(exc).__name__}: {exc}")
                for entry in entries:
                    self._fail(entry, error)
                continue
            recycle = getattr(self._rt, "recycle", None)
            if recycle is not None:
                recycle(event)
            if not completed:
                self._complete(entries)
