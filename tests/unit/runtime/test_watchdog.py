"""The watchdog's protocol over real TCP sockets on loopback, with N simulated ranks in one
process (threads) and an in-process stand-in for the world communicator's bcast/allgather."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from hvdlite.common.runtime.watchdog import Departure, Watchdog


class FakeWorld:
    """bcast/allgather among ``size`` threads (each call is collective, in order)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list = [None] * size
        self._lock = threading.Lock()

    def comm(self, rank: int) -> "FakeComm":
        return FakeComm(self, rank)


class FakeComm:
    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self.rank = world, rank

    def _exchange(self, value):
        w = self.world
        w._barrier.wait()
        w._slots[self.rank] = value
        w._barrier.wait()
        values = list(w._slots)
        w._barrier.wait()
        return values

    def bcast(self, value, root=0):
        return self._exchange(value)[root]

    def allgather(self, value):
        return self._exchange(value)


def start_all(size: int, port: int = 0):
    """Start ``size`` watchdogs; returns them and each one's list of reported departures."""
    world = FakeWorld(size)
    seen = [[] for _ in range(size)]
    dogs = [Watchdog(r, size, seen[r].extend) for r in range(size)]
    errors: list = [None] * size

    def start(rank: int) -> None:
        try:
            dogs[rank].start(world.comm(rank), port)
        except Exception as exc:   # noqa: BLE001 - checked by the test
            errors[rank] = exc

    threads = [threading.Thread(target=start, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return dogs, seen, errors


def wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def die(dog: Watchdog) -> None:
    """A process ending without a word: its sockets close, nothing is said."""
    dog.forget_in_child()


@pytest.mark.parametrize("size", [2, 3])
def test_clean_shutdown_reports_nothing(size):
    dogs, seen, errors = start_all(size)
    assert errors == [None] * size
    for dog in reversed(dogs):
        dog.close()
    time.sleep(0.2)
    assert seen == [[] for _ in range(size)]


def test_a_rank_that_vanishes_is_reported_to_every_other_rank():
    dogs, seen, errors = start_all(3)
    assert errors == [None] * 3
    host = socket.gethostname()
    die(dogs[2])
    want = [Departure(2, host, "exited")]
    assert wait_for(lambda: seen[0] == want and seen[1] == want), seen
    assert seen[2] == []
    for dog in dogs[:2]:
        dog.close()


def test_rank_0_vanishing_is_seen_by_every_rank_itself():
    dogs, seen, errors = start_all(3)
    die(dogs[0])
    host = socket.gethostname()
    assert wait_for(lambda: all(s == [Departure(0, host, "exited")] for s in seen[1:])), seen
    for dog in dogs[1:]:
        dog.close()


def test_a_rank_that_said_goodbye_is_not_reported_when_it_ends():
    dogs, seen, errors = start_all(2)
    dogs[1].close()
    time.sleep(0.3)
    assert seen == [[], []]
    dogs[0].close()


def test_rank_0_that_cannot_listen_fails_start_on_every_rank():
    taken = socket.create_server(("", 0))
    port = taken.getsockname()[1]
    try:
        dogs, seen, errors = start_all(2, port=port)
    finally:
        taken.close()
    assert all(isinstance(e, RuntimeError) for e in errors), errors
    for e in errors:
        assert f"could not listen on port {port}" in str(e) and "HVDLITE_WATCHDOG=0" in str(e)
