"""The stall inspector: telling when a tensor waits for ranks that never submit it.

Two views of one problem.  The coordinator sees every rank's pending tensors (each rank sends
their ages when a report is due) and reports those submitted on some ranks but not on others,
naming what the missing ranks wait on instead; past ``HVDLITE_STALL_SHUTDOWN_TIME_SECONDS`` it
fails them on every rank (:class:`StallInspector`).  A rank whose round itself does not complete
(a peer's background thread is not running at all) checks its peers and warns, then gives up,
on its own (:func:`hvdlite.common.runtime.peer_wait.check_wait`).

A stall report is due a stall-check period after a tensor was submitted, or at the shutdown time
if that comes first: a shutdown time shorter than the check time is honoured as set.
"""
from __future__ import annotations

import logging
import time

from hvdlite.common.config import Config
from hvdlite.common.engine.messages import ERROR_STALL, Response

log = logging.getLogger("hvdlite")

NEVER = float("inf")
# The coordinator remembers this many tensors that ranks gave up on (stall shutdown), so that a
# rank submitting one of them late is told why it waits alone.
_GAVE_UP_MEMORY = 256
_SHOWN_PER_RANK = 3   # names listed per rank in a stall report


def first_due(submitted_at: float, config: Config) -> float:
    """When a tensor submitted at ``submitted_at`` is first due for a stall report."""
    if not config.stall_check_enabled:
        return NEVER
    due = submitted_at + config.stall_check_seconds
    if config.stall_shutdown_seconds > 0:
        due = min(due, submitted_at + config.stall_shutdown_seconds)
    return due


def next_due(now: float, submitted_at: float, config: Config) -> float:
    """After a report at ``now``: the next one, a check period later or at the shutdown time."""
    due = now + config.stall_check_seconds
    deadline = submitted_at + config.stall_shutdown_seconds
    if config.stall_shutdown_seconds > 0 and now < deadline:
        due = min(due, deadline)
    return due


class StallInspector:
    """The coordinator's side: reports from every rank's pending tensors and their ages."""

    def __init__(self, global_ranks: list[int], config: Config) -> None:
        self.global_ranks = global_ranks
        self.config = config
        # tensors failed by the stall shutdown -> (the ranks that gave up, when)
        self.gave_up: dict[str, tuple[list[int], float]] = {}

    def name_in_use(self, name: str) -> None:
        """Every rank submitted ``name`` again: forget that ranks once gave up on it."""
        if self.gave_up:
            self.gave_up.pop(name, None)

    def report(self, pending_by_rank: dict[int, dict[str, float] | None],
               table: dict[str, dict]) -> list[Response]:
        """Warn about tensors missing on some ranks; return error responses for those past the
        shutdown time (and drop them from the coordinator's ``table``).  ``pending_by_rank``:
        each global rank's pending tensors and their ages in seconds (None: not reported)."""
        cfg = self.config
        by_name: dict[str, dict[int, float]] = {}
        for rank, pending in pending_by_rank.items():
            for name, age in (pending or {}).items():
                by_name.setdefault(name, {})[rank] = age
        waiting_on = {rank: _oldest_first(p) for rank, p in pending_by_rank.items()}
        errors = []
        lines = []
        now = time.monotonic()
        shutdown = cfg.stall_shutdown_seconds
        for name, ages in sorted(by_name.items()):
            missing = [r for r in self.global_ranks if r not in ages]
            age = max(ages.values())
            if not missing or age < min(cfg.stall_check_seconds, shutdown or NEVER):
                continue
            late = self._late_note(name, missing, sorted(ages), now)
            elsewhere = _missing_ranks_doing(missing, waiting_on)
            lines.append(f"  {name!r}: submitted on ranks {sorted(ages)} {age:.0f} s ago, "
                         f"missing on ranks {missing} ({elsewhere}){late}")
            if shutdown > 0 and age >= shutdown:
                table.pop(name, None)
                self.gave_up[name] = (sorted(ages), now)
                while len(self.gave_up) > _GAVE_UP_MEMORY:
                    del self.gave_up[next(iter(self.gave_up))]
                advice = late or (" Every rank must submit the same tensors; check for "
                                  "rank-dependent control flow.")
                errors.append(Response(
                    name, "error", error_kind=ERROR_STALL,
                    error=(f"Tensor {name!r} stalled: submitted on ranks {sorted(ages)} but "
                           f"missing on ranks {missing} for {age:.0f} s (HVDLITE_STALL_SHUTDOWN_"
                           f"TIME_SECONDS={shutdown:g}); {elsewhere}.{advice}")))
        if lines:
            log.warning("Stall detected: one or more tensors were submitted on some ranks but "
                        "not on others (the other ranks may be waiting on these forever):\n%s"
                        "\nCheck for rank-dependent code paths, or ranks that ran out of data.",
                        "\n".join(lines))
        return errors

    def _late_note(self, name: str, missing: list[int], waiting: list[int], now: float) -> str:
        """If the ranks missing ``name`` are ones that already gave up on it, say so: then these
        ranks did not skip it, they reached it after the others' stall shutdown."""
        record = self.gave_up.get(name)
        if record is None or not set(missing) <= set(record[0]):
            return ""
        return (f" Ranks {missing} already gave up on this tensor {now - record[1]:.0f} s ago "
                f"(their stall shutdown), before ranks {waiting} submitted it: these ranks run "
                f"far behind the others (for example after a slow import, data loading or "
                f"checkpoint reading on these ranks only). Set HVDLITE_STALL_SHUTDOWN_TIME_"
                f"SECONDS well above that gap.")


def _oldest_first(pending: dict[str, float] | None) -> list[str]:
    """The names of a rank's pending tensors (name -> age in seconds), the oldest first: the
    oldest is where a diverging rank went its own way."""
    return sorted(pending or (), key=lambda name: (-pending[name], name))


def _missing_ranks_doing(missing: list[int], waiting_on: dict[int, list[str]]) -> str:
    """What the ranks missing a tensor wait for instead: the other tensors each has pending,
    oldest first (a different name or order points at the diverging code), or nothing (still
    computing, or it never submits the tensor)."""
    parts = []
    for rank in missing:
        names = waiting_on.get(rank, [])
        if not names:
            parts.append(f"rank {rank} has no operation pending")
            continue
        shown = ", ".join(repr(n) for n in names[:_SHOWN_PER_RANK])
        more = len(names) - _SHOWN_PER_RANK
        parts.append(f"rank {rank} is waiting on {shown}" + (f" and {more} more" if more > 0
                                                               else ""))
    return "; ".join(parts)
