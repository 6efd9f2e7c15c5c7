"""hvdlite.common.runtime.liveness: telling a vanished node-local peer from a live one (one process,
real child processes standing in for peers)."""
import os
import subprocess
import sys

import pytest

from hvdlite.common.runtime import liveness


@pytest.fixture(autouse=True)
def clean_state():
    liveness._peers.clear()
    liveness._seen_gone.clear()
    yield
    liveness._peers.clear()
    liveness._seen_gone.clear()


def child():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_own_identity_is_readable():
    pid, started = liveness.own_identity()
    assert pid == os.getpid() and isinstance(started, int) and started > 0


def test_live_peer_is_not_vanished_and_a_dead_one_is():
    alive, dead = child(), child()
    try:
        liveness.record([(0, *liveness.own_identity()),
                         (1, alive.pid, liveness._start_time(alive.pid)),
                         (2, dead.pid, liveness._start_time(dead.pid))], own_rank=0)
        assert sorted(liveness._peers) == [1, 2], "own rank recorded, or a peer missing"
        assert liveness.vanished([1, 2]) == []
        dead.kill()
        dead.wait()
        assert liveness.vanished([1, 2]) == [2]
        assert liveness.vanished([1]) == [], "only the asked ranks are checked"
        assert liveness.vanished_seen() == [2]
    finally:
        alive.kill()
        dead.kill()
        alive.wait()


def test_zombie_counts_as_vanished():
    proc = child()
    liveness.record([(1, proc.pid, liveness._start_time(proc.pid))], own_rank=0)
    proc.kill()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped: a zombie
    try:
        assert liveness.vanished([1]) == [1]
    finally:
        proc.wait()


def test_reused_pid_counts_as_vanished():
    proc = child()
    try:
        started = liveness._start_time(proc.pid)
        # the same pid with another start time: the peer's process is not this one
        liveness.record([(1, proc.pid, started)], own_rank=0)
        liveness._peers[1] = (proc.pid, started - 1)
        assert liveness.vanished([1]) == [1]
    finally:
        proc.kill()
        proc.wait()


def test_unobservable_peers_are_never_reported():
    """A peer whose start time is unknown, or reads differently here (another pid namespace),
    is left out at record time: no false alarm about a healthy rank."""
    proc = child()
    try:
        started = liveness._start_time(proc.pid)
        liveness.record([(1, proc.pid, None), (2, proc.pid, started + 12345),
                         (3, 2 ** 22 + 7, 99)], own_rank=0)
        assert liveness._peers == {}
        assert liveness.vanished([1, 2, 3]) == []
    finally:
        proc.kill()
        proc.wait()
