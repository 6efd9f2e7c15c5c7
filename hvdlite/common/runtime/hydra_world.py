"""One MPI world formed from processes that another system started (Ray workers, the processes
of torchrun or a Kubeflow PyTorchJob): the side that runs ``mpiexec``.

MPICH's launcher (Hydra) can start a job whose per-host proxies someone else runs:
``mpiexec -launcher manual -pmi-port -hosts A:2,B:1 -n 3 <program>`` prints one proxy command
per host (``HYDRA_LAUNCH: .../hydra_pmi_proxy --control-port ... --proxy-id i``) and waits for
them to connect.  Each proxy then starts ``<program>`` once per rank of its host, with the PMI
environment of that rank (``PMI_PORT``, ``PMI_ID``, ...); any process on that host that
initialises MPI with that environment *is* that rank.

So the program is a placeholder (:data:`PLACEHOLDER_SCRIPT`): it prints its PMI environment
(which the proxy forwards to ``mpiexec``'s standard output, read here) and waits until the job
releases it (or its proxy is gone).  The process of world rank ``r`` runs the proxy of its
host if it is the host's first one (:func:`hvdlite.common.runtime.hydra_member.start_proxy`),
then receives rank ``r``'s environment and joins the world
(:func:`hvdlite.common.runtime.hydra_member.join_world`).

Every wait here is bounded and raises :class:`WorldError` saying what did not happen.  At the
end, the members release their hosts' placeholders (``hydra_member.stop_proxy``), so
every rank, proxy and ``mpiexec`` exit by themselves; ``close()`` then kills whatever did not.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from hvdlite.common.runtime.hydra_member import die_with_parent

# The variables Hydra gives each rank with -pmi-port; a rank's MPI_Init needs exactly these.
PMI_VARIABLES = ("PMI_PORT", "PMI_ID", "PMI_HOSTNAME", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
MARKER = "HVDLITE_PMI"
# The placeholder: a shell (present on every node, whatever Python the node has) that prints
# its rank's PMI environment on one line, then waits until the job's release file ($0) exists
# on its host (the clean end: every rank exits 0, so do the proxies and mpiexec) or its proxy
# ($PPID) is gone (so that it never outlives the job, however the proxy ended).
PLACEHOLDER_SCRIPT = ("echo \"" + MARKER + "".join(f" {v}=${v}" for v in PMI_VARIABLES)
                      + "\"; while kill -0 $PPID 2>/dev/null && [ ! -e \"$0\" ]; "
                      "do sleep 0.3; done")
TERMINATE_GRACE_S = 3.0
RELEASED_EXIT_WAIT_S = 1.0   # mpiexec's own exit once its ranks have ended


class WorldError(RuntimeError):
    """Forming or ending a manually launched MPI world failed (the message says which step)."""


def mpiexec_path() -> str:
    """The MPICH ``mpiexec`` next to this Python (the MPICH wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
    if not found:
        raise WorldError("no mpiexec found: forming this world needs MPICH's mpiexec (Hydra) "
                         "next to Python; pip install mpich (or hvdlite, which depends on it).")
    return found


def host_segments(nodes: Sequence[str]) -> list[tuple[str, int]]:
    """The hosts of the world, in rank order, from the node of each world rank: ``[(node,
    count)]``.  The ranks of one node must be consecutive (Ray Train and RayExecutor number them
    so): Hydra gives each host one block of ranks.  Pure logic, unit-tested."""
    segments: list[tuple[str, int]] = []
    for node in nodes:
        if segments and segments[-1][0] == node:
            segments[-1] = (node, segments[-1][1] + 1)
        elif any(node == seen for seen, _ in segments):
            raise WorldError(f"the workers of node {node} do not have consecutive world ranks "
                             f"(nodes in rank order: {list(nodes)}); MPI gives each host one "
                             f"block of ranks.")
        else:
            segments.append((node, 1))
    return segments


def parse_pmi_line(line: str) -> Optional[dict[str, str]]:
    """A placeholder's line as its environment, or None for any other line.  Pure logic."""
    if not line.startswith(MARKER + " "):
        return None
    env = dict(item.partition("=")[::2] for item in line.split()[1:])
    if set(env) != set(PMI_VARIABLES) or not env["PMI_ID"].isdigit():
        raise WorldError(f"unexpected placeholder line from mpiexec: {line!r}")
    return env


class MpiWorld:
    """``mpiexec -launcher manual`` for ranks on ``nodes`` (the node of each world rank, in rank
    order; any labels that are equal for the ranks of one node).  ``control_host``: the name or
    address under which the proxies reach this host (the one that runs ``mpiexec``);
    ``extra_args``: more ``mpiexec`` options (the user's, e.g. ``-genv NAME value``)."""

    def __init__(self, nodes: Sequence[str], control_host: str, timeout_s: float,
                 extra_args: Sequence[str] = ()) -> None:
        self.size = len(nodes)
        # The file whose creation on a host releases that host's placeholders (see
        # hydra_member.stop_proxy); unique to this world.
        self.release_path = f"/tmp/hvdlite-world-{secrets.token_hex(8)}.release"
        self.segments = host_segments(nodes)
        self.timeout_s = timeout_s
        hosts = ",".join(f"{node}:{count}" for node, count in self.segments)
        self.argv = [mpiexec_path(), "-launcher", "manual", "-pmi-port", "-localhost",
                     control_host, "-hosts", hosts, *extra_args, "-n", str(self.size),
                     "sh", "-c", PLACEHOLDER_SCRIPT, self.release_path]
        self._proc: Optional[subprocess.Popen] = None
        self._cond = threading.Condition()
        self._proxies: list[list[str]] = []
        self._launch_done = False
        self._envs: dict[int, dict[str, str]] = {}
        self._output: list[str] = []   # other lines (mpiexec's messages), for error reports
        self._reader: Optional[threading.Thread] = None

    # -- starting ---------------------------------------------------------------------------
    def start(self, tied: bool = False) -> list[list[str]]:
        """Start ``mpiexec``; return the proxy command of each host segment, in order.
        ``tied``: ``mpiexec`` is killed when this process ends, however it ends (when this
        process is itself a rank, whose death must not leave the launcher behind)."""
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1,
                                      start_new_session=True,
                                      preexec_fn=die_with_parent if tied else None)
        self._reader = threading.Thread(target=self._read, name="hvdlite-mpiexec",
                                        daemon=True)
        self._reader.start()
        self._wait(lambda: self._launch_done, "print its proxy commands")
        if len(self._proxies) != len(self.segments):
            raise WorldError(f"mpiexec printed {len(self._proxies)} proxy commands for "
                             f"{len(self.segments)} hosts: {self._proxies}")
        return [list(p) for p in self._proxies]

    def environments(self) -> list[dict[str, str]]:
        """Each rank's PMI environment, in rank order, once every proxy runs (bounded wait)."""
        self._wait(lambda: len(self._envs) == self.size,
                   "start every rank's placeholder (is every host's proxy running?)")
        return [self._envs[rank] for rank in range(self.size)]

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            line = line.rstrip("\n")
            with self._cond:
                try:
                    env = parse_pmi_line(line)
                except WorldError:
                    env = None
                if env is not None:
                    self._envs[int(env["PMI_ID"])] = env
                elif line.startswith("HYDRA_LAUNCH: "):
                    self._proxies.append(line[len("HYDRA_LAUNCH: "):].split())
                elif line.startswith("HYDRA_LAUNCH_END"):
                    self._launch_done = True
                elif line.strip():
                    self._output.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not done():
                if self._proc is not None and self._proc.poll() is not None and \
                        not (self._reader and self._reader.is_alive()):
                    raise WorldError(f"mpiexec exited (status {self._proc.returncode}) before "
                                     f"it could {what}; its output: {self.output()!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorldError(f"mpiexec did not {what} within {self.timeout_s:g} s "
                                     f"(ranks ready: {sorted(self._envs)} of {self.size}); its "
                                     f"output: {self.output()!r}")
                self._cond.wait(min(left, 0.5))

    def output(self) -> str:
        """What ``mpiexec`` printed besides proxy commands and placeholder lines."""
        return "\n".join(self._output[-20:])

    # -- ending -----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> Optional[int]:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        """End ``mpiexec`` and, through it, the proxies and placeholders.  After the
        placeholders were released (``member.stop_proxy``) it exits by itself; otherwise, or if
        it does not within :data:`TERMINATE_GRACE_S`: SIGTERM, then SIGKILL.  Safe to call more
        than once."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.wait(RELEASED_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(TERMINATE_GRACE_S)
                    break
                except subprocess.TimeoutExpired:
                    continue
        proc.wait(TERMINATE_GRACE_S)
        if self._reader is not None:
            self._reader.join(TERMINATE_GRACE_S)
        if proc.stdout is not None:
            proc.stdout.close()
