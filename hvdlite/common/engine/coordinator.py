"""The coordinator (rank 0 of a process set): collects every rank's full requests, validates a
tensor once every rank has it (or every other rank has joined), and decides the order in which
all ranks execute the responses.  Pure logic: the controller brings the payloads and delivers the
responses (see :mod:`controller`, :mod:`transport`)."""
from __future__ import annotations

from hvdlite.common.config import Config
from hvdlite.common.engine.messages import Request, Response, build_response
from hvdlite.common.engine.stall import StallInspector
from hvdlite.common.runtime import timeline as _timeline


class Coordinator:
    def __init__(self, global_ranks: list[int], config: Config) -> None:
        self.global_ranks = global_ranks
        self.size = len(global_ranks)
        self._table: dict[str, dict[int, Request]] = {}   # full requests by name, then rank
        self.joined_ranks: set[int] = set()               # ranks that have called join()
        self.stalls = StallInspector(global_ranks, config)

    def coordinate(self, payloads: dict[int, dict]) -> tuple[list[Response], tuple[int, ...]]:
        """One round's payloads (set rank -> payload, from every rank) -> the ordered responses
        and the global ranks asking to shut down."""
        labels = self.global_ranks
        payloads = {labels[r]: p for r, p in payloads.items()}   # from here on: global ranks
        shutdown_ranks = tuple(sorted(r for r, p in payloads.items() if p["shutdown"]))
        self.joined_ranks.update(r for r, p in payloads.items() if p["joined"])
        tl = _timeline.ACTIVE
        for rank in sorted(payloads):
            for request in payloads[rank]["requests"]:
                self._table.setdefault(request.name, {})[rank] = request
                if tl is not None:
                    tl.negotiate_tick(request.name, request.kind, rank)
        everyone, joined = set(labels), self.joined_ranks
        responses: list[Response] = []
        for name in [n for n, reqs in self._table.items()
                     if len(reqs) == self.size or (joined and joined | reqs.keys() >= everyone)]:
            requests = self._table.pop(name)
            self.stalls.name_in_use(name)   # the name is in use again, by every rank
            responses.append(build_response(requests, joined))
        if any(p["pending"] is not None for p in payloads.values()):
            responses += self.stalls.report({r: p["pending"] for r, p in payloads.items()},
                                            self._table)
        return responses, shutdown_ranks
