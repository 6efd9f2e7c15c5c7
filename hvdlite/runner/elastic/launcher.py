"""Elastic worlds as processes started over the MPI launcher (``hvdlite run --min-np``,
horovodrun's elastic flags): the :class:`~.provider.Provider` of :mod:`.driver` for them.

Each world is one ``mpiexec`` on the hosts the driver placed it on, every worker run through
:mod:`.shield` (its own session, so that the launcher's end does not take a worker that is
still handing in its commit) with the commit server's address in its environment, and, unless
``HVDLITE_ELASTIC_WARM_START=0``, the job's warm-start token (:mod:`.warm_process`).  Hosts not
checked before are logged in to first, as the launcher will reach them.
"""
from __future__ import annotations

import argparse
import copy
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from typing import Callable, Mapping, Optional, Sequence, TextIO

from hvdlite.common.core import elastic_wire as wire
from hvdlite.common.core import warm_start

from .. import addresses, mpi_flavor
from ..job_process import exit_status, kill_group
from ..launch_errors import LaunchError
from . import hosts as hostmod
from .driver import KILL_GRACE, Discoverer, ElasticDriver, driver_variable
from .options import ElasticSettings
from .provider import HostsUnreachable, WorldRecord
from .server import Server

REPORT_GRACE = 30.0       # after the launcher exits, how long its workers may still report


class ElasticError(LaunchError):
    """The elastic job cannot go on; the message says why."""


def say(message: str) -> None:
    """Tell the user (on stderr, as the launcher does) what the elastic driver does."""
    print(f"hvdlite: elastic: {message}", file=sys.stderr, flush=True)


class LauncherProvider:
    """Runs each world as one ``mpiexec`` (see the module docstring)."""

    host_word = "host"
    blacklists = True              # horovodrun's rule: a failing host is blacklisted
    retries_own_errors = True      # ... and the job goes on without it
    report_grace = REPORT_GRACE

    def __init__(self, args: argparse.Namespace, environ: dict[str, str],
                 forward: Sequence[str], output: Optional[tuple[TextIO, TextIO]],
                 on_world: Optional[Callable[[int, int], None]], prepare: Callable,
                 start: Callable, check: Callable, server: Server, workdir: str) -> None:
        self.args = args
        self.environ = environ
        self.forward = list(forward)
        self.output = output
        self.on_world = on_world
        self.prepare, self.start_launcher, self.check = prepare, start, check
        self.server = server
        self.workdir = workdir
        self.checked: set[str] = set()    # hosts that passed the ssh check
        # Names this job's warm processes (one per host; see warm_start), or None: cold starts.
        off = environ.get(warm_start.SWITCH_VARIABLE, "").strip().lower() in warm_start.OFF
        self.warm_token = None if off else secrets.token_hex(8)

    def host_name(self, host: str) -> str:
        return host

    def _check(self, placement: list[tuple[str, int]]) -> list[str]:
        """Log in to the placement's hosts not checked before, as the launcher will (the host
        check of ``hvdlite run``); the ones that cannot be reached."""
        if self.args.skip_host_check:
            return []
        names = [host for host, _ in placement if host not in self.checked]
        failed = self.check(self.args, names, self.environ) if names else []
        for host, why in failed:
            say(f"host {host} cannot be reached the way the MPI launcher reaches it ({why})")
        bad = [host for host, _ in failed]
        self.checked.update(host for host in names if host not in bad)
        return bad

    def start(self, world: WorldRecord, env: dict[str, str]) -> None:
        bad = self._check(world.placement)
        if bad:
            raise HostsUnreachable(bad)
        args = copy.copy(self.args)
        args.hosts = ",".join(f"{host}:{n}" for host, n in world.placement)
        args.hostfile = None
        args.np = world.size
        args.skip_host_check = True
        args.min_np = args.max_np = args.host_discovery_script = None
        args.command = [sys.executable, "-m", "hvdlite.runner.elastic.shield", "--",
                        *self.args.command]
        env = {**self.environ, **env,
               **driver_variable(self.server, self._advertised(world.placement))}
        forward = self.forward + [wire.DRIVER_VARIABLE, wire.KEY_VARIABLE, wire.WORLD_VARIABLE]
        if self.warm_token is not None:
            env[warm_start.WARM_VARIABLE] = self.warm_token
            forward.append(warm_start.WARM_VARIABLE)
        world_dir = os.path.join(self.workdir, f"world{world.index}")
        os.makedirs(world_dir, exist_ok=True)
        argv, child_env = self.prepare(args, env, forward, world_dir)
        say(f"world {world.index}: {args.np} rank(s) on {args.hosts}")
        if self.on_world is not None:
            self.on_world(world.index, args.np)
        world.handle = self.start_launcher(argv, child_env, self.output)

    def _advertised(self, placement: list[tuple[str, int]]) -> str:
        if self.server.bind == "127.0.0.1":
            return self.server.bind
        return addresses.listen_address([mpi_flavor.Host(h, n) for h, n in placement])[1]

    def poll(self, world: WorldRecord, timeout: float) -> bool:
        proc: subprocess.Popen = world.handle[0]
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        world.status = exit_status(proc.returncode)
        if world.status == 0:   # every rank returned (what it reported decides the rest)
            world.results = dict.fromkeys(range(world.size))
        return True

    def settle(self, world: WorldRecord) -> None:
        for pump in world.handle[1]:   # its output before the driver's word on how it ended
            pump.join(KILL_GRACE)

    def stop(self, world: WorldRecord, hard: bool, signum: Optional[int] = None) -> None:
        proc: subprocess.Popen = world.handle[0]
        if proc.poll() is None:
            kill_group(proc.pid, signal.SIGKILL if hard else (signum or signal.SIGTERM))

    def finish(self, world: WorldRecord, failed: bool) -> None:
        if world.handle is None:
            return
        proc = world.handle[0]
        if proc.poll() is None:   # the job ends with an exception: its world goes too
            kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
            self.settle(world)

    def error(self, world: WorldRecord, rank: int) -> BaseException:
        return ElasticError(f"rank {rank} raised {world.raised.get(rank)}")

    def result(self, world: WorldRecord) -> int:
        return world.status


def run_job(args: argparse.Namespace, settings: ElasticSettings, environ: dict[str, str],
            forward: Sequence[str], output: Optional[tuple[TextIO, TextIO]],
            on_world: Optional[Callable[[int, int], None]], prepare: Callable,
            start: Callable, check: Callable) -> int:
    """Run the elastic job ``args`` asks for; its exit status (see :func:`..run`)."""
    try:
        discoverer = Discoverer(settings.discovery, say)
    except hostmod.DiscoveryError as exc:
        raise ElasticError(f"host discovery failed at its first run: {exc}") from None
    server = Server("127.0.0.1" if all_local(discoverer.latest) else "0.0.0.0")
    try:
        with tempfile.TemporaryDirectory(prefix="hvdlite-elastic-") as workdir:
            provider = LauncherProvider(args, environ, forward, output, on_world, prepare,
                                        start, check, server, workdir)
            driver = ElasticDriver(provider, settings, say, ElasticError,
                                   timeout_error(settings), catch_signals=True)
            return driver.run(server, discoverer)
    finally:
        discoverer.stop()
        server.close()


def timeout_error(settings: ElasticSettings) -> Callable[[int, int, str], ElasticError]:
    """The driver's ``timeout_error`` in the words of ``hvdlite run``'s flags."""
    def error(need: int, have: int, hosts_text: str) -> ElasticError:
        return ElasticError(f"waited {settings.elastic_timeout:g} s (--elastic-timeout) for "
                            f"{need} slots (-np/--min-np), but only {have} are available from "
                            f"{settings.discovery.describe()}: {hosts_text}")
    return error


def all_local(discovered: Mapping[str, int]) -> bool:
    """Whether every host discovered is this machine (the server then listens on loopback)."""
    return all(addresses.is_local(host) for host in discovered)


__all__ = ["ElasticError", "LauncherProvider", "run_job", "say", "timeout_error"]
