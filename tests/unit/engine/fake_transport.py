"""An in-process :class:`~hvdlite.common.engine.transport.Transport`: N simulated ranks, each
driving its own controller in its own thread, exchange through shared memory what MPI would
carry (payloads are pickled, as MPI pickles them, so no rank sees another's objects)."""
from __future__ import annotations

import collections
import pickle
import threading
from typing import Any, Callable

import numpy as np


class FakeNetwork:
    """The shared medium of ``size`` simulated ranks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._collectives: dict[tuple[str, int], dict[int, np.ndarray]] = {}
        self._results: dict[tuple[str, int], np.ndarray] = {}
        self._inbox: dict[tuple[int, str], collections.deque] = collections.defaultdict(
            collections.deque)
        self.messages_sent = collections.Counter()   # (rank, "requests"/"responses") -> count

    def transport(self, rank: int) -> "FakeTransport":
        return FakeTransport(self, rank)

    def _contribute(self, kind: str, index: int, rank: int, data: np.ndarray,
                    combine: Callable[[list[np.ndarray]], np.ndarray]) -> Callable[[], bool]:
        key = (kind, index)
        with self._lock:
            self._collectives.setdefault(key, {})[rank] = data.copy()
            parts = self._collectives[key]
            if len(parts) == self.size:
                self._results[key] = combine([parts[r] for r in range(self.size)])

        def done() -> bool:
            with self._lock:
                return key in self._results
        return done

    def _result(self, kind: str, index: int) -> np.ndarray:
        with self._lock:
            return self._results[(kind, index)]

    def _post(self, dest: int, box: str, payload: Any, sender: int) -> None:
        with self._lock:
            self._inbox[(dest, box)].append((sender, pickle.dumps(payload)))
            self.messages_sent[(sender, box)] += 1

    def _take(self, rank: int, box: str) -> tuple[int, Any] | None:
        with self._lock:
            queue = self._inbox[(rank, box)]
            if not queue:
                return None
            sender, data = queue.popleft()
        return sender, pickle.loads(data)


class FakeTransport:
    def __init__(self, network: FakeNetwork, rank: int) -> None:
        self.network = network
        self.rank = rank
        self.size = network.size
        self._counts = collections.Counter()   # this rank's collectives of each kind so far

    def _collective(self, kind: str, mine: np.ndarray, out: np.ndarray, combine):
        index = self._counts[kind]
        self._counts[kind] += 1
        done = self.network._contribute(kind, index, self.rank, mine, combine)

        def test() -> bool:
            if not done():
                return False
            out[...] = self.network._result(kind, index)
            return True
        return test

    def start_and(self, send: np.ndarray, recv: np.ndarray):
        return self._collective("and", send, recv,
                                lambda parts: np.bitwise_and.reduce(np.stack(parts), axis=0))

    def start_allgather(self, mine: np.ndarray, every: np.ndarray):
        return self._collective("allgather", mine, every, np.concatenate)

    def send_requests(self, payload: Any) -> None:
        self.network._post(0, "requests", payload, self.rank)

    def receive_requests(self):
        return self.network._take(self.rank, "requests")

    def send_responses(self, rank: int, reply: Any) -> None:
        self.network._post(rank, "responses", reply, self.rank)

    def receive_responses(self):
        got = self.network._take(self.rank, "responses")
        return None if got is None else got[1]

    def sends_done(self) -> bool:
        return True
