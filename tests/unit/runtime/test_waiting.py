"""Waiting helpers (hvdlite/common/runtime/waiting.py): what they return and when they call back; no
timing is asserted."""
import itertools

import pytest

from hvdlite.common.runtime import waiting
from hvdlite.common.runtime.waiting import caller_blocked, poll_briefly, wait_until


def after(n):
    """A ready() that turns true on its n-th call."""
    calls = itertools.count(1)
    return lambda: next(calls) >= n


def test_poll_briefly_true_at_once_or_after_a_few_polls():
    assert poll_briefly(lambda: True, 0.0)
    assert poll_briefly(after(5), 10.0)


def test_poll_briefly_gives_up_false():
    seen = []
    assert not poll_briefly(lambda: seen.append(1) and False, 0.001)
    assert seen, "ready() was never tested"


def test_wait_until_returns_once_ready_and_reports_slow_waits():
    slow = []
    wait_until(after(3), 1e-4)
    wait_until(after(50), 1e-4, on_slow=slow.append, slow_every=0.0, spin_seconds=0.0)
    assert slow and all(w >= 0 for w in slow)


def test_wait_until_on_slow_may_abandon_the_wait():
    def give_up(waited):
        raise TimeoutError(f"gave up after {waited}")
    with pytest.raises(TimeoutError):
        wait_until(lambda: False, 1e-4, on_slow=give_up, slow_every=0.0, spin_seconds=0.0)


def consumed_on(n):
    """A ready() like a matched probe: its n-th call takes the one message there is, so only
    that call answers true; a call after it would wait for a message that never comes."""
    calls = itertools.count(1)

    def ready():
        call = next(calls)
        assert call <= n, "ready() was called again after it answered true (answer lost)"
        return call == n
    return ready


@pytest.mark.parametrize("n", range(1, 40))
@pytest.mark.parametrize("with_stall_checks", [False, True])
def test_wait_until_never_asks_again_after_true(n, with_stall_checks):
    """Whatever call (the spin, a sleep's test, the one at a stall check) takes the message,
    the wait ends there; an earlier version asked again after a stall check's true answer and
    lost the message, so a rank waited forever for a reply it had already received."""
    slow = []
    wait_until(consumed_on(n), 1e-5, on_slow=slow.append if with_stall_checks else None,
               slow_every=0.0, spin_seconds=0.0)
    assert not with_stall_checks or n <= 2 or slow


def test_wait_until_yields_instead_of_sleeping_while_a_caller_is_blocked(monkeypatch):
    """A thread blocked on a result computes nothing, so waits on peers poll between yields
    (for PEER_SPIN_SECONDS) instead of sleeping; without one they sleep as before."""
    slept = []
    monkeypatch.setattr(waiting.time, "sleep", slept.append)
    monkeypatch.setattr(waiting, "PEER_SPIN_SECONDS", 3600.0)   # no budget runs out here
    with caller_blocked():
        wait_until(after(200), 1e-3, spin_seconds=0.0)
    assert slept == []
    wait_until(after(20), 1e-3, spin_seconds=0.0)
    assert len(slept) == 19


def test_wait_until_sleeps_again_once_the_spin_budget_is_spent(monkeypatch):
    slept = []
    monkeypatch.setattr(waiting.time, "sleep", slept.append)
    monkeypatch.setattr(waiting, "PEER_SPIN_SECONDS", 0.0)
    with caller_blocked():
        wait_until(after(20), 1e-3, spin_seconds=0.0)
    assert len(slept) == 18   # the first pass after the spin only sets the (empty) budget


def test_caller_blocked_is_undone_when_the_wait_raises():
    with pytest.raises(KeyError):
        with caller_blocked():
            assert waiting._blocked_callers == 1
            raise KeyError("the result was an error")
    assert waiting._blocked_callers == 0
