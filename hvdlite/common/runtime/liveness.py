"""Noticing node-local peers whose process is gone without a word.

A rank that is killed (the OOM killer, a signal), calls ``os._exit`` or crashes in native code
never tells the others.  Most launchers then tear the whole job down, but not every one does
(Slurm's ``srun`` keeps the other tasks running unless ``--kill-on-bad-exit`` is given, and a
launcher can miss the exit), and the survivors would wait inside a collective for ever.  So
every rank records the process of each rank on its node at ``init()`` (pid and start time, the
pair that identifies a process even after its pid is reused), and a wait for peers that has
lasted a second checks them (see ``Controller.local_stall``): a vanished node-local peer becomes
a ``RankExitedError`` on every waiting rank within seconds.  Peers on other nodes cannot be
checked this way; their launcher or ``HVDLITE_STALL_SHUTDOWN_TIME_SECONDS`` covers them.
"""
from __future__ import annotations

import os
from typing import Iterable

_peers: dict[int, tuple[int, int]] = {}   # rank -> (pid, start time): node-local, not this one
_seen_gone: set[int] = set()              # peers found gone during this process's life
# ranks the watchdog (any host) reported gone: global rank -> what is known of it
_departed: dict[int, str] = {}


def own_identity() -> tuple[int, int | None]:
    """This process's (pid, start time); the start time is None where /proc is unreadable."""
    return os.getpid(), _start_time(os.getpid())


def record(identities: Iterable[tuple[int, int, int | None]], own_rank: int) -> None:
    """Remember the node-local peers (rank, pid, start time) that this process can observe:
    a peer whose start time cannot be read here, or reads differently (another pid namespace,
    e.g. a separate container), is left out rather than risk a false alarm."""
    _peers.clear()
    for rank, pid, started in identities:
        if rank != own_rank and started is not None and _running(pid, started):
            _peers[rank] = (pid, started)


def vanished(ranks: Iterable[int]) -> list[int]:
    """Those of ``ranks`` (node-local, observable) whose process no longer runs."""
    gone = [rank for rank in ranks if rank in _peers and not _running(*_peers[rank])]
    _seen_gone.update(gone)
    return gone


def vanished_seen() -> list[int]:
    """Every peer :func:`vanished` has found gone so far (the job cannot end cleanly then)."""
    return sorted(_seen_gone)


def _running(pid: int, started: int) -> bool:
    # A zombie (exited, not yet reaped by the launcher) or a new process under a reused pid
    # has no start time or another one; either way the rank is gone.
    return _start_time(pid) == started


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), or None if the process does not
    exist, is a zombie, or /proc cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):   # fields[0] is field 3, the state
        return None
    return int(fields[19])


def record_departed(departures) -> None:
    """The watchdog's reports (see :mod:`watchdog`): ranks gone without shutting down."""
    for departure in departures:
        _departed.setdefault(departure.rank, departure.describe())
        _seen_gone.add(departure.rank)


def departed_among(ranks) -> list[str]:
    """What is known of those of ``ranks`` that the watchdog reported gone."""
    return [_departed[r] for r in ranks if r in _departed]


def departed_ranks() -> list[int]:
    """Every rank found gone so far, by the watchdog or the node-local check."""
    return sorted(set(_departed) | _seen_gone)


def forget_departed() -> None:
    """A new job (``init()`` after ``shutdown()``): no rank of it has departed yet."""
    _departed.clear()
