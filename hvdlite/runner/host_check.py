"""Before a job starts on other hosts: log in to each of them the way the MPI launcher will.

A launcher that cannot reach a host fails in its own words: MPICH's Hydra prints "Launch proxy
failed" after whatever ssh said (which may not name the host: "Permission denied (publickey)"),
and a host that does not answer holds it until ssh's own connect timeout, minutes later.  So
``hvdlite run`` first runs ``<the launcher's ssh, with its options> HOST <a quick command>`` for
every remote host, all at once, with a deadline, and stops with a message naming each host that
failed, what ssh said, and what to check (:func:`check`, :func:`describe`).

Which ssh the launcher will use (:func:`remote_shell`) follows the launcher's own rules: an
explicit choice in ``--mpi-args`` or the environment first; inside a batch allocation (Slurm, PBS,
LSF, SGE) the launchers use the batch system's own starter rather than ssh, and then nothing is
checked.  Hosts the launcher starts locally (this machine's names and addresses, as Hydra's
``MPL_host_is_local`` lists them) are not checked either.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

from .mpi_flavor import (INTEL_MPI, MPICH, OPEN_MPI, SSH_ARGS_VARIABLE, MpiFlavor, mca_value,
                         option_value)

DEFAULT_TIMEOUT = 30.0   # seconds for the whole check (horovodrun's --start-timeout default)
ATTEMPTS = 3             # per host: a name that resolves a moment late (a new pod) gets a retry
RETRY_PAUSE = 1.0
MAX_PARALLEL = 32
# Set inside a batch allocation, where the launchers start remote processes through the batch
# system (srun, the PBS TM interface, blaunch, qrsh) instead of ssh.
BATCH_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE", "COBALT_JOBID",
                   "LOADL_STEP_ID")
# Hydra's launcher and launcher-executable variables (the BOOTSTRAP spellings are older names).
_HYDRA_LAUNCHER = {MPICH: ("HYDRA_LAUNCHER", "HYDRA_BOOTSTRAP"),
                   INTEL_MPI: ("I_MPI_HYDRA_BOOTSTRAP",)}
_HYDRA_EXEC = {MPICH: ("HYDRA_LAUNCHER_EXEC", "HYDRA_BOOTSTRAP_EXEC"),
               INTEL_MPI: ("I_MPI_HYDRA_BOOTSTRAP_EXEC",)}


def _first(environ: Mapping[str, str], names: Sequence[str]) -> str | None:
    return next((environ[name] for name in names if environ.get(name)), None)


def _batch(environ: Mapping[str, str]) -> bool:
    return any(environ.get(name) for name in BATCH_VARIABLES)


def remote_shell(flavor: MpiFlavor, mpi_args: Sequence[str], environ: Mapping[str, str],
                 ssh_args: str | None) -> list[str] | None:
    """The command (program and options, without host and remote command) the launcher will
    start its daemons on other hosts with, or None when it will not use ssh or rsh there.

    ``ssh_args``: what hvdlite passes for ``-p``/``-i`` (:func:`mpi_flavor.ssh_arguments`); it
    makes the launcher use ssh unless ``mpi_args`` chooses otherwise."""
    if flavor.kind == OPEN_MPI:
        plm = (mca_value(mpi_args, "plm") or environ.get("OMPI_MCA_plm")
               or environ.get("PRTE_MCA_plm"))
        if (plm and plm != "rsh") or (not plm and ssh_args is None and _batch(environ)):
            return None
        agent = (mca_value(mpi_args, "plm_rsh_agent") or environ.get("OMPI_MCA_plm_rsh_agent")
                 or environ.get("PRTE_MCA_plm_rsh_agent") or "ssh")
        agent = agent.split(":")[0].strip() or "ssh"   # "ssh : rsh": the first that exists
        extra = mca_value(mpi_args, "plm_rsh_args")
        if extra is None:
            extra = ssh_args if ssh_args is not None else environ.get(
                SSH_ARGS_VARIABLE[OPEN_MPI], "")
        return shlex.split(agent) + extra.split()
    launcher = option_value(mpi_args, ("launcher", "bootstrap"))
    if launcher is None:
        launcher = "ssh" if ssh_args is not None else _first(environ, _HYDRA_LAUNCHER[flavor.kind])
    if launcher is None:
        launcher = None if _batch(environ) else "ssh"
    if launcher not in ("ssh", "rsh"):
        return None
    program = (option_value(mpi_args, ("launcher-exec", "bootstrap-exec"))
               or _first(environ, _HYDRA_EXEC[flavor.kind]) or launcher)
    extra = option_value(mpi_args, ("bootstrap-exec-args",)) if flavor.kind == INTEL_MPI else None
    if extra is None:
        extra = ssh_args if ssh_args is not None else environ.get(
            SSH_ARGS_VARIABLE[flavor.kind], "")
    return [program] + extra.split()


# --- which hosts are remote ----------------------------------------------------------------------
def _interface_addresses() -> set[str]:
    """The IPv4 address of each network interface (Linux; empty elsewhere)."""
    found: set[str] = set()
    try:
        import fcntl
        import struct
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):
        return found
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:   # an interface without an IPv4 address
                continue
            found.add(socket.inet_ntoa(packed[20:24]))
    return found


def _addresses(name: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except (OSError, UnicodeError):
        return set()


def local_names() -> set[str]:
    """Names and addresses the launchers start processes for without ssh: this host's name
    and its address, every interface's address, and the usual local names (the list Hydra's
    ``MPL_host_is_local`` compares host names with)."""
    here = socket.gethostname()
    return ({here, "localhost", "127.0.0.1", "127.0.1.1"} | _addresses(here)
            | _interface_addresses())


def remote_hosts(names: Sequence[str]) -> list[str]:
    """``names`` without duplicates and without this host: a name on the local list, or one
    that resolves to an address on it (more than Hydra counts as local: a host wrongly left
    out is only not checked, a host wrongly kept would be a false alarm)."""
    local = local_names()
    remote = []
    for name in dict.fromkeys(names):
        if name not in local and not (_addresses(name) & local):
            remote.append(name)
    return remote


# --- the check -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Unreachable:
    """A host the check could not log in to (or run the probe on)."""

    host: str
    status: int | None   # the login command's exit status; None: no answer by the deadline
    output: str          # what it printed (ssh's complaint), stripped


def _attempt(argv: Sequence[str], deadline: float) -> tuple[int | None, str]:
    # A session of its own: no terminal for ssh to ask a password or a host key question on
    # (it fails instead, as it would under the launcher), and the whole group can be killed.
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return 127, f"cannot run {argv[0]}: {exc.strerror}"
    try:
        out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        return proc.returncode, out.decode(errors="replace").strip()
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        out, _ = proc.communicate()
        return None, out.decode(errors="replace").strip()


def _check_one(shell: Sequence[str], host: str, probe: str,
               deadline: float) -> Unreachable | None:
    status, output = None, ""
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(RETRY_PAUSE)
        status, output = _attempt([*shell, host, probe], deadline)
        if status == 0:
            return None
        if status is None or time.monotonic() + RETRY_PAUSE >= deadline:
            break
    return Unreachable(host, status, output)


def check(hosts: Sequence[str], shell: Sequence[str], probe: str = "true",
          timeout: float = DEFAULT_TIMEOUT) -> list[Unreachable]:
    """Run ``shell HOST probe`` for every host at once (a failure is retried up to
    :data:`ATTEMPTS` times); the hosts where it did not succeed within ``timeout`` seconds,
    in the order given."""
    if not hosts:
        return []
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(hosts))) as pool:
        results = list(pool.map(lambda host: _check_one(shell, host, probe, deadline), hosts))
    return [result for result in results if result is not None]


def probe_command(flavor: MpiFlavor, launcher: str) -> tuple[str, str | None]:
    """The remote command of the check, and the file it tests for (None: a plain login).
    For MPICH: that Hydra's proxy exists at the path Hydra will start it from (the directory
    of ``mpiexec``), which catches a host without the same environment at the same path."""
    proxy = os.path.join(os.path.dirname(launcher), "hydra_pmi_proxy")
    if flavor.kind == MPICH and os.path.isfile(proxy):
        return f"test -x {shlex.quote(proxy)}", proxy
    return "true", None


def describe(problems: Sequence[Unreachable], total: int, shell: Sequence[str], probe: str,
             tested_file: str | None, timeout: float) -> str:
    """The error message for ``problems`` (out of ``total`` remote hosts)."""
    command = shlex.join([*shell, "HOST", probe])
    lines = [f"{len(problems)} of {total} remote host(s) cannot be reached the way the MPI "
             f"launcher reaches them ({command}):"]
    for problem in problems:
        if problem.status is None:
            why = f"no answer within {timeout:g} s"
        elif problem.status == 1 and tested_file:   # test -x said no
            why = (f"logged in, but {tested_file} is not there: install the same Python "
                   f"environment at the same path on every host")
        else:
            why = f"exit status {problem.status}"
        said = f": {problem.output.splitlines()[-1]}" if problem.output else ""
        lines.append(f"  {problem.host}: {why}{said}")
    lines.append(
        "Check first: that each name is spelled as in -H/--hostfile and resolves on this "
        "machine (getent hosts NAME); that sshd runs there on that port and takes this user's "
        "key without a password or a question (try the command above); the port "
        "(-p/--ssh-port) and the key (-i/--ssh-identity-file). --start-timeout S gives slow "
        "hosts longer; --skip-host-check starts the job without this check.")
    return "\n".join(lines)
