"""Several simulated hosts on one Linux machine, for tests of jobs that span hosts.

Each host is a long-lived process started by ``unshare --uts --ipc --pid --mount --fork
--mount-proc`` (see host_init.py): it has its own host name, PID numbers, System V IPC, a private
``/dev/shm`` and ``/tmp``, and an ``/etc/hosts`` of the bed's that maps every host name to its
own loopback address (``127.0.2.x``; never 127.0.1.1, which MPICH takes for this machine), bound
over the real one in that host's mount namespace only.  All hosts share the machine's network
namespace and the rest of its file system (like a cluster's shared home), so ranks reach each
other over TCP on loopback, and node-local shortcuts (shared memory, cross-memory attach) work
only between processes of one host, as on real machines.

Jobs are launched from a "head": the launch command runs in a mount namespace of its own with
the bed's hosts file over ``/etc/hosts`` (so the launcher resolves the host names, as a
cluster's login node does), with ``HYDRA_LAUNCHER=ssh`` and ``HYDRA_LAUNCHER_EXEC`` pointing at
the ssh stand-in (ssh_standin.py), which runs each remote command inside its host's namespaces
with ``nsenter``.  MPICH's default UCX netmod refuses loopback between different host names, so
jobs use libfabric's TCP provider on ``lo`` (:data:`JOB_ENV`).

Nothing here touches the real ``/etc/hosts`` or mount table: every mount happens inside the
hosts' (or a launch's) private mount namespaces, and :meth:`HostBed.close` checks that.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from tests.mpi_harness import (REPO, JobResult, check_job, mpiexec_path, run_command,
                               worker_argv)
from tests.multihost import procs

HERE = Path(__file__).resolve().parent
ADDRESS_PREFIX = "127.0.2."
# What every job across the hosts needs: UCX (MPICH's default) refuses loopback between
# different host names; libfabric's TCP provider on lo works.
JOB_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}
START_TIMEOUT = 30.0    # seconds for one host to come up
SETTLE_SECONDS = 10.0   # after a job, how long its processes on the hosts may take to go

Layout = Sequence[tuple[str, int]]   # (host name, slots), in rank order


class BedUnavailable(RuntimeError):
    """Simulated hosts cannot be made on this machine; the message says why."""


def unavailable_reason() -> str | None:
    """Why this machine cannot simulate hosts (None when it should be able to)."""
    if not sys.platform.startswith("linux"):
        return "simulated hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (unshare, nsenter and mount)"
    for tool in ("unshare", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool} (util-linux), which is not installed"
    return None


def host_list(layout: Layout) -> str:
    """The layout as Hydra's ``-hosts`` / ``hvdlite run -H`` list: ``a:2,b:2``."""
    return ",".join(f"{name}:{slots}" for name, slots in layout)


def placement(layout: Layout) -> list[str]:
    """The host of each rank: the launchers fill each host's slots in order."""
    return [name for name, slots in layout for _ in range(slots)]


@dataclasses.dataclass
class Host:
    name: str
    address: str
    pid: int       # the host's first process, numbered as the real PID namespace numbers it
    pid_ns: str    # its PID namespace, as /proc/PID/ns/pid reads ("pid:[4026532180]")
    unshare: subprocess.Popen


@dataclasses.dataclass
class MultiHostJob(JobResult):
    # host -> command lines of the job's processes still running on it SETTLE_SECONDS after
    # the launch command ended by itself; they were killed
    leftovers: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # for a job that timed out: host -> command lines running on it when it was killed
    running_at_timeout: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def output(self) -> str:
        extra = ""
        if self.running_at_timeout:
            extra += f"\n--- running on the hosts at the timeout ---\n{self.running_at_timeout}"
        if self.leftovers:
            extra += f"\n--- left running on the hosts ---\n{self.leftovers}"
        return super().output + extra


class HostBed:
    """Named simulated hosts, the ssh stand-in, and launches of jobs across them.

    Use as a context manager, or call :meth:`start` and :meth:`close`.  ``ssh_port``: the only
    port the hosts take logins on (a launcher given another gets "Connection refused").
    """

    def __init__(self, names: Sequence[str], ssh_port: int = 22) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and at least one: {names}")
        self.names = list(names)
        self.ssh_port = ssh_port
        self.hosts: dict[str, Host] = {}
        self.root = Path()
        self._etc_hosts = b""
        self._mounts: list[str] = []

    # --- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> "HostBed":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Create the hosts; BedUnavailable (after cleaning up) when this machine cannot."""
        reason = unavailable_reason()
        if reason:
            raise BedUnavailable(reason)
        here = socket.gethostname()
        if here in self.names:
            raise BedUnavailable(f"this machine is called {here}, like a simulated host")
        with open("/etc/hosts", "rb") as f:
            self._etc_hosts = f.read()
        self._mounts = procs.mounts()
        self.root = Path(tempfile.mkdtemp(prefix="hvdlite-hosts-"))
        try:
            self._write_files(here)
            keep = self._keep_paths()
            for index, name in enumerate(self.names, start=1):
                self.hosts[name] = self._start_host(name, f"{ADDRESS_PREFIX}{index}", keep)
        except BaseException:
            self.close()
            raise

    def _write_files(self, here: str) -> None:
        (self.root / "hosts").mkdir()
        (self.root / "jobs").mkdir()
        lines = ["127.0.0.1\tlocalhost"]
        if here != "localhost":   # the launcher's host: the proxies connect back to it by name
            lines.append(f"127.0.0.1\t{here}")
        lines += [f"{ADDRESS_PREFIX}{i}\t{name}" for i, name in enumerate(self.names, start=1)]
        lines.append("::1\tlocalhost ip6-localhost ip6-loopback")
        (self.root / "etc-hosts").write_text("\n".join(lines) + "\n")
        (self.root / "ssh_port").write_text(f"{self.ssh_port}\n")
        standin = self.root / "ssh"
        standin.write_text("#!/bin/sh\nexec " + shlex.join(
            [sys.executable, str(HERE / "ssh_standin.py"), str(self.root)]) + ' "$@"\n')
        standin.chmod(0o755)

    def _keep_paths(self) -> list[str]:
        """Directories under /tmp that every host must still see: the bed's own, and the
        checkout and Python when they live there (a host's /tmp is a fresh tmpfs)."""
        candidates = {self.root, REPO, Path(sys.prefix), Path(sys.base_prefix),
                      Path(sys.executable).parent}
        keep = set()
        for path in candidates:
            real = Path(os.path.realpath(path))
            if real.is_relative_to("/dev/shm"):
                raise BedUnavailable(f"{real} lies in /dev/shm, which each host replaces")
            if real.is_relative_to("/tmp") and real != Path("/tmp"):
                keep.add(str(real))
        return sorted(keep, key=len)   # outer directories first

    def _start_host(self, name: str, address: str, keep: list[str]) -> Host:
        log = open(self.root / "hosts" / f"{name}.log", "wb")
        with log:
            proc = subprocess.Popen(
                ["unshare", "--uts", "--ipc", "--pid", "--mount", "--fork", "--mount-proc",
                 "--propagation", "private", "--kill-child=SIGKILL",
                 sys.executable, "-I", "-S", str(HERE / "host_init.py"), name,
                 str(self.root / "etc-hosts"), *keep],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True, preexec_fn=procs.kill_with_parent)
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        inits = procs.descendants(proc.pid) if line.strip() == b"ready" else []
        if not inits:
            procs.kill([proc.pid])
            proc.wait()
            why = (self.root / "hosts" / f"{name}.log").read_text().strip()
            raise BedUnavailable(f"cannot create simulated host {name} with unshare: "
                                 f"{why or 'no answer in time'}")
        pid = inits[0]
        (self.root / "hosts" / name).write_text(str(pid))
        return Host(name, address, pid, procs.pid_ns(pid) or "", proc)

    def close(self) -> list[str]:
        """Tear every host down and check that nothing is left: no process in a host, the
        real /etc/hosts and mount table as they were.  Returns the problems found (empty when
        clean); the bed's directory is removed."""
        problems = []
        for host in self.hosts.values():
            # Killing its first process makes the kernel kill the whole host; unshare, its
            # parent, reaps it and exits (killing unshare first would leave the host's first
            # process a zombie of whichever process adopts it, keeping the namespace alive).
            procs.kill([host.pid])
            try:
                host.unshare.wait(SETTLE_SECONDS)
            except subprocess.TimeoutExpired:
                procs.kill([host.unshare.pid])
                host.unshare.wait()
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:   # zombies count: while one is left, its PID namespace lives on
            alive = {h.name: [pid for pid in procs.pids() if procs.pid_ns(pid) == h.pid_ns]
                     for h in self.hosts.values()}
            alive = {name: pids for name, pids in alive.items() if pids}
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if alive:
            problems.append(f"processes (or zombies) left in torn-down hosts: {alive}")
        self.hosts.clear()
        if self._etc_hosts:
            with open("/etc/hosts", "rb") as f:
                if f.read() != self._etc_hosts:
                    problems.append("the real /etc/hosts changed")
            added = sorted(set(procs.mounts()) - set(self._mounts))
            if added:
                problems.append(f"mounts appeared in the real mount namespace: {added}")
        if self.root != Path():
            shutil.rmtree(self.root, ignore_errors=True)
        return problems

    # --- processes on the hosts ------------------------------------------------------------
    def _inside(self, host: Host) -> list[int]:
        """Every live process of ``host`` but its first (pids as the real namespace numbers
        them, so ``nsenter`` itself, which stays outside, is not among them)."""
        return [pid for pid in procs.pids() if pid != host.pid
                and procs.pid_ns(pid) == host.pid_ns and not procs.zombie(pid)]

    def running(self) -> dict[str, list[str]]:
        """Command lines of the processes on each host (hosts with none left out)."""
        found = {name: [procs.cmdline(pid) for pid in self._inside(host)]
                 for name, host in self.hosts.items()}
        return {name: cmds for name, cmds in found.items() if cmds}

    def settle(self, wait: float = SETTLE_SECONDS) -> dict[str, list[str]]:
        """Wait up to ``wait`` seconds for the hosts to be empty; kill what is still running
        then, wait for it to be gone, and return it (host -> command lines)."""
        deadline = time.monotonic() + wait
        while True:
            left = self.running()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if left:
            self.clear()
        return left

    def kill_host(self, name: str) -> None:
        """Kill every process on host ``name`` (as when the machine goes), and wait until they
        are gone; the host itself stays, empty."""
        self._kill_until_gone([self.hosts[name]])

    def clear(self) -> None:
        """Kill every process on every host and wait until they are gone."""
        self._kill_until_gone(list(self.hosts.values()))

    def _kill_until_gone(self, hosts: list[Host]) -> None:
        # A killed process runs on for a moment, and one may have been starting while the
        # others were killed: kill again until none is left.
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            pids = [pid for host in hosts for pid in self._inside(host)]
            if not pids:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes on the simulated hosts survive SIGKILL: "
                                   f"{self.running()}")
            procs.kill(pids)
            time.sleep(0.05)

    def kill_everything(self, launch_pid: int | None = None) -> None:
        """Kill a launch (``launch_pid`` and every process below it, even in other sessions)
        and every process on every host."""
        if launch_pid is not None:
            procs.kill([launch_pid] + procs.descendants(launch_pid))
        self.clear()

    # --- launching -------------------------------------------------------------------------
    @property
    def standin(self) -> str:
        """Path of the ssh stand-in (a script called like ssh)."""
        return str(self.root / "ssh")

    def launcher_env(self) -> dict[str, str]:
        """The environment a launch needs: Hydra's ssh launcher through the stand-in, and
        :data:`JOB_ENV` for the ranks (Hydra forwards the launcher's environment)."""
        return {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": self.standin, **JOB_ENV}

    def head_command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run from the head: in a private mount namespace where the bed's hosts file
        is /etc/hosts (``unshare`` execs it in place: same process, same process group)."""
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(self.root / "etc-hosts"),
                *argv]

    def run(self, cmd: Sequence[str], np: int, timeout: float = 120, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> MultiHostJob:
        """Run the launch command ``cmd`` of an ``np``-rank job from the head and collect the
        ranks' reports (as :func:`tests.mpi_harness.run_command`; the report directory lies in
        the bed's directory, which every host sees).  On timeout everything the launch
        started, on the head and on every host, is killed (what ran on the hosts then is in
        ``running_at_timeout``); after a job that ended by itself, whatever it left running on
        the hosts is killed and listed in ``leftovers``."""
        at_timeout: dict[str, list[str]] = {}

        def on_timeout(pid: int) -> None:
            at_timeout.update(self.running())
            self.kill_everything(pid)

        job = run_command(self.head_command(cmd), np, timeout=timeout,
                          env={**self.launcher_env(), **(env or {})}, cwd=cwd,
                          out_parent=str(self.root / "jobs"), on_timeout=on_timeout)
        if job.timed_out:   # (a process that was starting during the kill is caught here)
            time.sleep(0.5)
            self.clear()
            leftovers = {}
        else:
            leftovers = self.settle(SETTLE_SECONDS)
        return MultiHostJob(**dataclasses.asdict(job), leftovers=leftovers,
                            running_at_timeout=at_timeout)

    def hostfile(self, layout: Layout, name: str = "hostfile") -> str:
        """Write ``layout`` as a ``host:slots`` hostfile in the bed's directory; its path."""
        path = self.root / "jobs" / name
        path.write_text("".join(f"{host}:{slots}\n" for host, slots in layout))
        return str(path)

    def mpiexec(self, layout: Layout, argv: list[str], timeout: float = 120,
                env: dict | None = None, hostfile: bool = False,
                mpiexec_args: Sequence[str] = ()) -> MultiHostJob:
        """``mpiexec -n <slots> -hosts a:2,b:2 <argv>`` (or ``-f HOSTFILE``) across the hosts;
        ``argv[0]`` may name a worker script by its path under tests/ (as for ``run_job``)."""
        np = sum(slots for _, slots in layout)
        where = ["-f", self.hostfile(layout)] if hostfile else ["-hosts", host_list(layout)]
        cmd = [mpiexec_path(), "-n", str(np), *where, *mpiexec_args] + worker_argv(argv)
        return self.run(cmd, np, timeout=timeout, env=env)

    @contextlib.contextmanager
    def refusing(self, host: str, message: str) -> Iterator[None]:
        """While inside: ``host`` refuses every login through the stand-in with ``message`` on
        stderr and exit status 255 (as ssh fails when sshd rejects the key)."""
        path = self.root / "refuse" / host
        path.parent.mkdir(exist_ok=True)
        path.write_text(message + "\n")
        try:
            yield
        finally:
            path.unlink()

    def shell(self, host: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a shell command on ``host`` as ``ssh host command`` would (through the
        stand-in)."""
        return subprocess.run([self.standin, host, command], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)


def check_host_job(job: MultiHostJob, np: int, expect_success: bool = True) -> None:
    """:func:`tests.mpi_harness.check_job`, and nothing of the job left running on a host."""
    check_job(job, np, expect_success)
    assert not job.leftovers, f"the job left processes running on the hosts\n{job.output}"
