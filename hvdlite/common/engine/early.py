"""Early reductions: a small allreduce that runs alone in its round costs one exchange instead of
two, once the order of such rounds has been seen.

Normally a tensor costs a negotiation round (one small AND across the ranks) and then its data
exchange.  Training loops repeat themselves: a loss or metric reduced every step, a small model
whose whole gradient fits one bucket, a loop of synchronous allreduces over a model's
parameters or a list of metrics.  Every rank remembers, for each cached allreduce that ran alone
in a round, which one ran alone in the next working round.  When one runs alone again, every
rank predicts that its successor comes next and starts that tensor's data exchange together with
the next round's AND, contributing its pending entry (or, if it has none yet, anything: that
share is ignored).  The AND then tells every rank alike whether every rank contributed the
tensor: if so, the exchange's result stands and the tensor completes; if not, the result is
dropped and the tensor runs as usual.  The prediction is made only from what every rank agreed on
(which slot ran alone, which data path served it, what the cache holds), so every rank starts the
same exchanges in the same order.

The result is the same bits as the usual path's (the same MPI allreduce of the same prescaled
bytes, the same postscale).  A wrong prediction costs one small exchange beside the AND, and the
successor is then corrected.
"""
from __future__ import annotations

from typing import Any, Callable

from hvdlite.common.engine.handle import Entry

# Largest tensor reduced early: a wrong prediction then wastes a latency-bound exchange at most.
EARLY_MAX_BYTES = 64 * 1024

Start = Callable[[Entry | None], Callable[[], bool]]


class EarlyPlan:
    """What the next round starts early (``next``: ``(slot, start)``, or None), kept up to date
    from each round's agreed outcome by :meth:`after_round`.

    ``cached(slot)``: the response the cache holds in ``slot`` now (None if none): a slot that
    was erased or given to another tensor since it ran is never predicted for its old tensor."""

    def __init__(self, cached: Callable[[int], Any]) -> None:
        self.next: tuple[int, Start] | None = None
        self._cached = cached
        self._starts: dict[int, tuple[Any, Start]] = {}   # slot -> (its response, start)
        self._after: dict[int, int] = {}   # slot -> the slot that ran alone right after it
        self._last: int | None = None      # the slot that ran alone in the last working round

    def after_round(self, sole_slot: int | None, progress: bool,
                    start: Callable[[], Start | None]) -> None:
        """``sole_slot``: the cached slot that alone ran in this round (the round's
        ``sole_slot``, the same on every rank); ``progress``: the round ran anything at all;
        ``start()``: how to start that slot's tensor early, or None if it cannot be (asked
        only for a slot not known yet)."""
        if sole_slot is None:
            if progress:   # several tensors, or one negotiated in full: no successor to learn
                self.next = self._last = None
            return
        response = self._cached(sole_slot)
        known = self._starts.get(sole_slot)
        if known is None or known[0] is not response:
            starter = start()
            if starter is None:
                self._starts.pop(sole_slot, None)
            else:
                self._starts[sole_slot] = (response, starter)
        if self._last is not None:
            self._after[self._last] = sole_slot
        self._last = sole_slot
        follow = self._after.get(sole_slot)
        planned = None if follow is None else self._starts.get(follow)
        if planned is None or planned[0] is not self._cached(follow):
            self.next = None
        else:
            self.next = (follow, planned[1])
