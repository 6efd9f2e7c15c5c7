"""The elastic driver: a job as a sequence of worlds, whatever runs their workers.

One world cannot lose or gain a worker (an MPI world's size is fixed), so the driver runs the
job as worlds, each started by a :class:`~.provider.Provider` (processes over the MPI launcher,
Ray actors, Spark barrier stages).  For each world:

* wait (up to ``elastic_timeout``) until the discovered hosts that are not blacklisted offer
  the slots it needs (the first world ``start_np``, later ones ``min_np``), place up to
  ``max_np`` ranks on them, oldest hosts first (:mod:`.hosts`), and start it, its workers
  pointed at the driver's commit server (:mod:`.server`);
* watch it: every worker connects at ``hvd.init()``; when training ends it says so (``done``),
  and when its world fails it offers its newest commit and says ``reset``.  A worker whose
  connection ends without a word has failed (killed, crashed, its host lost): the world is
  over, the others notice through hvdlite's watchdog and report in, and what still runs after
  a short grace is stopped;
* discovery runs every second; when the hosts available would give a different placement,
  rank 0 is told, and every rank stops at its next commit (``HostsUpdatedInterrupt``) so that
  the next world starts at the new size, with nothing rolled back.

How a world ended (Horovod's rules, ``horovod/runner/elastic/driver.py``, for every provider):
training finished ends the job; otherwise the first rank lost and every rank that raised are
blamed, and their hosts blacklisted (for providers that blacklist); the job stops if every
rank failed, if every host of the world is blacklisted, or after ``reset_limit`` resets, else
the next world starts from the last commit.  A provider that does not retry a rank's own
exception (Ray, Spark: a bug would fail again in every world) ends the job with it.
"""
from __future__ import annotations

import queue
import signal
import threading
import time
from typing import Any, Callable, Mapping, Optional

from hvdlite.common.core import elastic_wire as wire

from . import hosts as hostmod
from .provider import HostsUnreachable, Provider, WorldEnd, WorldRecord, WorldStartError, ranks_on
from .server import Event, Server

DISCOVER_SECONDS = 1.0    # horovodrun's discovery period
POLL_SECONDS = 0.1        # how long one look at a running world waits for news
TEARDOWN_GRACE = 5.0      # after a failure, how long the other workers get to report and end
KILL_GRACE = 3.0          # after asking a world to stop, before making it
HELLO_SECONDS = 600.0     # a world whose workers have not all reported in by then has failed
START_ATTEMPTS = 3        # worlds in a row that fail to start before the job gives up
RESET_LIMIT_MESSAGE = ("hvdlite was shut down because the number of resets during the elastic "
                       "job exceeded the limit: {}")   # horovodrun's message, in hvdlite's words


class Discoverer(threading.Thread):
    """Runs discovery every :data:`DISCOVER_SECONDS`; the driver reads :attr:`latest`.  The
    first run's error is raised; later ones keep the last answer (said once)."""

    def __init__(self, discovery: Any, say: Callable[[str], None]) -> None:
        super().__init__(name="hvdlite-elastic-discovery", daemon=True)
        self.discovery = discovery
        self.say = say
        self.latest: dict[str, int] = dict(discovery.find_available_hosts_and_slots())
        self.problem: Optional[str] = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(DISCOVER_SECONDS):
            self.refresh()

    def refresh(self) -> None:
        """Discover now (also called before a world is placed: a host gone since the last
        run, or a run that is slow to return, would place it on what is not there)."""
        try:
            self.latest = dict(self.discovery.find_available_hosts_and_slots())
            self.problem = None
        except Exception as exc:   # noqa: BLE001 - any failure: keep the last answer
            if self.problem is None:
                self.say(f"host discovery failed, keeping the last answer: {exc}")
            self.problem = str(exc)

    def stop(self) -> None:
        self._stop_event.set()


class ElasticDriver:
    """Runs one elastic job's worlds with ``provider`` (see the module docstring).

    ``settings`` has ``start_np``, ``min_np``, ``max_np``, ``discovery`` (with
    ``find_available_hosts_and_slots()``), ``reset_limit``, ``cooldown_range`` and
    ``elastic_timeout``.  ``say`` writes a message for the user; ``fail(message)`` is the
    exception that ends the job; ``timeout_error(need, available, hosts_text)`` the one for an
    elastic timeout."""

    def __init__(self, provider: Provider, settings: Any, say: Callable[[str], None],
                 fail: Callable[[str], BaseException],
                 timeout_error: Callable[[int, int, str], BaseException],
                 catch_signals: bool = False) -> None:
        self.provider = provider
        self.settings = settings
        self.say = say
        self.fail = fail
        self.timeout_error = timeout_error
        self.catch_signals = catch_signals
        self.manager = hostmod.HostManager(settings.cooldown_range)
        self.signals: list[int] = []
        self.world: Optional[WorldRecord] = None   # the world running now
        self._timestamp = 0

    # --- the job -----------------------------------------------------------------------------
    def run(self, server: Server, discoverer: Discoverer) -> Any:
        """The job, with ``server`` and ``discoverer`` (started here) that the caller closes:
        the provider's result of the world that finished, or ``128 + signal``."""
        discoverer.start()
        previous = self._install_handlers()
        try:
            return self._loop(server, discoverer)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.world is not None:   # an exception (or Ctrl-C) left it running
                self._end(self.world, server, failed=True)

    def _loop(self, server: Server, discoverer: Discoverer) -> Any:
        resets = start_failures = 0
        index = 0
        while True:
            need = self.settings.start_np if index == 0 else self.settings.min_np
            placement = self.wait_for_slots(discoverer, need)
            if placement is None:
                return 128 + self.signals[0]
            world = WorldRecord(index, placement, ranks_on(placement), time.monotonic())
            try:
                self.world = world
                self.provider.start(world, worker_environment(server, world.index))
            except HostsUnreachable as exc:   # blacklisted; the next wait says what is left
                self.world = None
                for host in exc.hosts:
                    self.manager.blacklist(host)
                continue
            except WorldStartError as exc:
                self._end(world, server, failed=True)
                end = WorldEnd("reset", [], f"world {index} could not start: {exc}")
            else:
                end = self.watch(server, discoverer, world)
                self._end(world, server, failed=end.kind != "done")
            if end.kind == "done":
                return self.provider.result(world)
            if end.kind == "stopped":
                return end.status
            if end.kind == "error":   # the function's own exception, not retried
                raise self.provider.error(world, end.culprits[0])
            if end.kind == "failed":
                raise self.fail(end.reason)
            # a world none of whose workers reported in never started
            start_failures = start_failures + 1 if not (world.formed and world.members) else 0
            if start_failures > START_ATTEMPTS:
                raise self.fail(f"{start_failures} worlds in a row could not start; the last: "
                                f"{end.reason}")
            self._blame(world, end)
            if self.settings.reset_limit is not None and resets >= self.settings.reset_limit:
                raise self.fail(RESET_LIMIT_MESSAGE.format(self.settings.reset_limit))
            resets += 1
            index += 1

    def _blame(self, world: WorldRecord, end: WorldEnd) -> None:
        blamed = sorted({world.host_of[r] for r in end.culprits if r in world.host_of})
        note = ""
        if self.provider.blacklists and blamed:
            for host in blamed:
                self.manager.blacklist(host)
            note = f"; blacklisted {', '.join(self.provider.host_name(h) for h in blamed)}"
        self.say(f"world {world.index} ended: {end.reason}{note}")
        if self.provider.blacklists and all(self.manager.is_blacklisted(host)
                                            for host, _ in world.placement):
            raise self.fail(f"every {self.provider.host_word} of world {world.index} "
                            f"({self.describe(world)}) failed and is blacklisted: {end.reason}")

    def _end(self, world: WorldRecord, server: Server, failed: bool) -> None:
        self.world = None
        self.provider.finish(world, failed)
        server.forget(world.index)

    def describe(self, world: WorldRecord) -> str:
        return ",".join(f"{self.provider.host_name(h)}:{n}" for h, n in world.placement)

    # --- hosts -------------------------------------------------------------------------------
    def _refresh(self, discoverer: Discoverer) -> int:
        return int(self.manager.update(discoverer.latest))

    def wait_for_slots(self, discoverer: Discoverer,
                       need: int) -> Optional[list[tuple[str, int]]]:
        """The placement of the next world, once the hosts offer ``need`` slots; None when a
        signal came first.  Raises ``timeout_error`` after ``elastic_timeout``."""
        deadline = time.monotonic() + self.settings.elastic_timeout
        said = False
        discoverer.refresh()
        while not self.signals:
            self._refresh(discoverer)
            available = self.manager.available()
            if sum(slots for _, slots in available) >= need:
                return hostmod.assign(available, self.settings.max_np)
            if time.monotonic() > deadline:
                problem = f" (discovery: {discoverer.problem})" if discoverer.problem else ""
                raise self.timeout_error(need, sum(s for _, s in available),
                                         self.manager.describe() + problem)
            if not said:
                self.say(f"waiting up to {self.settings.elastic_timeout:g} s for {need} slots; "
                         f"{self.manager.describe()}")
                said = True
            time.sleep(0.2)
        return None

    # --- a world -----------------------------------------------------------------------------
    def watch(self, server: Server, discoverer: Discoverer, world: WorldRecord) -> WorldEnd:
        """Follow ``world`` to its end; how it ended."""
        last_discovery = 0.0
        while not self.provider.poll(world, POLL_SECONDS):
            self.handle_events(server, world)
            if self.signals:
                return self._stop_for_signal(world)
            now = time.monotonic()
            if now - last_discovery >= DISCOVER_SECONDS / 2:
                last_discovery = now
                world.updates |= self._refresh(discoverer)
                if world.failed_at is None and world.first_report_at is None:
                    self._maybe_notify(world)
            self._maybe_stop(world, now)
        # Workers the provider saw end may still be reporting (a failing world's survivors
        # hand in their newest commit first): wait for them, unless every rank returned.
        clean = len(world.results) == world.size and world.failed_at is None
        deadline = time.monotonic() + (0 if clean else self.provider.report_grace)
        while time.monotonic() < deadline and any(
                m.outcome is None and m.ended_at is None for m in world.members.values()):
            self.handle_events(server, world, timeout=0.05)
            if self.signals:
                break
        self.handle_events(server, world)
        self.provider.settle(world)
        return classify(world, self.provider.host_name, self.provider.host_word,
                        self.provider.retries_own_errors)

    def handle_events(self, server: Server, world: WorldRecord, timeout: float = 0) -> None:
        """Take in what the workers said (hello, outcome, a connection that ended)."""
        try:
            event = server.events.get(timeout=timeout) if timeout else \
                server.events.get_nowait()
        except queue.Empty:
            return
        while True:
            record(event, world)
            try:
                event = server.events.get_nowait()
            except queue.Empty:
                return

    def _maybe_notify(self, world: WorldRecord) -> None:
        """Tell rank 0 when the hosts available now would place the ranks differently."""
        desired = hostmod.desired_placement(self.manager.available(), self.settings.min_np,
                                            self.settings.max_np)
        if desired == world.placement or desired == world.notified:
            return
        coordinator = world.members.get(0)
        if coordinator is None:
            return
        self._timestamp += 1
        update = world.updates or int(wire.HostUpdateResult.mixed)
        if coordinator.send(("hosts_updated", self._timestamp, update)):
            world.notified = desired
            self.say(f"world {world.index}: the {self.provider.host_word}s changed (now "
                     f"{self.manager.describe()}); the workers stop at their next commit")

    def _maybe_stop(self, world: WorldRecord, now: float) -> None:
        if world.stopped_at is not None:
            if now - world.stopped_at > KILL_GRACE:
                self.provider.stop(world, hard=True)
            return
        started = world.failed_at
        if started is None and len(world.members) < world.size and (
                now - world.started > HELLO_SECONDS):
            started = world.failed_at = now   # some workers never reported in
        if started is None:
            return
        accounted = all(m.outcome is not None or m.ended_at is not None
                        for m in world.members.values())
        waited = now - started
        if waited > TEARDOWN_GRACE or (accounted and len(world.members) == world.size
                                       and waited > 1.0):
            world.stopped_at = now
            self.provider.stop(world, hard=False)

    def _stop_for_signal(self, world: WorldRecord) -> WorldEnd:
        self.provider.stop(world, hard=False, signum=self.signals[0])
        deadline = time.monotonic() + KILL_GRACE + 2
        hard_at = None   # when the hard stop was sent (once)
        while not self.provider.poll(world, POLL_SECONDS):
            now = time.monotonic()
            if hard_at is None and (now > deadline or len(self.signals) > 1):
                self.provider.stop(world, hard=True)
                hard_at = now
            elif hard_at is not None and now > hard_at + KILL_GRACE + 2:
                break   # not even a hard stop ended it: settle what can be, do not wait forever
        self.provider.settle(world)
        return WorldEnd("stopped", [], "stopped by a signal", 128 + self.signals[0])

    # --- signals -----------------------------------------------------------------------------
    def _install_handlers(self) -> dict:
        if not self.catch_signals or threading.current_thread() is not threading.main_thread():
            return {}

        def received(signum: int, _frame: object) -> None:
            self.signals.append(signum)

        return {sig: signal.signal(sig, received) for sig in (signal.SIGINT, signal.SIGTERM)}


def worker_environment(server: Server, world: int, address: str = "") -> dict[str, str]:
    """The variables that connect world ``world``'s workers to ``server`` at ``hvd.init()``
    (without ``address``, the provider adds :func:`driver_variable` for its workers)."""
    env = {wire.KEY_VARIABLE: server.key.hex(), wire.WORLD_VARIABLE: str(world)}
    if address:
        env.update(driver_variable(server, address))
    return env


def driver_variable(server: Server, address: str) -> dict[str, str]:
    """The variable that tells workers where ``server`` listens: at ``address``, the one its
    provider's workers reach it at."""
    return {wire.DRIVER_VARIABLE: f"{address}:{server.port}"}


def record(event: Event, world: WorldRecord) -> None:
    """Take one of the commit server's events into ``world``."""
    member = event.member
    if member.world != world.index:
        return   # a worker of an earlier world, ending late
    if event.kind == "hello":
        world.members[member.rank] = member
        if member.rank == 0 and world.notified is not None:
            world.notified = None   # rank 0 (re)connected: tell it again
    elif event.kind == "outcome":
        kind = member.outcome[0]
        if kind in ("reset", "interrupt") and world.first_report_at is None:
            world.first_report_at = event.at
        if kind == "error":
            world.raised.setdefault(member.rank, member.outcome[1])
        if kind in ("reset", "error") and world.failed_at is None:
            world.failed_at = event.at
    elif event.kind == "ended" and member.outcome is None:
        world.lost.append(member.rank)
        if world.failed_at is None:
            world.failed_at = event.at


def last_line(text: Any) -> str:
    """The last line of an error's text, at most 300 characters."""
    lines = str(text).strip().splitlines()
    return lines[-1][:300] if lines else ""


def classify(world: WorldRecord, host_name: Callable[[str], str] = str,
             host_word: str = "host", retries_own_errors: bool = True) -> WorldEnd:
    """How ``world`` ended (see the module docstring).  Pure: every fact is in ``world``."""
    outcomes = {rank: m.outcome for rank, m in world.members.items() if m.outcome}
    kinds = {o[0] for o in outcomes.values()}
    failing = {"error", "reset", "interrupt"}
    if ("done" in kinds and (world.results or not world.died)) or (
            len(world.results) == world.size and not world.lost and not kinds & failing):
        return WorldEnd("done", [], "training finished", world.status)
    own = sorted(world.raised)
    if own and not retries_own_errors:
        return WorldEnd("error", own[:1], f"rank {own[0]} on "
                        f"{host_name(world.host_of.get(own[0], '?'))} raised "
                        f"{last_line(world.raised[own[0]])}", world.status)
    missing = [r for r in range(world.size) if r not in world.members]
    if len(missing) == world.size and not world.died and world.formed:
        return WorldEnd("failed", missing, f"no worker of world {world.index} reached "
                        f"hvd.init(); the launcher exited with status {world.status} (its "
                        f"output above says why)", world.status)
    # Who failed on their own: the workers that raised, and the first one lost (those lost
    # after it, on its host or elsewhere, went down with the world).  A world that lost
    # workers before they all reported in blames the ones that never did.
    lost = world.lost + [r for r in world.died if r not in outcomes and r not in world.lost]
    if not world.formed:
        culprits: list[int] = []
    elif missing and (world.failed_at is None or not lost):
        culprits = missing
    else:
        culprits = sorted(set(own) | set(lost[:1]))
    reason = _reason(world, outcomes, lost, missing, host_name, host_word)
    if culprits and len(culprits) == world.size:
        first = f"; rank {own[0]}: {world.raised[own[0]]}" if own else ""
        return WorldEnd("failed", culprits, f"every rank of world {world.index} failed "
                        f"({reason}){first}", world.status)
    return WorldEnd("reset", culprits, reason, world.status)


def _reason(world: WorldRecord, outcomes: Mapping[int, tuple], lost: list[int],
            missing: list[int], host_name: Callable[[str], str], host_word: str) -> str:
    if not world.formed:
        return "its workers did not all start and form the world within the start timeout"
    if lost:
        rank = lost[0]
        return (f"rank {rank} on {host_name(world.host_of.get(rank, '?'))} exited without a "
                f"word (killed, crashed, or its {host_word} lost)")
    if world.raised:
        rank = min(world.raised)
        return f"rank {rank} raised {last_line(world.raised[rank])}"
    resets = [(r, o[1]) for r, o in sorted(outcomes.items()) if o[0] == "reset"]
    if resets:
        return f"rank {resets[0][0]}: {last_line(resets[0][1])}"
    if any(o[0] == "interrupt" for o in outcomes.values()):
        return f"the {host_word}s changed"
    if missing:
        return f"rank(s) {missing} never reached hvd.init()"
    return f"the world ended with status {world.status}"
