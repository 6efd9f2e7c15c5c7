"""Early reductions: a small allreduce that runs alone round after round costs one exchange
instead of two.

Normally a tensor costs a negotiation round (one small AND across the ranks) and then its data
exchange.  When the same cached allreduce has run alone in two rounds in a row (a training loop
whose whole gradient fits one small bucket, a loss or metric reduced every step), every rank
predicts that it comes again and starts its data exchange together with the next round's AND,
contributing its pending entry (or, if it has none yet, anything: that share is ignored).  The AND
then tells every rank alike whether every rank contributed the tensor: if so, the exchange's
result stands and the tensor completes; if not, the result is dropped and the tensor runs as
usual.  The prediction is made from what every rank agreed on (which slot ran alone, which data
path served it), so every rank starts the same exchanges in the same order.

The result is the same bits as the usual path's (the same MPI allreduce of the same prescaled
bytes, the same postscale).  A wrong prediction costs one small exchange beside the AND; the
plan is dropped as soon as a round runs something else.
"""
from __future__ import annotations

from typing import Callable

from hvdlite.common.engine.handle import Entry

# Largest tensor reduced early: a wrong prediction then wastes a latency-bound exchange at most.
EARLY_MAX_BYTES = 64 * 1024

Start = Callable[[Entry | None], Callable[[], bool]]


class EarlyPlan:
    """What the next round starts early (``next``: ``(slot, start)``, or None), kept up to date
    from each round's agreed outcome by :meth:`after_round`."""

    def __init__(self) -> None:
        self.next: tuple[int, Start] | None = None
        self._ran_alone: int | None = None   # the slot that ran alone in the last working round

    def after_round(self, sole_slot: int | None, progress: bool,
                    start: Callable[[], Start | None]) -> None:
        """``sole_slot``: the cached slot that alone ran in this round (the round's
        ``sole_slot``, the same on every rank); ``progress``: the round ran anything at all;
        ``start()``: how to start that slot's tensor early, or None if it cannot be (asked
        only when needed)."""
        if sole_slot is None:
            if progress:   # something else ran: the pattern is broken
                self.next = self._ran_alone = None
            return
        if self.next is not None and self.next[0] == sole_slot:
            return   # it came again, early or not
        starter = start() if self._ran_alone == sole_slot else None
        self.next = None if starter is None else (sole_slot, starter)
        self._ran_alone = sole_slot
