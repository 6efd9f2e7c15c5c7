"""Waiting without spinning a core for long.

MPI's blocking calls busy-poll for as long as they wait, which would steal the CPU that training
needs while a rank waits for slower peers.  The engine instead tests non-blocking operations:
for the first ``SPIN_SECONDS`` it tests between ``sched_yield`` calls (a peer that is nearly
there answers within microseconds, and a sleep on Linux costs 50-100 us however short it is
asked to be), then it sleeps with exponential back-off up to a cap, so a long wait costs at most a
few thousand cheap wake-ups per second.

While some thread of this process is blocked waiting for a result (:func:`caller_blocked`, used by
``Handle.wait``), that thread computes nothing, so a wait on peers yields instead of sleeping for
up to ``PEER_SPIN_SECONDS`` more: every sleep's overshoot and wake-up (milliseconds on a loaded
VM) would otherwise be added straight to the user's wait.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator

SPIN_SECONDS = 200e-6
# Peers executing the same agreed batch arrive soon, so their waits yield (giving the core to a
# runnable training thread, if any) much longer before sleeping: a sleep's wake-up latency is
# paid on every barrier of the data path.
PEER_SPIN_SECONDS = 0.05
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))

_blocked_callers = 0   # threads blocked in caller_blocked()
_blocked_lock = threading.Lock()


@contextlib.contextmanager
def caller_blocked() -> Iterator[None]:
    """Mark the current thread as blocked until an operation's result arrives."""
    global _blocked_callers
    with _blocked_lock:
        _blocked_callers += 1
    try:
        yield
    finally:
        with _blocked_lock:
            _blocked_callers -= 1


def poll_briefly(ready: Callable[[], bool], seconds: float) -> bool:
    """Test ``ready()`` between ``sched_yield`` calls for up to ``seconds``; return its last
    value.  For waits that usually end within a thread wake-up (~50 us on a loaded VM), where
    blocking would add that wake-up to the latency."""
    if ready():
        return True
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        _yield()
        if ready():
            return True
    return False


def wait_until(ready: Callable[[], bool], max_sleep: float,
               on_slow: Callable[[float], None] | None = None, slow_every: float = 1.0,
               spin_seconds: float = SPIN_SECONDS) -> None:
    """Return once ``ready()`` is true.  ``on_slow(waited_seconds)`` is called about every
    ``slow_every`` seconds of waiting (stall checks); it may raise to abandon the wait.
    ``spin_seconds``: how long to test between ``sched_yield`` calls before sleeping.

    ``ready()`` may consume what it waits for (a matched probe receives the message), so it is
    never called again once it has answered true: that answer must end the wait."""
    start = time.monotonic()
    if poll_briefly(ready, spin_seconds):
        return
    next_slow = start + slow_every
    sleep = 20e-6
    spin_until = None   # set when a blocked caller is first seen during this wait
    while True:
        if _blocked_callers and (spin_until is None or time.perf_counter() < spin_until):
            if spin_until is None:
                spin_until = time.perf_counter() + PEER_SPIN_SECONDS
            _yield()
        else:
            time.sleep(sleep)
            sleep = min(max_sleep, sleep * 2)
        if ready():
            return
        if on_slow is not None:
            now = time.monotonic()
            if now >= next_slow:
                next_slow = now + slow_every
                on_slow(now - start)
