"""Negotiation over MPI: deciding, identically on every rank, which operations run and when.

One *round* is what every rank's background thread does together:

1. A bitwise AND (one small non-blocking ``Iallreduce``) over three bit sets: cache slots of
   tensors ready here, cache slots this rank found stale, and status flags (negated so that AND
   yields "some rank has it").  In steady state this is the whole negotiation.
2. Only if some rank has a tensor the cache does not know (or asks for a shutdown or a stall
   report) the ranks send their full requests to the coordinator (rank 0) point-to-point; it
   validates tensors that are now ready everywhere and sends back the ordered responses.

Ranks take part in rounds while they have pending work, and every ``IDLE_TICK_SECONDS`` when idle,
so the coordinator always learns within a bounded time who is missing what, and a rank that
shuts down is noticed by the others.  Waiting never spins (see :mod:`waiting`).

Grouped operations are announced through the cache only when every member hits it, and the
coordinator releases a group's responses together, so a group always executes in one round.
A rank that called ``join()`` announces every cached reduction as ready and stands in for tensors
it never submitted with the reduction's identity; the join completes in the first round in which
every rank has joined.

One controller serves one process set (its own communicator); messages name ranks by their
global rank.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from hvdlite.common.config import Config
from hvdlite.common.dtypes import dtype_info, reduction_identity
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import (ERROR_STALL, JOIN, SIGNATURE, Request, Response,
                                            build_response, runs_while_joined)
from hvdlite.common.engine.response_cache import ResponseCache
from hvdlite.common.errors import RankExitedError, StallError
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime import liveness, timeline as _timeline
from hvdlite.common.runtime.waiting import wait_until

log = logging.getLogger("hvdlite")

IDLE_TICK_SECONDS = 0.1   # an idle rank still joins a round this often
TAG_REQUESTS = 7101
TAG_RESPONSES = 7102

F_UNSENT = 1 << 0      # some rank has requests the coordinator has not seen
F_SHUTDOWN = 1 << 1    # some rank is shutting down
F_STALL = 1 << 2       # some rank wants a stall report
F_IDLE = 1 << 3        # some rank has nothing pending (so waiting on it is not a livelock)
F_JOINED = 1 << 4      # some rank has called join()
_ALL_ONES = 0xFFFFFFFFFFFFFFFF
_NEVER = float("inf")
# The coordinator remembers this many tensors that ranks gave up on (stall shutdown), so that a
# rank submitting one of them late is told why it waits alone.
_GAVE_UP_MEMORY = 256


# Up to this many slots, Python's int operations beat numpy's per-call overhead; a round that
# announces a whole model's gradients goes through numpy (200 slots: ~25 us less per round).
_FEW_SLOTS = 16


def _pack(slots: list[int] | set[int], nw: int) -> list[int] | np.ndarray:
    """Bit set of ``slots`` as ``nw`` 64-bit words (slot s = bit s % 64 of word s // 64): a
    list of ints for a few slots, else a uint64 array (either fills a uint64 buffer)."""
    if len(slots) <= _FEW_SLOTS:
        words = [0] * nw
        for slot in slots:
            words[slot >> 6] |= 1 << (slot & 63)
        return words
    bits = np.zeros(nw * 64, dtype=np.uint8)
    bits[list(slots)] = 1
    return np.packbits(bits, bitorder="little").view("<u8").astype(np.uint64)


def _bits(words: list[int]) -> list[int]:
    """The slots set in ``words`` (64-bit ints laid out as :func:`_pack` makes them), in
    increasing order."""
    if sum(word.bit_count() for word in words) > _FEW_SLOTS:
        as_bytes = np.array(words, dtype="<u8").view(np.uint8)
        return np.flatnonzero(np.unpackbits(as_bytes, bitorder="little")).tolist()
    out = []
    for w, value in enumerate(words):
        while value:
            low = value & -value
            out.append((w << 6) + low.bit_length() - 1)
            value ^= low
    return out


class RoundOutcome:
    __slots__ = ("ready", "shutdown_ranks", "progress", "everyone_busy", "joined")

    def __init__(self) -> None:
        self.ready: list[tuple[Response, Entry | None]] = []  # in execution order
        self.shutdown_ranks: tuple[int, ...] = ()
        self.progress = False
        self.everyone_busy = False
        self.joined: tuple[Entry, int] | None = None   # (join entry, last rank to join)


def _stand_in(response: Response) -> Entry:
    """What a joined rank contributes to a reduction it never submitted: the identity."""
    from hvdlite.common.engine.handle import Handle
    info = dtype_info(response.dtype)
    array = reduction_identity(info, ReduceOp(response.reduce_op), response.shape)
    request = Request(response.name, response.kind, response.dtype, response.shape,
                      response.reduce_op, response.root, response.device, response.prescale,
                      response.postscale, cacheable=response.cacheable)
    entry = Entry(request, array, array, None, Handle(response.name, lambda: True))
    entry.stand_in = True
    return entry


class Controller:
    def __init__(self, comm, config: Config, global_ranks: list[int] | None = None) -> None:
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # Global rank of each member (messages and errors name ranks by their global rank).
        self.global_ranks = list(global_ranks) if global_ranks else list(range(self.size))
        self.label = self.global_ranks[self.rank]
        self.config = config
        self.max_sleep = config.wait_sleep_cap   # back-off cap of every wait on peers
        self.cache = ResponseCache(config.cache_capacity)
        self.pending: dict[str, Entry] = {}
        self._table: dict[str, dict[int, Request]] = {}   # coordinator: full requests by name
        self._outbox = []                                  # unfinished isend requests
        self._bufs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._group_done: dict[str, list[Response]] = {}  # coordinator: finished members
        # join() state; the round counter is identical on every rank (rounds are collective)
        self.rounds = 0
        self.join_entry: Entry | None = None
        self._join_round = -1
        self._join_unsent = False
        self._someone_joined = False                       # as of the last round
        self._joined_ranks: set[int] = set()               # coordinator: who has joined
        # coordinator: tensors failed by the stall shutdown -> (the ranks that gave up, when)
        self._gave_up: dict[str, tuple[list[int], float]] = {}
        self._stall_scan_at = _NEVER   # no pending tensor is due for a stall report before

    @property
    def busy(self) -> bool:
        """Work is pending here (a joined rank keeps running rounds for the others)."""
        return bool(self.pending) or self.join_entry is not None

    def _buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        bufs = self._bufs.get(n)
        if bufs is None:
            bufs = self._bufs[n] = (np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.uint64))
        return bufs

    # ---------------------------------------------------------------------------------------
    def stall_due(self, now: float) -> bool:
        """Whether some pending tensor is due for a stall report.  The pending tensors are
        scanned only once the earliest known report time has come (not every round)."""
        if not self.config.stall_check_enabled or now < self._stall_scan_at:
            return False
        due_at = min((e.next_stall_report for e in self.pending.values()), default=_NEVER)
        self._stall_scan_at = due_at
        return now >= due_at

    def _wait(self, ready, what: str) -> None:
        wait_until(ready, self.max_sleep, on_slow=lambda waited: self.local_stall(waited, what))

    def local_stall(self, waited: float, what: str) -> None:
        """A round (or a data exchange) that does not complete means some rank's hvdlite thread
        is not running at all.  If that rank's process is gone (a node-local peer killed or
        crashed without a word, see :mod:`liveness`), raise RankExitedError at once; if it is
        stopped or stuck while holding the interpreter, warn every stall-check period and
        raise StallError after the stall-shutdown time."""
        gone = liveness.vanished(self.global_ranks)   # this rank is never among its peers
        if gone:
            raise RankExitedError(
                f"rank(s) {gone} on this node exited without shutting down hvdlite (killed, "
                f"for example by the out-of-memory killer, os._exit, or a crash in native code) "
                f"while rank {self.label} waited {waited:.0f} s for them in {what}; no further "
                f"collective operations are possible in this job. Look at rank(s) {gone}'s "
                f"output and the system log for the cause.")
        cfg = self.config
        if not cfg.stall_check_enabled or waited < cfg.stall_check_seconds:
            return
        names = sorted(self.pending)[:20]
        if int(waited) % max(1, int(cfg.stall_check_seconds)) == 0:
            log.warning("rank %d has waited %.0f s for the other ranks to join %s; pending here: "
                        "%s. Some rank is not responding (stopped, or stuck outside Python).",
                        self.label, waited, what, names)
        if cfg.stall_shutdown_seconds > 0 and waited >= cfg.stall_shutdown_seconds:
            raise StallError(
                f"rank {self.label} gave up after {waited:.0f} s waiting for the other ranks to "
                f"join {what} (HVDLITE_STALL_SHUTDOWN_TIME_SECONDS="
                f"{cfg.stall_shutdown_seconds:g}); pending here: {names}.")

    def _finish_outbox(self) -> None:
        if self._outbox:
            MPI = self._MPI
            self._wait(lambda: MPI.Request.Testall(self._outbox), "negotiation")
            self._outbox.clear()

    # ---------------------------------------------------------------------------------------
    def run_round(self, new_entries: list[Entry], shutdown: bool) -> RoundOutcome:
        MPI = self._MPI
        invalid_here: set[int] = set()
        cfg = self.config
        check_after = cfg.stall_check_seconds if cfg.stall_check_enabled else _NEVER
        pending, cached_slot, cached = self.pending, self.cache.slot_of, self.cache.slots
        signature = SIGNATURE
        grouped = False
        # Runs for every tensor of every step: the cache lookup is inlined (ResponseCache.lookup
        # has the same logic).
        for entry in new_entries:
            request = entry.request
            name = request[0]
            if request[1] == JOIN:
                self.join_entry, self._join_round, self._join_unsent = entry, self.rounds, True
                continue
            pending[name] = entry
            slot = cached_slot.get(name)
            if slot is not None:
                if cached[slot][1] == request[signature]:   # Request.signature()
                    entry.slot = slot
                else:
                    invalid_here.add(slot)
            entry.next_stall_report = entry.submitted_at + check_after
            if entry.group is not None:
                grouped = True
        if new_entries and check_after < _NEVER:
            self._stall_scan_at = min(self._stall_scan_at,
                                      min(e.submitted_at for e in new_entries) + check_after)
        if grouped:   # a group is announced through the cache only if all its members hit
            for entry in new_entries:
                if entry.group is not None and entry.slot is not None and any(
                        m.slot is None for m in entry.group):
                    for member in entry.group:
                        member.slot = None
        if self._someone_joined:
            self._route_unjoinable()
        now = time.monotonic()
        want_stall = self.stall_due(now)

        nw = self.cache.num_words
        ready_slots = []
        unsent = self._join_unsent
        for entry in pending.values():   # one pass: cached slots to announce, and unsent ones
            slot = entry.slot
            if slot is not None:
                ready_slots.append(slot)
            elif not entry.sent:
                unsent = True
        if self.join_entry is not None:   # stand in for every cached reduction
            ready_slots = set(ready_slots).union(self._reducible_slots())
        ready_here = _pack(ready_slots, nw)
        flags = 0
        if unsent:
            flags |= F_UNSENT
        if shutdown:
            flags |= F_SHUTDOWN
        if want_stall:
            flags |= F_STALL
        if not self.pending:
            flags |= F_IDLE
        if self.join_entry is not None:
            flags |= F_JOINED
        # AND across ranks: ready bits as they are; "some rank has it" bits negated; last word
        # "this rank has joined" as is (so the AND says "all have joined").
        send, recv = self._buffers(2 * nw + 2)
        stale_here = _pack(invalid_here, nw)
        tail = [_ALL_ONES ^ flags, 1 if self.join_entry is not None else 0]
        if type(ready_here) is list and type(stale_here) is list:   # one assignment is cheaper
            send[:] = ready_here + [_ALL_ONES ^ w for w in stale_here] + tail
        else:
            send[:nw] = ready_here
            stale = send[nw:2 * nw]
            stale[:] = stale_here
            np.invert(stale, out=stale)
            send[2 * nw:] = tail
        request = self.comm.Iallreduce(send, recv, op=MPI.BAND)
        self._wait(request.Test, "negotiation")
        result = recv.tolist()
        self.rounds += 1

        outcome = RoundOutcome()
        any_flags = _ALL_ONES ^ result[2 * nw]
        all_joined = bool(result[2 * nw + 1])
        self._someone_joined = bool(any_flags & F_JOINED)
        invalid = _bits([_ALL_ONES ^ w for w in result[nw:2 * nw]])
        invalid_set = set(invalid)
        for slot in invalid:
            self.cache.erase(slot)
        if invalid_set:
            for entry in self.pending.values():
                if entry.slot in invalid_set:
                    for member in entry.group or (entry,):
                        member.slot = None   # now negotiated in full, like a new tensor
        pop, ready = pending.pop, outcome.ready
        if not all_joined:   # when everyone has joined, the stand-in bits mean nothing
            for slot in _bits(result[:nw]):
                if slot not in invalid_set:
                    response = cached[slot][0]
                    entry = pop(response.name, None)
                    ready.append((response, entry if entry is not None
                                  else _stand_in(response)))

        slow = invalid or any_flags & (F_UNSENT | F_SHUTDOWN | F_STALL)
        if slow:
            new_responses, outcome.shutdown_ranks = self._exchange(
                shutdown, bool(any_flags & F_STALL), now)
            for response in new_responses:
                entry = self.pending.pop(response.name, None)
                if (entry is None and response.error is None and self.join_entry is not None
                        and runs_while_joined(response.kind, response.reduce_op)):
                    entry = _stand_in(response)
                if response.error is None and entry is not None:
                    self.cache.put(response, entry.request)
                if entry is not None or response.error is None:
                    outcome.ready.append((response, entry))
        if all_joined and self.join_entry is not None:
            outcome.joined = (self.join_entry, self._last_to_join())
        outcome.progress = bool(outcome.ready) or bool(slow) or outcome.joined is not None
        outcome.everyone_busy = not (any_flags & F_IDLE)
        return outcome

    # --- join --------------------------------------------------------------------------------
    def _reducible_slots(self) -> list[int]:
        return [slot for slot, response in self.cache.items()
                if runs_while_joined(response.kind, response.reduce_op)]

    def _route_unjoinable(self) -> None:
        """Some rank has joined: cached operations that cannot run without it go to the
        coordinator, which fails them with a clear error instead of letting them wait."""
        for entry in self.pending.values():
            if entry.slot is not None:
                response = self.cache.response(entry.slot)
                if not runs_while_joined(response.kind, response.reduce_op):
                    for member in entry.group or (entry,):
                        member.slot = None

    def _last_to_join(self) -> int:
        """Every rank has joined: agree on the last one (latest round; ties -> highest rank)
        and reset the join state for the next epoch."""
        mine = np.array([self._join_round, self.label], dtype=np.int64)
        every = np.empty(2 * self.size, dtype=np.int64)
        request = self.comm.Iallgather(mine, every)
        self._wait(request.Test, "join")
        pairs = every.reshape(self.size, 2).tolist()
        self.join_entry, self._join_round, self._someone_joined = None, -1, False
        self._joined_ranks.clear()
        return int(max(pairs)[1])

    # ---------------------------------------------------------------------------------------
    def _exchange(self, shutdown: bool, stall_report: bool, now: float):
        """Slow path: full requests to the coordinator, ordered responses back."""
        unsent = [e for e in self.pending.values() if e.slot is None and not e.sent]
        for entry in unsent:
            entry.sent = True
        payload = {
            "requests": [e.request for e in unsent],
            "joined": self.join_entry is not None,
            "shutdown": shutdown,
            "pending": ({name: now - e.submitted_at for name, e in self.pending.items()}
                        if stall_report else None),
        }
        if stall_report:
            cfg = self.config
            for entry in self.pending.values():
                if now >= entry.next_stall_report:
                    nxt = now + cfg.stall_check_seconds
                    deadline = entry.submitted_at + cfg.stall_shutdown_seconds
                    if cfg.stall_shutdown_seconds > 0 and now < deadline:
                        nxt = min(nxt, deadline)
                    entry.next_stall_report = nxt
            self._stall_scan_at = 0.0   # report times moved: find the next one afresh
        self._join_unsent = False
        if self.rank != 0:
            self._finish_outbox()
            self._outbox.append(self.comm.isend(payload, dest=0, tag=TAG_REQUESTS))
            holder = []

            def arrived() -> bool:
                msg = self.comm.improbe(source=0, tag=TAG_RESPONSES)
                if msg is None:
                    return False
                holder.append(msg.recv())
                return True

            self._wait(arrived, "negotiation")
            reply = holder[0]
            return reply["responses"], reply["shutdown_ranks"]

        payloads = {0: payload}
        while len(payloads) < self.size:
            holder = []

            def arrived() -> bool:
                status = self._MPI.Status()
                msg = self.comm.improbe(source=self._MPI.ANY_SOURCE, tag=TAG_REQUESTS,
                                        status=status)
                if msg is None:
                    return False
                holder.append((status.Get_source(), msg.recv()))
                return True

            self._wait(arrived, "negotiation")
            source, data = holder[0]
            payloads[source] = data
        responses, shutdown_ranks = self._coordinate(payloads)
        reply = {"responses": responses, "shutdown_ranks": shutdown_ranks}
        self._finish_outbox()
        for dest in range(1, self.size):
            self._outbox.append(self.comm.isend(reply, dest=dest, tag=TAG_RESPONSES))
        return responses, shutdown_ranks

    def _coordinate(self, payloads: dict[int, dict]) -> tuple[list[Response], tuple[int, ...]]:
        labels = self.global_ranks
        payloads = {labels[r]: p for r, p in payloads.items()}   # from here on: global ranks
        shutdown_ranks = tuple(sorted(r for r, p in payloads.items() if p["shutdown"]))
        self._joined_ranks.update(r for r, p in payloads.items() if p["joined"])
        tl = _timeline.ACTIVE
        for rank in sorted(payloads):
            for request in payloads[rank]["requests"]:
                self._table.setdefault(request.name, {})[rank] = request
                if tl is not None:
                    tl.negotiate_tick(request.name, request.kind, rank)
        everyone, joined = set(labels), self._joined_ranks
        responses: list[Response] = []
        for name in [n for n, reqs in self._table.items()
                     if len(reqs) == self.size or (joined and joined | reqs.keys() >= everyone)]:
            requests = self._table.pop(name)
            if self._gave_up:
                self._gave_up.pop(name, None)   # the name is in use again, by every rank
            response = build_response(requests, joined)
            group = requests[min(requests)].group
            if group:
                responses += self._group_member_done(group, requests[min(requests)].group_size,
                                                     response)
            else:
                responses.append(response)
        if any(p["pending"] is not None for p in payloads.values()):
            responses += self._stall_report(payloads)
        return responses, shutdown_ranks

    def _group_member_done(self, group: str, group_size: int, response: Response
                           ) -> list[Response]:
        """Hold a grouped op's responses until every member is ready everywhere; then release
        them together (all failing if one failed, so the group stays one unit)."""
        done = self._group_done.setdefault(group, [])
        done.append(response)
        if len(done) < group_size:
            return []
        del self._group_done[group]
        bad = next((r for r in done if r.error is not None), None)
        if bad is None:
            return done
        return [r if r is bad else r._replace(
                    error=f"grouped {r.kind} {group!r} failed because of its member "
                          f"{bad.name!r}: {bad.error}", error_kind=bad.error_kind)
                for r in done]

    def _stall_report(self, payloads: dict[int, dict]) -> list[Response]:
        cfg = self.config
        by_name: dict[str, dict[int, float]] = {}
        for rank, payload in payloads.items():
            for name, age in (payload["pending"] or {}).items():
                by_name.setdefault(name, {})[rank] = age
        waiting_on = {rank: _oldest_first(payload["pending"]) for rank, payload in payloads.items()}
        errors = []
        lines = []
        now = time.monotonic()
        for name, ages in sorted(by_name.items()):
            missing = [r for r in self.global_ranks if r not in ages]
            age = max(ages.values())
            if not missing or age < cfg.stall_check_seconds:
                continue
            late = self._late_note(name, missing, sorted(ages), now)
            elsewhere = _missing_ranks_doing(missing, waiting_on)
            lines.append(f"  {name!r}: submitted on ranks {sorted(ages)} {age:.0f} s ago, "
                         f"missing on ranks {missing} ({elsewhere}){late}")
            if cfg.stall_shutdown_seconds > 0 and age >= cfg.stall_shutdown_seconds:
                self._table.pop(name, None)
                self._gave_up[name] = (sorted(ages), now)
                while len(self._gave_up) > _GAVE_UP_MEMORY:
                    del self._gave_up[next(iter(self._gave_up))]
                advice = late or (" Every rank must submit the same tensors; check for "
                                  "rank-dependent control flow.")
                errors.append(Response(
                    name, "error", error_kind=ERROR_STALL,
                    error=(f"Tensor {name!r} stalled: submitted on ranks {sorted(ages)} but "
                           f"missing on ranks {missing} for {age:.0f} s (HVDLITE_STALL_SHUTDOWN_"
                           f"TIME_SECONDS={cfg.stall_shutdown_seconds:g}); {elsewhere}.{advice}")))
        if lines:
            log.warning("Stall detected: one or more tensors were submitted on some ranks but "
                        "not on others (the other ranks may be waiting on these forever):\n%s"
                        "\nCheck for rank-dependent code paths, or ranks that ran out of data.",
                        "\n".join(lines))
        return errors

    def _late_note(self, name: str, missing: list[int], waiting: list[int], now: float) -> str:
        """If the ranks missing ``name`` are ones that already gave up on it, say so: then these
        ranks did not skip it, they reached it after the others' stall shutdown."""
        record = self._gave_up.get(name)
        if record is None or not set(missing) <= set(record[0]):
            return ""
        return (f" Ranks {missing} already gave up on this tensor {now - record[1]:.0f} s ago "
                f"(their stall shutdown), before ranks {waiting} submitted it: these ranks run "
                f"far behind the others (for example after a slow import, data loading or "
                f"checkpoint reading on these ranks only). Set HVDLITE_STALL_SHUTDOWN_TIME_"
                f"SECONDS well above that gap.")


_SHOWN_PER_RANK = 3   # names listed per rank in a stall report


def _oldest_first(pending: dict[str, float] | None) -> list[str]:
    """The names of a rank's pending tensors (name -> age in seconds), the oldest first: the
    oldest is where a diverging rank went its own way."""
    return sorted(pending or (), key=lambda name: (-pending[name], name))


def _missing_ranks_doing(missing: list[int], waiting_on: dict[int, list[str]]) -> str:
    """What the ranks missing a tensor wait for instead: the other tensors each has pending,
    oldest first (a different name or order points at the diverging code), or nothing (still
    computing, or it never submits the tensor)."""
    parts = []
    for rank in missing:
        names = waiting_on.get(rank, [])
        if not names:
            parts.append(f"rank {rank} has no operation pending")
            continue
        shown = ", ".join(repr(n) for n in names[:_SHOWN_PER_RANK])
        more = len(names) - _SHOWN_PER_RANK
        parts.append(f"rank {rank} is waiting on {shown}" + (f" and {more} more" if more > 0
                                                               else ""))
    return "; ".join(parts)
