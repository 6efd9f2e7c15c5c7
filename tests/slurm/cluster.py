"""A real one-node SLURM cluster for tests (issue 48): munge, ``slurmctld`` and ``slurmd`` from
Debian's packages (``slurm-wlm``, ``munge``), with a configuration of its own in a temporary
directory (its own ports, state and spool; the node is this machine, with more CPUs than it
has so that 3 tasks and their MPI proxies fit), started and stopped by the test session.
Nothing outside the directory is changed, except that munge's daemon is started when none
runs (and stopped again at the end)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged")
START_SECONDS = 45.0


class ClusterUnavailable(RuntimeError):
    """SLURM cannot run here (the message says why)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing() -> str | None:
    """Why SLURM cannot run here, or None."""
    if os.geteuid() != 0:
        return "slurmd must run as root"
    absent = [p for p in ("slurmctld", "slurmd", "srun", "sbatch", "salloc", "sinfo", "munged",
                          "munge") if shutil.which(p) is None and
              not Path(f"/usr/sbin/{p}").exists()]
    if absent:
        return (f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge; .ci/run "
                f"does)")
    return None


def _which(program: str) -> str:
    return shutil.which(program) or f"/usr/sbin/{program}"


class Cluster:
    """The running cluster; ``env`` is what a test adds to reach it (``SLURM_CONF``)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hvdlite-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.node = socket.gethostname()
        self.env = {"SLURM_CONF": str(self.conf)}
        self._started_munged = False

    def _run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env}, stdin=subprocess.DEVNULL)

    def start(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        r = self.root
        self.conf.write_text(f"""ClusterName=hvdlitetest
SlurmctldHost={self.node}
SlurmUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
NodeName={self.node} CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
        if self._run("munge", "-n").returncode != 0:   # no munge daemon answers: start one
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            key = Path("/etc/munge/munge.key")
            if not key.exists():
                self._run("mungekey", "-c")
                shutil.chown(key, "munge", "munge")
            started = self._run("runuser", "-u", "munge", "--", _which("munged"), "--force")
            if started.returncode != 0:
                raise ClusterUnavailable(f"munged did not start: {started.stderr.strip()}")
            self._started_munged = True
        for daemon in ("slurmctld", "slurmd"):
            done = self._run(_which(daemon), "-f", str(self.conf))
            if done.returncode != 0:
                raise ClusterUnavailable(f"{daemon} did not start: {done.stderr.strip()} "
                                         f"{self.log(daemon)}")
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            state = self._run("sinfo", "-h", "-o", "%t").stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise ClusterUnavailable(f"the node is not idle after {START_SECONDS:g} s (state "
                                 f"{state!r}); {self.log('slurmctld')} {self.log('slurmd')}")

    def log(self, daemon: str) -> str:
        path = self.root / "log" / f"{daemon}.log"
        return path.read_text()[-1500:] if path.exists() else ""

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons (and munged if started here); what is left."""
        problems = []
        self._run("scancel", "--full", "--user", "root")
        for daemon in ("slurmd", "slurmctld"):
            pidfile = self.root / f"{daemon}.pid"
            if pidfile.exists():
                _stop(int(pidfile.read_text().strip() or 0), daemon, problems)
        if self._started_munged:
            found = subprocess.run(["pgrep", "-x", "munged"], capture_output=True, text=True)
            for pid in found.stdout.split():
                _stop(int(pid), "munged", problems)
        shutil.rmtree(self.root, ignore_errors=True)
        return problems


def _stop(pid: int, name: str, problems: list[str]) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
    problems.append(f"{name} (pid {pid}) did not stop")
