"""The watched wait on peers (runtime/peer_wait.py): gone ranks raise, stalls warn, then give
up at the stall-shutdown time (pure logic; the multi-process tests in tests/core/test_faults.py
and tests/multihost/test_death.py cover the real waits)."""
from __future__ import annotations

import logging
import os

import pytest

from hvdlite.common.config import Config
from hvdlite.common.errors import RankExitedError, StallError
from hvdlite.common.runtime import liveness
from hvdlite.common.runtime.peer_wait import check_wait, raise_if_gone


class _Gone:
    def __init__(self, rank: int, text: str) -> None:
        self.rank, self._text = rank, text

    def describe(self) -> str:
        return self._text


@pytest.fixture(autouse=True)
def clean_liveness():
    peers, departed, seen = (dict(liveness._peers), dict(liveness._departed),
                             set(liveness._seen_gone))
    liveness._peers.clear()
    liveness._departed.clear()
    yield
    liveness._peers.clear()
    liveness._peers.update(peers)
    liveness._departed.clear()
    liveness._departed.update(departed)
    liveness._seen_gone.clear()
    liveness._seen_gone.update(seen)


def test_nothing_gone_passes():
    raise_if_gone(range(4), 0, "negotiation")
    check_wait(5.0, "negotiation", 0, range(4), Config(stall_check_seconds=60.0), "pending.")


def test_a_rank_reported_gone_on_another_host_raises_naming_it():
    liveness.record_departed([_Gone(2, "rank 2 on host b exited with code 1")])
    with pytest.raises(RankExitedError) as caught:
        raise_if_gone(range(4), 0, "the exchange of hvd.remove_process_set()")
    text = str(caught.value)
    assert text.startswith("rank 2 on host b exited with code 1, so rank 0 cannot complete "
                           "the exchange of hvd.remove_process_set();"), text
    with pytest.raises(RankExitedError, match=r"while rank 0 waited 3 s for it in negotiation"):
        check_wait(3.0, "negotiation", 0, range(4), Config(), "pending here: [].")


def test_only_the_given_peers_count():
    """A departed rank outside the set does not fail this set's wait, nor does this rank."""
    liveness.record_departed([_Gone(3, "rank 3 exited"), _Gone(0, "rank 0 exited")])
    raise_if_gone([0, 1, 2], 0, "negotiation")
    with pytest.raises(RankExitedError):
        raise_if_gone([0, 3], 0, "negotiation")


def test_a_vanished_local_peer_raises():
    # A process that is not running (pid of this process with an impossible start time).
    liveness._peers[1] = (os.getpid(), -1)
    with pytest.raises(RankExitedError, match=r"rank\(s\) \[1\] on this node exited without "
                                              r"shutting down hvdlite"):
        check_wait(1.0, "negotiation", 0, range(2), Config(), "pending here: ['x'].")


def test_stall_shutdown_time_is_honoured_even_below_the_check_time():
    config = Config(stall_check_seconds=60.0, stall_shutdown_seconds=2.0)
    check_wait(1.0, "negotiation", 0, range(2), config, "pending here: ['x'].")
    with pytest.raises(StallError) as caught:
        check_wait(2.0, "negotiation", 0, range(2), config, "pending here: ['x'].")
    assert "gave up after 2 s" in str(caught.value)
    assert str(caught.value).endswith("pending here: ['x'].")


def test_warns_every_check_period_and_not_when_disabled(caplog):
    config = Config(stall_check_seconds=2.0)
    with caplog.at_level(logging.WARNING, logger="hvdlite"):
        for waited in (1.0, 2.0, 3.0, 4.0):
            check_wait(waited, "an allreduce's data exchange", 1, range(2), config,
                       "every rank must call it.")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert warned[0].startswith("rank 1 has waited 2 s for the other ranks to join an "
                                "allreduce's data exchange; every rank must call it."), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hvdlite"):
        check_wait(100.0, "negotiation", 1, range(2),
                   Config(stall_check_enabled=False, stall_shutdown_seconds=5.0), "x")
    assert not caplog.records
