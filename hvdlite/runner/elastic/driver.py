"""The elastic driver's loop: a job as a sequence of MPI worlds.

For each world: wait (up to ``--elastic-timeout``) until the hosts that are discovered and not
blacklisted offer ``-np`` slots (later worlds: ``--min-np``), place up to ``--max-np`` ranks on
them (oldest hosts first), start ``mpiexec`` on them with the driver's address in the workers'
environment, and watch:

* every worker connects at ``hvd.init()`` and says which rank it is; when training ends it says
  so (``done``), and when its world fails it offers its newest commit and says ``reset``;
* a worker whose connection ends without a word has failed (killed, crashed, its host lost): the
  world is over.  Its host is blamed (blacklisted, with the cooldown), the other workers notice
  through hvdlite's watchdog and report in; what is still running after a short grace is
  stopped;
* discovery runs every second; when the hosts available would give a different placement, rank
  0 is told, and every rank stops at its next commit (``HostsUpdatedInterrupt``) so that the
  next world starts at the new size, with nothing rolled back.

A world that ends with ``done`` ends the job with ``mpiexec``'s status.  Otherwise the driver
blacklists the failing hosts, and stops the job if every rank failed on its own, if every host
of the world is blacklisted, or after ``--reset-limit`` resets (horovodrun's rules); else it
starts the next world.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Mapping, Sequence, TextIO

from hvdlite.common.core import elastic_wire as wire
from hvdlite.common.core import warm_start

from .. import addresses, mpi_flavor
from ..job_process import exit_status, kill_group
from ..launch_errors import LaunchError
from . import hosts as hostmod
from .options import ElasticSettings
from .server import Event, Member, Server

DISCOVER_SECONDS = 1.0    # horovodrun's discovery period
TEARDOWN_GRACE = 5.0      # after a failure, how long the other workers get to report and exit
KILL_GRACE = 3.0          # after SIGTERM to a world's launcher, before SIGKILL
REPORT_GRACE = 30.0       # after the launcher exits, how long its workers may still report
HELLO_SECONDS = 600.0     # a world whose workers have not all reported in by then has failed
RESET_LIMIT_MESSAGE = ("hvdlite was shut down because the number of resets during the elastic "
                       "job exceeded the limit: {}")   # horovodrun's message, in hvdlite's words


class ElasticError(LaunchError):
    """The elastic job cannot go on; the message says why."""


def _say(message: str) -> None:
    print(f"hvdlite: elastic: {message}", file=sys.stderr, flush=True)


class _Discoverer(threading.Thread):
    """Runs discovery every :data:`DISCOVER_SECONDS`; the driver reads :attr:`latest`."""

    def __init__(self, discovery) -> None:
        super().__init__(name="hvdlite-elastic-discovery", daemon=True)
        self.discovery = discovery
        self.latest: dict[str, int] = discovery.find_available_hosts_and_slots()   # may raise
        self.problem: str | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(DISCOVER_SECONDS):
            try:
                self.latest = self.discovery.find_available_hosts_and_slots()
                self.problem = None
            except hostmod.DiscoveryError as exc:   # later failures keep the last answer
                if self.problem is None:
                    _say(f"host discovery failed, keeping the last answer: {exc}")
                self.problem = str(exc)

    def stop(self) -> None:
        self._stop_event.set()


@dataclasses.dataclass
class World:
    index: int
    placement: list[tuple[str, int]]
    proc: subprocess.Popen
    pumps: list[threading.Thread]
    started: float
    host_of: dict[int, str]                 # rank -> host, from the placement
    members: dict[int, Member] = dataclasses.field(default_factory=dict)
    lost: list[int] = dataclasses.field(default_factory=list)      # ranks, in order lost
    failed_at: float | None = None          # first failure: a reset/error, or a lost worker
    first_report_at: float | None = None    # first reset/interrupt report
    updates: int = 0                        # HostUpdateResult since the world started
    notified: list | None = None            # the placement rank 0 was told about
    terminated_at: float | None = None

    @property
    def size(self) -> int:
        return sum(n for _, n in self.placement)

    def describe(self) -> str:
        return ",".join(f"{host}:{n}" for host, n in self.placement)


@dataclasses.dataclass
class WorldEnd:
    kind: str                    # "done", "reset", "failed" or "stopped"
    status: int
    culprits: list[int]          # ranks blamed for the failure
    reason: str


class Driver:
    """Runs one elastic job (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, settings: ElasticSettings,
                 environ: dict[str, str], forward: Sequence[str],
                 output: tuple[TextIO, TextIO] | None,
                 on_world: Callable[[int, int], None] | None, prepare: Callable,
                 start: Callable, check: Callable) -> None:
        self.args = args
        self.settings = settings
        self.environ = environ
        self.forward = list(forward)
        self.output = output
        self.on_world = on_world
        self.prepare = prepare
        self.start = start
        self.check = check
        self.manager = hostmod.HostManager(settings.cooldown_range)
        self.checked: set[str] = set()    # hosts that passed the ssh check
        self.signals: list[int] = []
        self._timestamp = 0
        # Names this job's warm processes (one per host; see warm_start), or None: cold starts.
        off = environ.get(warm_start.SWITCH_VARIABLE, "").strip().lower() in warm_start.OFF
        self.warm_token = None if off else secrets.token_hex(8)

    # --- the job -----------------------------------------------------------------------------
    def run(self) -> int:
        try:
            discoverer = _Discoverer(self.settings.discovery)
        except hostmod.DiscoveryError as exc:
            raise ElasticError(f"host discovery failed at its first run: {exc}") from None
        bind = "127.0.0.1" if self._all_local(discoverer.latest) else "0.0.0.0"
        server = Server(bind)
        discoverer.start()
        previous = self._install_handlers()
        try:
            with tempfile.TemporaryDirectory(prefix="hvdlite-elastic-") as workdir:
                return self._loop(server, discoverer, workdir)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            discoverer.stop()
            server.close()

    def _loop(self, server: Server, discoverer: _Discoverer, workdir: str) -> int:
        resets = 0
        index = 0
        while True:
            need = self.settings.start_np if index == 0 else self.settings.min_np
            placement = self._wait_for_slots(discoverer, need)
            if placement is None:
                return 128 + self.signals[0]
            world = self._launch(server, index, placement, workdir)
            if world is None:   # a host failed the ssh check: it is blacklisted, try again
                continue
            end = self._watch(server, discoverer, world)
            server.forget(index)
            if end.kind in ("done", "stopped"):
                return end.status
            if end.kind == "failed":
                raise ElasticError(end.reason)
            blamed = sorted({world.host_of[r] for r in end.culprits if r in world.host_of})
            for host in blamed:
                self.manager.blacklist(host)
            note = f"; blacklisted {', '.join(blamed)}" if blamed else ""
            _say(f"world {index} ended: {end.reason}{note}")
            if all(self.manager.is_blacklisted(host) for host, _ in world.placement):
                raise ElasticError(f"every host of world {index} ({world.describe()}) failed "
                                   f"and is blacklisted: {end.reason}")
            if self.settings.reset_limit is not None and resets >= self.settings.reset_limit:
                raise ElasticError(RESET_LIMIT_MESSAGE.format(self.settings.reset_limit))
            resets += 1
            index += 1

    # --- hosts -------------------------------------------------------------------------------
    @staticmethod
    def _all_local(discovered: Mapping[str, int]) -> bool:
        return all(addresses.is_local(host) for host in discovered)

    def _refresh(self, discoverer: _Discoverer) -> int:
        return int(self.manager.update(discoverer.latest))

    def _wait_for_slots(self, discoverer: _Discoverer,
                        need: int) -> list[tuple[str, int]] | None:
        deadline = time.monotonic() + self.settings.elastic_timeout
        said = False
        while not self.signals:
            self._refresh(discoverer)
            available = self.manager.available()
            if sum(slots for _, slots in available) >= need:
                return hostmod.assign(available, self.settings.max_np)
            if time.monotonic() > deadline:
                problem = f" (discovery: {discoverer.problem})" if discoverer.problem else ""
                raise ElasticError(
                    f"waited {self.settings.elastic_timeout:g} s (--elastic-timeout) for "
                    f"{need} slots (-np/--min-np), but only "
                    f"{sum(s for _, s in available)} are available from "
                    f"{self.settings.discovery.describe()}: {self.manager.describe()}{problem}")
            if not said:
                _say(f"waiting up to {self.settings.elastic_timeout:g} s for {need} slots; "
                     f"{self.manager.describe()}")
                said = True
            time.sleep(0.2)
        return None

    def _check(self, placement: list[tuple[str, int]]) -> list[str]:
        """Log in to the placement's hosts not checked before, as the launcher will (the host
        check of ``hvdlite run``); the ones that cannot be reached."""
        if self.args.skip_host_check:
            return []
        names = [host for host, _ in placement if host not in self.checked]
        failed = self.check(self.args, names, self.environ) if names else []
        for host, why in failed:
            _say(f"host {host} cannot be reached the way the MPI launcher reaches it ({why})")
        bad = [host for host, _ in failed]
        self.checked.update(host for host in names if host not in bad)
        return bad

    # --- a world -----------------------------------------------------------------------------
    def _launch(self, server: Server, index: int, placement: list[tuple[str, int]],
                workdir: str) -> World | None:
        bad = self._check(placement)
        if bad:   # blacklisted; the next wait names what is left (and times out if nothing)
            for host in bad:
                self.manager.blacklist(host)
            return None
        args = copy.copy(self.args)
        args.hosts = ",".join(f"{host}:{n}" for host, n in placement)
        args.hostfile = None
        args.np = sum(n for _, n in placement)
        args.skip_host_check = True
        args.min_np = args.max_np = args.host_discovery_script = None
        args.command = [sys.executable, "-m", "hvdlite.runner.elastic.shield", "--",
                        *self.args.command]
        env = dict(self.environ)
        env[wire.DRIVER_VARIABLE] = f"{self._advertised(placement, server)}:{server.port}"
        env[wire.KEY_VARIABLE] = server.key.hex()
        env[wire.WORLD_VARIABLE] = str(index)
        forward = self.forward + [wire.DRIVER_VARIABLE, wire.KEY_VARIABLE, wire.WORLD_VARIABLE]
        if self.warm_token is not None:
            env[warm_start.WARM_VARIABLE] = self.warm_token
            forward.append(warm_start.WARM_VARIABLE)
        world_dir = os.path.join(workdir, f"world{index}")
        os.makedirs(world_dir, exist_ok=True)
        argv, child_env = self.prepare(args, env, forward, world_dir)
        host_of = {}
        rank = 0
        for host, n in placement:
            for _ in range(n):
                host_of[rank] = host
                rank += 1
        _say(f"world {index}: {args.np} rank(s) on {args.hosts}")
        if self.on_world is not None:
            self.on_world(index, args.np)
        proc, pumps = self.start(argv, child_env, self.output)
        return World(index, list(placement), proc, pumps, time.monotonic(), host_of)

    @staticmethod
    def _advertised(placement: list[tuple[str, int]], server: Server) -> str:
        if server.bind == "127.0.0.1":
            return server.bind
        return addresses.listen_address([mpi_flavor.Host(h, n) for h, n in placement])[1]

    def _watch(self, server: Server, discoverer: _Discoverer, world: World) -> WorldEnd:
        last_discovery = 0.0
        while True:
            self._handle_events(server, world, timeout=0.1)
            if self.signals:
                return self._stop_world(world)
            if world.proc.poll() is not None:
                break
            now = time.monotonic()
            if now - last_discovery >= DISCOVER_SECONDS / 2:
                last_discovery = now
                world.updates |= self._refresh(discoverer)
                if world.failed_at is None and world.first_report_at is None:
                    self._maybe_notify(world)
            self._maybe_tear_down(world, now)
        # Workers the launcher left behind (see .shield) may still be reporting: wait for them.
        deadline = time.monotonic() + REPORT_GRACE
        while time.monotonic() < deadline and any(
                m.ended_at is None for m in world.members.values()):
            self._handle_events(server, world, timeout=0.05)
            if self.signals:
                break
        self._handle_events(server, world, timeout=0)
        for pump in world.pumps:
            pump.join(KILL_GRACE)
        return self._classify(world)

    def _handle_events(self, server: Server, world: World, timeout: float) -> None:
        try:
            event = server.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._handle(event, world)
            try:
                event = server.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, event: Event, world: World) -> None:
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
            if kind in ("reset", "error") and world.failed_at is None:
                world.failed_at = event.at
        elif event.kind == "ended" and member.outcome is None:
            world.lost.append(member.rank)
            if world.failed_at is None:
                world.failed_at = event.at

    def _maybe_notify(self, world: World) -> None:
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
            _say(f"world {world.index}: hosts changed (now {self.manager.describe()}); the "
                 f"workers stop at their next commit")

    def _maybe_tear_down(self, world: World, now: float) -> None:
        if world.terminated_at is not None:
            if now - world.terminated_at > KILL_GRACE:
                kill_group(world.proc.pid, signal.SIGKILL)
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
            world.terminated_at = now
            kill_group(world.proc.pid, signal.SIGTERM)

    def _classify(self, world: World) -> WorldEnd:
        status = exit_status(world.proc.returncode)
        outcomes = {rank: m.outcome for rank, m in world.members.items() if m.outcome}
        kinds = {o[0] for o in outcomes.values()}
        if "done" in kinds or (status == 0 and not world.lost and "error" not in kinds
                               and "reset" not in kinds and "interrupt" not in kinds):
            return WorldEnd("done", status, [], "training finished")
        missing = [r for r in range(world.size) if r not in world.members]
        errors = [r for r, o in outcomes.items() if o[0] == "error"]
        if len(missing) == world.size:
            return WorldEnd("failed", status, list(range(world.size)),
                            f"no worker of world {world.index} ({world.describe()}) reached "
                            f"hvd.init(); the launcher exited with status {status} (its output "
                            f"above says why)")
        # Who failed on their own: the workers that raised, and the first one lost (those lost
        # after it, on its host or elsewhere, went down with the world).  A world that lost
        # workers before they all reported in blames the ones that never did.
        if missing and (world.failed_at is None or not world.lost):
            culprits = missing
        else:
            culprits = sorted(set(errors) | set(world.lost[:1]))
        reason = self._reason(world, outcomes, culprits, missing)
        if len(culprits) == world.size:
            first = outcomes.get(errors[0], ("", ""))[1] if errors else ""
            return WorldEnd("failed", status, culprits,
                            f"every rank of world {world.index} failed ({reason})"
                            + (f"; rank {errors[0]}: {first}" if first else ""))
        return WorldEnd("reset", status, culprits, reason)

    @staticmethod
    def _reason(world: World, outcomes: dict, culprits: list[int], missing: list[int]) -> str:
        if world.lost:
            rank = world.lost[0]
            return (f"rank {rank} on {world.host_of.get(rank, '?')} exited without a word "
                    f"(killed, crashed, or its host lost)")
        errors = [(r, o[1]) for r, o in outcomes.items() if o[0] == "error"]
        if errors:
            return f"rank {errors[0][0]} raised {errors[0][1].splitlines()[-1][:300]}"
        resets = [(r, o[1]) for r, o in outcomes.items() if o[0] == "reset"]
        if resets:
            return f"rank {resets[0][0]}: {resets[0][1].splitlines()[-1][:300]}"
        if any(o[0] == "interrupt" for o in outcomes.values()):
            return "the hosts changed"
        if missing:
            return f"rank(s) {missing} never reached hvd.init()"
        return f"the launcher exited with status {exit_status(world.proc.returncode)}"

    def _stop_world(self, world: World) -> WorldEnd:
        kill_group(world.proc.pid, self.signals[0])
        deadline = time.monotonic() + KILL_GRACE + 2
        while world.proc.poll() is None:
            if time.monotonic() > deadline or len(self.signals) > 1:
                kill_group(world.proc.pid, signal.SIGKILL)
            time.sleep(0.1)
        for pump in world.pumps:
            pump.join(KILL_GRACE)
        return WorldEnd("stopped", 128 + self.signals[0], [], "stopped by a signal")

    # --- signals -----------------------------------------------------------------------------
    def _install_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def received(signum: int, _frame: object) -> None:
            self.signals.append(signum)

        return {sig: signal.signal(sig, received) for sig in (signal.SIGINT, signal.SIGTERM)}
