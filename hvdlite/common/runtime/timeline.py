"""Horovod Timeline: a Chrome-tracing record of what the background thread does, per tensor.

As in Horovod, only rank 0 records (it coordinates negotiation, so it sees every rank's
readiness).  Each tensor gets its own row ("process" in the trace):

* ``NEGOTIATE_<OP>`` from the moment rank 0 first hears of the tensor (its own submission, even
  if the background thread was busy then, or a peer's request) until every rank has it; each
  rank's request is a tick named after the rank (only visible for tensors negotiated in full: a
  cached tensor's readiness travels as one bit per rank ANDed together, so its span simply
  shows how long rank 0 waited);
* ``<OP>`` while the operation is processed, with nested activities: ``QUEUE`` (waiting behind
  earlier batches), ``MEMCPY_IN_FUSION_BUFFER`` / ``MEMCPY_OUT_FUSION_BUFFER``,
  ``<PATH>_<OP>`` after the data path (``SHARED_WINDOW_ALLREDUCE``, ``MPI_<OP>``,
  ``NCCL_<OP>``...);
* an ``ERROR`` instant, with the message, when negotiation fails the tensor.

``mark_cycles`` adds a ``CYCLE_START`` instant at every negotiation round.

The engine only appends tuples to a deque (thread-safe, no formatting on the hot path); a writer
thread turns them into JSON and flushes about once a second, so the file can be watched while a
job runs.  ``stop()`` closes the JSON array, so a finished file is valid JSON; a file cut short by
a crash still opens in ``chrome://tracing`` (it tolerates the missing ``]``).
"""
from __future__ import annotations

import collections
import json
import threading
import time

ACTIVE: "Timeline | None" = None   # the running timeline of this process (rank 0 only)
_lock = threading.Lock()            # serializes start/stop

FLUSH_SECONDS = 1.0
_NEGOTIATING = "negotiating"


class Timeline:
    """One timeline file being written.  Methods other than ``close`` are called by the engine
    (and the GPU completion thread), so they only record; the writer thread formats."""

    def __init__(self, path: str, mark_cycles: bool) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self._file = open(path, "w", encoding="utf-8")   # raises at start if the path is bad
        self._t0 = time.perf_counter_ns()
        # submission times are time.monotonic() seconds; events use perf_counter_ns
        self._from_monotonic = self._t0 - time.monotonic_ns()
        self._events: collections.deque = collections.deque()
        self._state: dict[str, list[str]] = {}   # tensor -> open spans, outermost first
        self._state_lock = threading.Lock()      # engine and GPU completion thread both record
        self._rows: dict[str, int] = {}          # tensor -> pid (writer thread only)
        self._first = True
        self._stop = threading.Event()
        self._write_raw("[\n")
        self._write_event({"name": "process_name", "ph": "M", "pid": 0,
                           "args": {"name": "hvdlite",
                                    "start_time_since_epoch_in_micros": time.time_ns() // 1000}})
        self._write_event({"name": "process_sort_index", "ph": "M", "pid": 0,
                           "args": {"sort_index": 0}})
        self._writer = threading.Thread(target=self._write_loop, name="hvdlite-timeline",
                                        daemon=True)
        self._writer.start()

    # --- recording (engine side) -------------------------------------------------------------
    def _now(self) -> int:
        return time.perf_counter_ns()

    def negotiate_start(self, tensor: str, kind: str, submitted_at: float | None = None) -> None:
        """Rank 0 heard of ``tensor``: submitted here at ``submitted_at`` (``time.monotonic()``
        seconds), or now."""
        now = self._now()
        if submitted_at is not None:   # never later than now, never before this timeline
            now = min(now, max(self._t0, int(submitted_at * 1e9) + self._from_monotonic))
        with self._state_lock:
            if tensor not in self._state:
                self._state[tensor] = [_NEGOTIATING]
                self._events.append(("B", tensor, f"NEGOTIATE_{kind.upper()}", now, None))

    def negotiate_tick(self, tensor: str, kind: str, rank: int) -> None:
        """Rank ``rank``'s request for ``tensor`` reached the coordinator."""
        self.negotiate_start(tensor, kind)
        self._events.append(("X", tensor, str(rank), self._now(), None))

    def negotiate_end(self, tensor: str, kind: str, error: str | None = None) -> None:
        """Every rank has the tensor: negotiation ends and processing starts (queued), or it
        failed with ``error``."""
        now = self._now()
        with self._state_lock:
            spans = self._state.pop(tensor, None)
            if spans is None:   # negotiated while the timeline was off, or a stand-in
                self._events.append(("B", tensor, f"NEGOTIATE_{kind.upper()}", now, None))
            self._events.append(("E", tensor, None, now, None))
            if error is not None:
                self._events.append(("i", tensor, "ERROR", now, {"message": error}))
                return
            self._state[tensor] = [kind.upper(), "QUEUE"]
            self._events.append(("B", tensor, kind.upper(), now, None))
            self._events.append(("B", tensor, "QUEUE", now, None))

    def _processing(self, tensors):
        """(tensor, its open spans) for those of ``tensors`` being processed (caller holds the
        state lock); others (negotiating, or unknown to this timeline) are skipped."""
        for tensor in tensors:
            spans = self._state.get(tensor)
            if spans is not None and spans[0] != _NEGOTIATING:
                yield tensor, spans

    def activity(self, tensors, name: str) -> None:
        """The tensors' processing moves on to activity ``name`` (ending the previous one)."""
        now = self._now()
        with self._state_lock:
            for tensor, spans in self._processing(tensors):
                if len(spans) > 1:
                    self._events.append(("E", tensor, None, now, None))
                    spans.pop()
                spans.append(name)
                self._events.append(("B", tensor, name, now, None))

    def op_end(self, tensors) -> None:
        """The tensors' operations completed (successfully or not)."""
        now = self._now()
        with self._state_lock:
            for tensor, spans in list(self._processing(tensors)):
                del self._state[tensor]
                for _ in spans:
                    self._events.append(("E", tensor, None, now, None))

    def cycle(self) -> None:
        if self.mark_cycles:
            self._events.append(("i", None, "CYCLE_START", self._now(), None))

    # --- writing (writer thread) -------------------------------------------------------------
    def _write_raw(self, text: str) -> None:
        self._file.write(text)

    def _write_event(self, event: dict) -> None:
        self._write_raw(("" if self._first else ",\n") + json.dumps(event))
        self._first = False

    def _row(self, tensor: str | None) -> int:
        if tensor is None:
            return 0
        pid = self._rows.get(tensor)
        if pid is None:
            pid = self._rows[tensor] = len(self._rows) + 1
            self._write_event({"name": "process_name", "ph": "M", "pid": pid,
                               "args": {"name": tensor}})
            self._write_event({"name": "process_sort_index", "ph": "M", "pid": pid,
                               "args": {"sort_index": pid}})
        return pid

    def _drain(self) -> None:
        events, t0 = self._events, self._t0
        while events:
            ph, tensor, name, t, args = events.popleft()
            event = {"ph": ph, "ts": (t - t0) / 1000.0, "pid": self._row(tensor)}
            if name is not None:
                event["name"] = name
            if ph == "X":
                event["dur"] = 0
            elif ph == "i":
                event["s"] = "g" if tensor is None else "p"
            if args is not None:
                event["args"] = args
            self._write_event(event)
        self._file.flush()

    def _write_loop(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            self._drain()

    def close(self) -> None:
        """Write what is left, close every span still open (operations cut off by the stop)
        and the JSON array."""
        self._stop.set()
        self._writer.join()
        with self._state_lock:
            now = self._now()
            for tensor, spans in self._state.items():
                for _ in spans:
                    self._events.append(("E", tensor, None, now, None))
            self._state.clear()
        self._drain()
        self._write_raw("\n]\n")
        self._file.close()


def start(path: str, mark_cycles: bool = False) -> None:
    """Start recording to ``path`` (replacing a timeline already running)."""
    global ACTIVE
    if not isinstance(path, str) or not path:
        raise ValueError(f"start_timeline needs a file path, got {path!r}.")
    with _lock:
        try:
            new = Timeline(path, mark_cycles)
        except OSError as exc:
            raise ValueError(f"hvdlite cannot write the timeline file {path!r}: {exc}. Pass a "
                             f"path in a writable directory (HVDLITE_TIMELINE / "
                             f"hvd.start_timeline).") from exc
        old, ACTIVE = ACTIVE, new
    if old is not None:
        old.close()


def stop() -> None:
    """Stop recording and close the file (nothing happens if no timeline is running)."""
    global ACTIVE
    with _lock:
        old, ACTIVE = ACTIVE, None
    if old is not None:
        old.close()
