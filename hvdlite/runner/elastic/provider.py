"""What the elastic driver (:mod:`.driver`) needs from whatever runs a world's workers: the
provider interface, and the record of one world both sides fill in.

Three providers implement it: processes started over the MPI launcher (:mod:`.launcher`,
``hvdlite run --min-np``), Ray actors (:mod:`hvdlite.ray.elastic`) and Spark barrier stages
(:mod:`hvdlite.spark.elastic`).  The driver owns the rules (when a world has ended and why,
who is blamed, when the job stops); a provider only discovers slots, starts, watches and stops
its workers, and names things in its user's words.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

from .server import Member


class WorldStartError(Exception):
    """The world could not start (nodes gone while starting, tasks that did not form the world
    in time): the driver tries again, up to :data:`.driver.START_ATTEMPTS` worlds in a row."""


class HostsUnreachable(Exception):
    """Hosts of the placement cannot be reached (the launcher's host check): the driver
    blacklists them and places the world again, without counting a reset."""

    def __init__(self, hosts: list[str]) -> None:
        super().__init__(", ".join(hosts))
        self.hosts = hosts


@dataclasses.dataclass
class WorldRecord:
    """One world: where its ranks are, what its workers said through the commit server (the
    driver fills that in) and what the provider saw of them."""

    index: int
    placement: list[tuple[str, int]]        # (host, ranks), in rank order
    host_of: dict[int, str]                 # rank -> host
    started: float
    handle: Any = None                      # the provider's own (a process, actors, a stage)
    members: dict[int, Member] = dataclasses.field(default_factory=dict)
    lost: list[int] = dataclasses.field(default_factory=list)   # ended without a word, in order
    failed_at: Optional[float] = None       # first failure: a reset/error, a lost worker
    first_report_at: Optional[float] = None   # first reset/interrupt report
    updates: int = 0                        # HostUpdateResult bits since the world started
    notified: Optional[list] = None         # the placement rank 0 was told about
    stopped_at: Optional[float] = None      # when the driver asked the provider to stop it
    # Filled by the provider:
    results: dict[int, Any] = dataclasses.field(default_factory=dict)   # rank -> return value
    raised: dict[int, Any] = dataclasses.field(default_factory=dict)    # the function's own error
    died: list[int] = dataclasses.field(default_factory=list)   # processes seen ending, no result
    status: int = 0                         # the launcher's exit status (MPI), else 0
    formed: bool = True                     # False: it did not form within the start timeout

    @property
    def size(self) -> int:
        return sum(n for _, n in self.placement)


def ranks_on(placement: list[tuple[str, int]]) -> dict[int, str]:
    """rank -> host for ``placement`` (each host's ranks consecutive, in its order)."""
    return dict(enumerate(host for host, n in placement for _ in range(n)))


@dataclasses.dataclass
class WorldEnd:
    """How a world ended: ``kind`` is "done", "reset", "failed" (the job cannot go on),
    "error" (a rank's own exception ends the job) or "stopped" (by a signal)."""

    kind: str
    culprits: list[int]          # ranks blamed for the failure
    reason: str
    status: int = 0


class Provider(Protocol):
    """Runs the workers of one elastic job's worlds for :class:`.driver.ElasticDriver`."""

    host_word: str            # what a host is called in messages ("host", "node")
    blacklists: bool          # blame a failing host by blacklisting it (with the cooldown)
    retries_own_errors: bool  # a rank's own exception: retry without its host (else: end the job)
    report_grace: float       # after a world's end, how long its workers may still report

    def host_name(self, host: str) -> str:
        """``host`` in the user's words."""

    def start(self, world: WorldRecord, env: dict[str, str]) -> None:
        """Start ``world``'s workers with ``env`` (the commit server's variables) added; set
        ``world.handle``.  Raises :class:`WorldStartError` or :class:`HostsUnreachable`."""

    def poll(self, world: WorldRecord, timeout: float) -> bool:
        """Wait up to ``timeout`` for news of ``world``'s workers and record it (results,
        ``raised``, ``died``, ``status``; ``failed_at`` on a failure); whether it has ended."""

    def stop(self, world: WorldRecord, hard: bool, signum: Optional[int] = None) -> None:
        """Make ``world``'s workers end (``hard``: they did not after the first ask;
        ``signum``: the signal the driver received, to pass on)."""

    def settle(self, world: WorldRecord) -> None:
        """``world`` has ended and its workers have reported: take in what is left of it (the
        launcher's output) before the driver says how it ended."""

    def finish(self, world: WorldRecord, failed: bool) -> None:
        """``world`` has ended: release what is left of it."""

    def error(self, world: WorldRecord, rank: int) -> BaseException:
        """The exception that ends the job when ``rank``'s function raised (providers that
        do not retry a rank's own error)."""

    def result(self, world: WorldRecord) -> Any:
        """What the job returns after ``world`` finished training."""
