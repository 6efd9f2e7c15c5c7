"""Cache of negotiated responses (pure logic).

Every rank applies the same inserts and erasures in the same negotiated order, so slot numbers
agree across ranks.  In steady state a rank announces a cached tensor by setting its slot's bit;
one bitwise AND across ranks then tells which cached tensors are ready everywhere, with no
request/response messages at all.
"""
from __future__ import annotations

from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import JOIN, SIGNATURE, Request, Response


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # (response, own request's signature) per slot, and the slot of each cached name;
        # the controller reads both directly on its hot path.
        self.slots: list[tuple[Response, tuple] | None] = []
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def num_words(self) -> int:
        """64-bit words needed for one bit per slot (identical on every rank)."""
        return (len(self.slots) + 63) // 64

    def match(self, entries: list[Entry]) -> set[int]:
        """Match new entries against the cache (the negotiation does this for every tensor of
        every step): an entry whose request has the signature cached under its name gets that
        slot (``entry.slot``, announced as ready); the slots cached under an entry's name with
        another signature are returned (stale: every rank erases them after the round)."""
        stale: set[int] = set()
        slot_of, slots, signature = self.slot_of, self.slots, SIGNATURE
        for entry in entries:
            request = entry.request
            slot = slot_of.get(request.name)
            if slot is not None:
                if slots[slot][1] == request[signature]:   # Request.signature()
                    entry.slot = slot
                elif request.kind != JOIN:   # never cached: a name it shares is not stale
                    stale.add(slot)
        return stale

    def items(self):
        """(slot, response) of every cached response."""
        return [(slot, e[0]) for slot, e in enumerate(self.slots) if e is not None]

    def response(self, slot: int) -> Response:
        return self.slots[slot][0]

    def held(self, slot: int) -> Response | None:
        """The response in ``slot`` now, or None if the slot is empty or was never used."""
        entry = self.slots[slot] if slot < len(self.slots) else None
        return None if entry is None else entry[0]

    def put(self, response: Response, own_request: Request) -> int | None:
        """Remember a negotiated response under this rank's own request signature."""
        if not (response.cacheable and response.error is None) or self.capacity <= 0:
            return None
        if response.name in self.slot_of:
            self.erase(self.slot_of[response.name])
        if self._free:
            slot = min(self._free)
            self._free.remove(slot)
        elif len(self.slots) < self.capacity:
            slot = len(self.slots)
            self.slots.append(None)
        else:
            return None  # full: deterministic on every rank, no eviction
        self.slots[slot] = (response, own_request.signature())
        self.slot_of[response.name] = slot
        return slot

    def erase(self, slot: int) -> None:
        entry = self.slots[slot]
        if entry is None:
            return
        del self.slot_of[entry[0].name]
        self.slots[slot] = None
        self._free.append(slot)
