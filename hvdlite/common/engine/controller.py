"""Negotiation: deciding, identically on every rank, which operations run and when.

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

A round may also carry one *early* reduction (see :mod:`.early`): the engine predicts from
earlier rounds which cached allreduce comes alone next, and every rank starts its data exchange
beside the AND; if the AND then says that every rank contributed it, the result stands and the
tensor completes without a second exchange.

A grouped operation is one request (see ``Request.layout``): one cache slot, one response
whose members execute together in one round.
A rank that called ``join()`` announces every cached reduction as ready and stands in for tensors
it never submitted with the reduction's identity; the join completes in the first round in which
every rank has joined.

One controller serves one process set; it talks to the other ranks through a
:class:`~hvdlite.common.engine.transport.Transport` (MPI in a job, an in-process fake in unit
tests), leaves validation and ordering to the :class:`~hvdlite.common.engine.coordinator.
Coordinator` on rank 0, and stall reports to :mod:`~hvdlite.common.engine.stall`.  Messages name
ranks by their global rank.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from hvdlite.common.config import Config
from hvdlite.common.engine.coordinator import Coordinator
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.join import last_to_join, reducible_slots, route_unjoinable, stand_in
from hvdlite.common.engine.messages import JOIN, Response, runs_while_joined
from hvdlite.common.engine.response_cache import ResponseCache
from hvdlite.common.engine.stall import NEVER, first_due, next_due
from hvdlite.common.engine.transport import Transport
from hvdlite.common.runtime.peer_wait import check_wait
from hvdlite.common.runtime.waiting import wait_until

IDLE_TICK_SECONDS = 0.1   # an idle rank still joins a round this often

F_UNSENT = 1 << 0      # some rank has requests the coordinator has not seen
F_SHUTDOWN = 1 << 1    # some rank is shutting down
F_STALL = 1 << 2       # some rank wants a stall report
F_IDLE = 1 << 3        # some rank has nothing pending (so waiting on it is not a livelock)
F_JOINED = 1 << 4      # some rank has called join()
F_NO_EARLY = 1 << 5    # some rank has early reductions switched off
_ALL_ONES = 0xFFFFFFFFFFFFFFFF


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
    __slots__ = ("ready", "early", "sole_slot", "early_allowed", "shutdown_ranks", "progress",
                 "everyone_busy", "joined")

    def __init__(self) -> None:
        self.ready: list[tuple[Response, Entry | None]] = []  # in execution order
        # The early reduction that stood (its result is in the early exchange's buffer)
        self.early: tuple[Response, Entry] | None = None
        # The one cached slot ready everywhere in a round with nothing else to do (no new
        # requests, no stale slots, nobody joined): the same on every rank
        self.sole_slot: int | None = None
        # Every rank has early reductions switched on (so the next round may carry one)
        self.early_allowed = False
        self.shutdown_ranks: tuple[int, ...] = ()
        self.progress = False
        self.everyone_busy = False
        self.joined: tuple[Entry, int] | None = None   # (join entry, last rank to join)


class Controller:
    def __init__(self, transport: Transport, config: Config, pending: dict[str, Entry],
                 global_ranks: list[int] | None = None) -> None:
        """``pending``: the engine's entries still to be negotiated (see ``InFlight``), which
        this controller fills and empties."""
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        # Global rank of each member (messages and errors name ranks by their global rank).
        self.global_ranks = list(global_ranks) if global_ranks else list(range(self.size))
        self.label = self.global_ranks[self.rank]
        self.config = config
        self.max_sleep = config.wait_sleep_cap   # back-off cap of every wait on peers
        self.cache = ResponseCache(config.cache_capacity)
        self.pending = pending
        self.coordinator = Coordinator(self.global_ranks, config) if self.rank == 0 else None
        self._bufs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # join() state; the round counter is identical on every rank (rounds are collective)
        self.rounds = 0
        self.join_entry: Entry | None = None
        self._join_round = -1
        self._join_unsent = False
        self._someone_joined = False                       # as of the last round
        self._stall_scan_at = NEVER   # no pending tensor is due for a stall report before

    def use_config(self, config: Config) -> bool:
        """Run with ``config`` from the next round on (autotune; between rounds, on every rank
        alike).  A new cache capacity empties the cache, as Horovod's ``set_capacity`` does:
        pending tensors it knew are then negotiated in full.  True if the cache was emptied."""
        self.config = config
        self.max_sleep = config.wait_sleep_cap
        if config.cache_capacity == self.cache.capacity:
            return False
        self.cache = ResponseCache(config.cache_capacity)
        for entry in self.pending.values():
            entry.slot = None
        return True

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
        due_at = min((e.next_stall_report for e in self.pending.values()), default=NEVER)
        self._stall_scan_at = due_at
        return now >= due_at

    def _wait(self, ready, what: str) -> None:
        wait_until(ready, self.max_sleep, on_slow=lambda waited: self.local_stall(waited, what))

    def local_stall(self, waited: float, what: str) -> None:
        """A wait on peers that does not end (see :func:`peer_wait.check_wait`)."""
        check_wait(waited, what, self.label, self.global_ranks, self.config,
                   f"pending here: {sorted(self.pending)[:20]}.")

    def _finish_sends(self) -> None:
        if not self.transport.sends_done():
            self._wait(self.transport.sends_done, "negotiation")

    # ---------------------------------------------------------------------------------------
    def run_round(self, new_entries: list[Entry], shutdown: bool,
                  early: tuple[int, Callable[[Entry | None], Callable[[], bool]]] | None = None,
                  early_on: bool = False) -> RoundOutcome:
        """One round (see the module's docstring).  ``early``: ``(slot, start)``, the same on
        every rank: ``start(entry)`` starts the early exchange of the cached allreduce in
        ``slot`` with this rank's pending entry for it (None if it has none: its share is
        then ignored) and returns its test.  ``early_on``: this rank has early reductions
        switched on; the outcome's ``early_allowed`` says whether every rank has (a switch
        flipped on one rank thus takes effect on every rank at the same round)."""
        cfg = self.config
        pending, cached = self.pending, self.cache.slots
        due_after = first_due(0.0, cfg)   # a stall report is due this long after submission
        invalid_here = self.cache.match(new_entries)   # cached slots to announce, stale ones
        for entry in new_entries:
            request = entry.request
            if request.kind == JOIN:
                self.join_entry, self._join_round, self._join_unsent = entry, self.rounds, True
                continue
            pending[request.name] = entry
            entry.next_stall_report = entry.submitted_at + due_after
        if new_entries and cfg.stall_check_enabled:
            self._stall_scan_at = min(self._stall_scan_at,
                                      min(e.submitted_at for e in new_entries) + due_after)
        if self._someone_joined:
            route_unjoinable(self.pending, self.cache)
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
            ready_slots = set(ready_slots).union(reducible_slots(self.cache))
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
        if not early_on:
            flags |= F_NO_EARLY
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
        early_entry = None
        if early is None:
            self._wait(self.transport.start_and(send, recv), "negotiation")
        else:
            early_slot = early[0]
            early_entry = pending.get(cached[early_slot][0].name)
            if early_entry is not None and early_entry.slot != early_slot:
                early_entry = None   # a stale submission under that name: its share is moot
            early_done = early[1](early_entry)
            and_done = self.transport.start_and(send, recv)
            self._wait(lambda: and_done() & early_done(), "negotiation")   # (both tested)
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
                    entry.slot = None   # now negotiated in full, like a new tensor
        pop, ready = pending.pop, outcome.ready
        agreed = [] if all_joined else _bits(result[:nw])   # slots ready on every rank
        # The early exchange stands if every rank contributed its entry: its slot's bit is set
        # everywhere, still valid, and no rank stood in for it (nobody joined).
        early_stands = (early_entry is not None and early[0] in agreed
                        and early[0] not in invalid_set and not any_flags & F_JOINED)
        for slot in agreed:   # (when everyone has joined, the stand-in bits mean nothing)
            if slot not in invalid_set:
                response = cached[slot][0]
                entry = pop(response.name, None)
                if early_stands and entry is early_entry:
                    outcome.early = (response, entry)
                    continue
                ready.append((response, entry if entry is not None else stand_in(response)))

        slow = invalid or any_flags & (F_UNSENT | F_SHUTDOWN | F_STALL)
        if not slow and len(agreed) == 1 and not any_flags & F_JOINED:
            outcome.sole_slot = agreed[0]
        if slow:
            new_responses, outcome.shutdown_ranks = self._exchange(
                shutdown, bool(any_flags & F_STALL), now)
            for response in new_responses:
                entry = self.pending.pop(response.name, None)
                if (entry is None and response.error is None and self.join_entry is not None
                        and runs_while_joined(response.kind, response.reduce_op)):
                    entry = stand_in(response)
                if response.error is None and entry is not None:
                    self.cache.put(response, entry.request)
                if entry is not None or response.error is None:
                    outcome.ready.append((response, entry))
        if all_joined and self.join_entry is not None:
            outcome.joined = (self.join_entry, self._last_to_join())
        outcome.progress = (bool(outcome.ready) or outcome.early is not None or bool(slow)
                            or outcome.joined is not None)
        outcome.everyone_busy = not (any_flags & F_IDLE)
        outcome.early_allowed = not any_flags & F_NO_EARLY
        return outcome

    # --- join --------------------------------------------------------------------------------
    def _last_to_join(self) -> int:
        """Every rank has joined: agree on the last one (latest round; ties -> highest rank)
        and reset the join state for the next epoch."""
        mine = np.array([self._join_round, self.label], dtype=np.int64)
        every = np.empty(2 * self.size, dtype=np.int64)
        self._wait(self.transport.start_allgather(mine, every), "join")
        self.join_entry, self._join_round, self._someone_joined = None, -1, False
        if self.coordinator is not None:
            self.coordinator.joined_ranks.clear()
        return last_to_join(every.reshape(self.size, 2).tolist())

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
            for entry in self.pending.values():
                if now >= entry.next_stall_report:
                    entry.next_stall_report = next_due(now, entry.submitted_at, self.config)
            self._stall_scan_at = 0.0   # report times moved: find the next one afresh
        self._join_unsent = False
        transport = self.transport
        if self.rank != 0:
            self._finish_sends()
            transport.send_requests(payload)
            holder = []

            def arrived() -> bool:
                reply = transport.receive_responses()
                if reply is None:
                    return False
                holder.append(reply)
                return True

            self._wait(arrived, "negotiation")
            reply = holder[0]
            return reply["responses"], reply["shutdown_ranks"]

        payloads = {0: payload}
        while len(payloads) < self.size:
            holder = []

            def arrived() -> bool:
                message = transport.receive_requests()
                if message is None:
                    return False
                holder.append(message)
                return True

            self._wait(arrived, "negotiation")
            source, data = holder[0]
            payloads[source] = data
        responses, shutdown_ranks = self.coordinator.coordinate(payloads)
        reply = {"responses": responses, "shutdown_ranks": shutdown_ranks}
        self._finish_sends()
        for dest in range(1, self.size):
            transport.send_responses(dest, reply)
        return responses, shutdown_ranks
