"""Waiting without spinning a core.

MPI's blocking calls busy-poll, which would steal the CPU that training needs while a rank waits
for slower peers.  The engine instead tests non-blocking operations, yielding first (a fast peer
answers within microseconds) and then sleeping with exponential back-off up to a cap, so a long
wait costs a few hundred wake-ups per second at most.
"""
from __future__ import annotations

import time
from typing import Callable


def wait_until(ready: Callable[[], bool], max_sleep: float,
               on_slow: Callable[[float], None] | None = None, slow_every: float = 1.0) -> None:
    """Return once ``ready()`` is true.  ``on_slow(waited_seconds)`` is called about every
    ``slow_every`` seconds of waiting (stall checks); it may raise to abandon the wait."""
    if ready():
        return
    start = time.monotonic()
    next_slow = start + slow_every
    sleep = 0.0
    spins = 0
    while not ready():
        if spins < 20:
            spins += 1
            time.sleep(0)  # yield the GIL and the core; the peer is usually nearly there
            continue
        sleep = min(max_sleep, max(sleep * 2, 10e-6))
        time.sleep(sleep)
        if on_slow is not None:
            now = time.monotonic()
            if now >= next_slow:
                next_slow = now + slow_every
                on_slow(now - start)
