"""Async work handles and the entries the engine carries for them."""
from __future__ import annotations

import _thread
import time
from typing import Any, Callable

import numpy as np

from hvdlite.common.engine.messages import Request
from hvdlite.common.runtime.waiting import caller_blocked, poll_briefly

# A small operation's result often arrives within a thread wake-up, so wait() polls this long
# (yielding the core) before sleeping on the lock: a lone 4 KiB allreduce 0.13 ms instead of 0.16.
WAIT_POLL_SECONDS = 200e-6


class Handle:
    """Completion handle of one asynchronous collective.

    ``poll()`` never blocks; ``wait()`` blocks until the operation finished on this rank and
    returns its result or raises its error.  For a GPU result under asynchronous completion
    (the default), "finished" means queued on the device: ``wait()`` then makes the framework's
    current stream wait for it, so work queued there afterwards sees the result.
    Post-processing registered by an adapter (wrapping a numpy result into a framework tensor,
    copying back into a non-contiguous input, ...) runs once, on the thread that waits.
    """

    __slots__ = ("name", "_done", "_lock", "_result", "_error", "_post", "_engine_alive",
                 "_device_ready")

    def __init__(self, name: str, engine_alive: Callable[[], bool]) -> None:
        self.name = name
        self._done = False
        self._lock = _thread.allocate_lock()   # held until completion: waiting = acquiring
        self._lock.acquire()
        self._result: Any = None
        self._error: BaseException | None = None
        self._post: list[Callable[[Any], Any]] | None = None
        self._engine_alive = engine_alive
        # GPU results completed before their device work finished (asynchronous completion):
        # called once by the first wait(), before post-processing, to order the framework's
        # stream after that work.
        self._device_ready: Callable[[], None] | None = None

    # --- engine side -------------------------------------------------------------------------
    def _complete(self, result: Any = None, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._result, self._error = result, error
        self._done = True
        self._lock.release()

    # --- user side ---------------------------------------------------------------------------
    def then(self, fn: Callable[[Any], Any]) -> "Handle":
        """Transform the result when it is waited for (adapters use this)."""
        if self._post is None:
            self._post = []
        self._post.append(fn)
        return self

    def poll(self) -> bool:
        """True once the operation has completed (successfully or not)."""
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the operation's error."""
        if not self._done and not poll_briefly(self.poll, WAIT_POLL_SECONDS):
            with caller_blocked():
                self._block(timeout)
        if self._error is not None:
            try:   # the operation was submitted: its error must not be announced again
                self._error._hvdlite_announced = True
            except AttributeError:
                pass
            raise self._error
        if self._device_ready is not None:
            ready, self._device_ready = self._device_ready, None
            ready()
        if self._post:
            post, self._post = self._post, None
            for fn in post:
                self._result = fn(self._result)
        return self._result

    synchronize = wait

    def _block(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        # Bounded waits so a vanished background thread is noticed instead of hanging.
        while not self._lock.acquire(True, 1.0 if deadline is None else
                                     max(0.0, min(1.0, deadline - time.monotonic()))):
            if self._done:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"hvdlite operation {self.name!r} did not finish "
                                   f"within {timeout} s.")
            if not self._engine_alive():
                from hvdlite.common.errors import ShutdownError
                raise ShutdownError(f"hvdlite's background thread is gone; operation "
                                    f"{self.name!r} can never finish.")
        self._lock.release()   # let other waiters of the same handle through

    def __repr__(self) -> str:
        return f"<hvdlite.Handle {self.name!r} {'done' if self._done else 'pending'}>"


class GroupHandle:
    """Handle of a grouped operation: ``wait()`` returns the members' results as a list.

    ``handle``: the group's one handle, whose result is that list (see :class:`GroupSink`), or
    None for a group of no tensors (its result is ``[]``).  ``handles`` lists it, for callers
    that wait on each handle of a group."""

    __slots__ = ("name", "handles", "_post")

    def __init__(self, name: str, handle: Handle | None) -> None:
        self.name = name
        self.handles = [] if handle is None else [handle]
        self._post: list[Callable[[Any], Any]] = []

    def then(self, fn: Callable[[Any], Any]) -> "GroupHandle":
        self._post.append(fn)
        return self

    def poll(self) -> bool:
        return all(h.poll() for h in self.handles)

    def wait(self, timeout: float | None = None) -> Any:
        results = self.handles[0].wait(timeout) if self.handles else []
        post, self._post = self._post, []
        for fn in post:
            results = fn(results)
        return results

    synchronize = wait

    def __repr__(self) -> str:
        return f"<hvdlite.GroupHandle {self.name!r} {'done' if self.poll() else 'pending'}>"


class GroupSink:
    """The ``handle`` of every member of a grouped operation (one request, see
    ``Request.layout``): the engine completes the members batch by batch, and once every one
    has reported, ``finish(error, device_ready)`` completes the group: ``error`` is the first
    member's error, if any; ``device_ready``, the members' GPU readiness callbacks (asynchronous
    completion) to run before the results are used."""

    __slots__ = ("name", "_left", "_error", "_lock", "_finish", "_readies")

    def __init__(self, name: str, count: int,
                 finish: Callable[[BaseException | None, list], None]) -> None:
        self.name = name
        self._left = count
        self._error: BaseException | None = None
        self._lock = _thread.allocate_lock()   # members may complete on different threads
        self._finish = finish
        self._readies: list[Callable[[], None]] = []

    @property
    def _device_ready(self) -> None:
        return None

    @_device_ready.setter
    def _device_ready(self, ready: Callable[[], None] | None) -> None:
        # One per batch of members, set on each of the batch's members: all of them run
        # before the results are used, each once.
        if ready is not None and not (self._readies and self._readies[-1] is ready):
            self._readies.append(ready)

    def _complete(self, result: Any = None, error: BaseException | None = None) -> None:
        self.completed(1, error)

    def completed(self, count: int, error: BaseException | None = None) -> None:
        """``count`` members have completed (with ``error``, if not None)."""
        with self._lock:
            if self._left <= 0:   # the group has finished already
                return
            self._left -= count
            if error is not None and self._error is None:
                self._error = error
            last = self._left <= 0
        if last:
            self._finish(self._error, self._readies)

    def __repr__(self) -> str:
        return f"<hvdlite.GroupSink {self.name!r} {self._left} pending>"


class Entry:
    """One submitted operation, as the engine sees it."""

    __slots__ = ("request", "array", "output", "allocate", "handle", "submitted_at",
                 "slot", "sent", "next_stall_report", "nbytes", "stand_in", "members")

    def __init__(self, request: Request, array: np.ndarray | None, output: np.ndarray | None,
                 allocate: Callable[[tuple, np.dtype], np.ndarray] | None, handle: Handle) -> None:
        self.request = request
        self.array = array          # contiguous input view (arithmetic dtype)
        self.output = output        # contiguous output view, or None if allocated at execution
        self.allocate = allocate    # allocator for outputs whose shape is known only after
        self.handle = handle        # negotiation (allgather)
        self.submitted_at = time.monotonic()
        self.slot: int | None = None   # response-cache slot announced for this entry
        self.sent = False              # full request already delivered to the coordinator
        self.next_stall_report = 0.0
        self.nbytes = 0 if array is None else array.nbytes
        self.stand_in = False   # a joined rank's neutral contribution: never prescaled
        # A grouped operation: its members' entries (what the data paths execute; each one's
        # handle is the group's GroupSink)
        self.members: list[Entry] | None = None

    @property
    def name(self) -> str:
        return self.request.name
