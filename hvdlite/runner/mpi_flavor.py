"""Find the installed MPI launcher, tell which MPI it belongs to, and build its command line.

Three launcher families are supported:

* MPICH (Hydra process manager; ``mpiexec --version`` prints "HYDRA build details"),
* Intel MPI (also Hydra-based; prints "Intel(R) MPI Library"),
* Open MPI (prints "(Open MPI) X.Y.Z", or "(OpenRTE) X.Y.Z" before version 5).

Everything here except :func:`find_launcher` and :func:`launcher_version_text` is pure, so the
command construction can be unit-tested with fake ``--version`` text.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

MPICH = "mpich"
INTEL_MPI = "intel"
OPEN_MPI = "openmpi"

FLAVOR_NAMES = {MPICH: "MPICH", INTEL_MPI: "Intel MPI", OPEN_MPI: "Open MPI"}

# Open MPI does not forward the launcher's environment to remote hosts; these are passed along
# with ``-x`` (when set) so remote ranks find the same Python and packages.
OPEN_MPI_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")

# Where each launcher reads extra arguments for the ssh it starts remote daemons with: MPICH's
# Hydra splits HYDRA_LAUNCHER_EXTRA_ARGS on spaces and puts the words between ``ssh -x`` and the
# host name (src/pm/hydra/lib/tools/bootstrap/external/external_common_launch.c); Intel MPI's
# counterpart of its -bootstrap-exec-args option; Open MPI's plm_rsh_args MCA parameter.
SSH_ARGS_VARIABLE = {MPICH: "HYDRA_LAUNCHER_EXTRA_ARGS",
                     INTEL_MPI: "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS",
                     OPEN_MPI: "OMPI_MCA_plm_rsh_args"}


class HostfileError(ValueError):
    """A ``-H`` list or hostfile that cannot be parsed."""


@dataclasses.dataclass(frozen=True)
class MpiFlavor:
    """Which MPI a launcher belongs to, and its version when it could be read."""

    kind: str                        # MPICH, INTEL_MPI or OPEN_MPI
    version: tuple[int, ...] | None = None

    @property
    def description(self) -> str:
        """Human-readable name with the version, e.g. ``MPICH 4.2.1 (Hydra)``."""
        name = FLAVOR_NAMES[self.kind]
        if self.version:
            name += " " + ".".join(str(part) for part in self.version)
        return name if self.kind == OPEN_MPI else name + " (Hydra)"


@dataclasses.dataclass(frozen=True)
class Host:
    """One host and the number of processes (slots) it takes."""

    name: str
    slots: int = 1


@dataclasses.dataclass
class JobSpec:
    """What to launch, independent of the MPI flavour.

    ``hosts`` and ``hostfile`` are mutually exclusive; ``hostfile`` must already be in the
    flavour's own format (see :func:`render_hostfile`).  ``env`` holds the variables every rank
    must see (they are named on the command line; the values are also set in the launcher's
    environment by :func:`child_environment`).
    """

    np: int
    command: list[str]
    hosts: list[Host] | None = None
    hostfile: str | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    mpi_args: list[str] = dataclasses.field(default_factory=list)
    nics: list[str] = dataclasses.field(default_factory=list)   # interfaces for MPI's TCP
    # every argument the launcher's ssh must get (``-p``/``-i`` and what the environment
    # already asked for; see :func:`ssh_arguments`), or None to leave ssh alone
    ssh_args: str | None = None


# --- finding and identifying the launcher --------------------------------------------------------
def find_launcher(executable: str | None = None, path: str | None = None) -> str | None:
    """Path of the MPI launcher to use, or None when there is none.

    The ``mpiexec`` next to ``executable`` (default: this Python, i.e. the virtual environment's,
    where the ``mpich`` wheel puts it) wins; otherwise ``mpiexec`` then ``mpirun`` on ``path``
    (default: ``$PATH``).
    """
    bin_dir = Path(executable or sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        candidate = bin_dir / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def launcher_version_text(launcher: str, timeout: float = 20.0) -> str:
    """The combined stdout and stderr of ``launcher --version``."""
    proc = subprocess.run([launcher, "--version"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)
    return proc.stdout


def _first_version(text: str, pattern: str) -> tuple[int, ...] | None:
    match = re.search(pattern, text)
    if not match:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def detect_flavor(version_text: str) -> MpiFlavor | None:
    """Identify the MPI from ``mpiexec --version`` (or ``MPI_Get_library_version``) text.

    Returns None for text that matches none of the supported families.  Intel MPI is tested
    first because its Hydra also prints Hydra build details.
    """
    if "Intel(R) MPI Library" in version_text:
        return MpiFlavor(INTEL_MPI, _first_version(
            version_text, r"(?:Version|Library)\s+(\d+(?:\.\d+)*)"))
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return MpiFlavor(OPEN_MPI, _first_version(
            version_text, r"(?:\((?:Open MPI|OpenRTE)\)|Open MPI v)\s*(\d+(?:\.\d+)*)"))
    if "HYDRA build details" in version_text or "MPICH" in version_text:
        return MpiFlavor(MPICH, _first_version(
            version_text, r"(?:MPICH Version|Version):\s+(\d+(?:\.\d+)*)"))
    return None


# --- hosts ---------------------------------------------------------------------------------------
def _slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise HostfileError(f"{where}: slot count {text!r} is not an integer") from None
    if slots < 1:
        raise HostfileError(f"{where}: slot count must be at least 1, got {slots}")
    return slots


def _host_colon_slots(item: str, where: str) -> Host:
    name, sep, count = item.partition(":")
    if not name:
        raise HostfileError(f"{where}: empty host name in {item!r}")
    return Host(name, _slots(count, where) if sep else 1)


def parse_hosts(spec: str) -> list[Host]:
    """Parse ``-H``/``--hosts``: ``host1:2,host2:4`` (a host without ``:N`` has one slot)."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise HostfileError(f"-H {spec!r}: no hosts given")
    return [_host_colon_slots(item, f"-H {spec!r}") for item in items]


def _hostfile_line(line: str, where: str) -> Host:
    fields = line.split()
    if len(fields) == 1:
        return _host_colon_slots(fields[0], where)
    host = Host(fields[0])
    for field in fields[1:]:
        key, sep, value = field.partition("=")
        if key == "slots" and sep:
            host = Host(fields[0], _slots(value, where))
        elif key != "max_slots":
            raise HostfileError(f"{where}: unsupported field {field!r} (use 'host slots=N' "
                                f"or 'host:N')")
    return host


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[Host]:
    """Parse a hostfile: one host per line as ``host``, ``host:N`` or ``host slots=N``.

    ``#`` starts a comment; Open MPI's ``max_slots=M`` is accepted and ignored.
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(_hostfile_line(line, f"{source}:{number}"))
    if not hosts:
        raise HostfileError(f"{source}: no hosts listed")
    return hosts


def render_hostfile(flavor: MpiFlavor, hosts: Sequence[Host]) -> str:
    """The hostfile text in the launcher's own format (``host:N`` for Hydra, ``slots=N``
    for Open MPI)."""
    if flavor.kind == OPEN_MPI:
        lines = [f"{host.name} slots={host.slots}" for host in hosts]
    else:
        lines = [f"{host.name}:{host.slots}" for host in hosts]
    return "\n".join(lines) + "\n"


def needs_hostfile(flavor: MpiFlavor, hosts_from_file: bool) -> bool:
    """Whether the host list must be handed to the launcher as a file.

    Hostfiles are always rewritten in the launcher's format; Intel MPI also gets ``-H`` lists as
    a machine file, since its ``-hosts`` option takes no per-host slot counts.
    """
    return hosts_from_file or flavor.kind == INTEL_MPI


def _host_list(hosts: Sequence[Host]) -> str:
    return ",".join(f"{host.name}:{host.slots}" for host in hosts)


# --- ssh ---------------------------------------------------------------------------------------
def option_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last ``-name VALUE``, ``--name VALUE`` or ``-name=VALUE`` in ``args``
    (launcher arguments such as ``--mpi-args``), for any of ``names``; None when absent."""
    found = None
    for index, word in enumerate(args):
        name, sep, value = word.lstrip("-").partition("=")
        if word.startswith("-") and name in names:
            if sep:
                found = value
            elif index + 1 < len(args):
                found = args[index + 1]
    return found


def mca_value(args: Sequence[str], name: str) -> str | None:
    """The value Open MPI's ``--mca NAME VALUE`` (or ``-mca``, ``--prtemca``) sets in
    ``args``; None when absent."""
    found = None
    for index, word in enumerate(args[:-2]):
        if word in ("-mca", "--mca", "--prtemca", "-prtemca") and args[index + 1] == name:
            found = args[index + 2]
    return found


def ssh_arguments(flavor: MpiFlavor, options: Sequence[str],
                  environ: Mapping[str, str]) -> str | None:
    """The ssh arguments the launcher must get for ``options`` (``-p PORT``, ``-i FILE``):
    those the environment already gives it (:data:`SSH_ARGS_VARIABLE`, e.g. the Kubernetes MPI
    Operator's ``-o ConnectionAttempts=10`` for Open MPI) followed by ``options``; None when
    ``options`` is empty.  The launchers split the text on blanks, so no word may contain one
    (ValueError)."""
    if not options:
        return None
    for word in options:
        if not word or any(char.isspace() for char in word):
            raise ValueError(f"ssh argument {word!r} contains a blank: the MPI launcher splits "
                             f"its ssh arguments on blanks (move or rename the file)")
    before = environ.get(SSH_ARGS_VARIABLE[flavor.kind], "").split()
    return " ".join(before + list(options))


def ssh_arguments_in(flavor: MpiFlavor, mpi_args: Sequence[str]) -> str | None:
    """The launcher option in ``mpi_args`` that already sets the ssh arguments (Intel MPI's
    ``-bootstrap-exec-args``, Open MPI's ``plm_rsh_args``), or None."""
    if flavor.kind == INTEL_MPI and option_value(mpi_args, ("bootstrap-exec-args",)) is not None:
        return "-bootstrap-exec-args"
    if flavor.kind == OPEN_MPI and mca_value(mpi_args, "plm_rsh_args") is not None:
        return "plm_rsh_args"
    return None


def _names_launcher(args: Sequence[str]) -> bool:
    return option_value(args, ("launcher", "bootstrap")) is not None


def launcher_environment(flavor: MpiFlavor, job: JobSpec) -> dict[str, str]:
    """Variables for the launcher itself (not the ranks): MPICH's Hydra takes the ssh
    arguments from :data:`SSH_ARGS_VARIABLE` only."""
    if job.ssh_args is not None and flavor.kind == MPICH:
        return {SSH_ARGS_VARIABLE[MPICH]: job.ssh_args}
    return {}


def _hydra_ssh(flavor: MpiFlavor, job: JobSpec) -> list[str]:
    """Hydra's options for ``job.ssh_args``: ssh as the launcher (whatever the batch system
    would have chosen: the arguments are ssh's), unless ``--mpi-args`` names one; Intel MPI
    takes the arguments as an option, MPICH through :func:`launcher_environment`."""
    if job.ssh_args is None:
        return []
    argv = [] if _names_launcher(job.mpi_args) else (
        ["-bootstrap", "ssh"] if flavor.kind == INTEL_MPI else ["-launcher", "ssh"])
    if flavor.kind == INTEL_MPI:
        argv += ["-bootstrap-exec-args", job.ssh_args]
    return argv


# --- --tcp ---------------------------------------------------------------------------------------
def tcp_settings(flavor: MpiFlavor, mpi_args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The variables and launcher arguments that make MPI carry its traffic between hosts over
    TCP only (horovodrun's ``--tcp``), and NCCL too (``NCCL_IB_DISABLE=1``, as horovodrun sets).

    MPICH: its ch4 ofi netmod with libfabric's tcp provider (``MPIR_CVAR_CH4_NETMOD=ofi``,
    ``FI_PROVIDER=tcp``; MPICH's UCX netmod would pick InfiniBand); Intel MPI: libfabric's tcp
    provider; Open MPI: the ob1 PML with the TCP BTL (``--mca pml ob1 --mca btl
    tcp,self,<shared memory>``), except what ``mpi_args`` already sets.  Within a host, MPI
    keeps its shared memory (as Spectrum MPI's ``-tcp``, which horovodrun uses): only the
    network is concerned."""
    env = {"NCCL_IB_DISABLE": "1"}
    if flavor.kind == MPICH:
        env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")
        return env, []
    if flavor.kind == INTEL_MPI:
        env.update(FI_PROVIDER="tcp", I_MPI_OFI_PROVIDER="tcp")
        return env, []
    shared = "sm" if flavor.version and flavor.version[0] >= 5 else "vader"  # renamed in 5
    args: list[str] = []
    for name, value in (("pml", "ob1"), ("btl", f"tcp,self,{shared}")):
        if mca_value(mpi_args, name) is None:
            args += ["--mca", name, value]
    return env, args


def apply_tcp(flavor: MpiFlavor, job: JobSpec) -> None:
    """Add :func:`tcp_settings` to ``job``: variables the job does not set itself (``-x``
    wins), launcher arguments before ``--mpi-args``."""
    env, args = tcp_settings(flavor, job.mpi_args)
    for name, value in env.items():
        job.env.setdefault(name, value)
    job.mpi_args[:0] = args


# --- command construction ------------------------------------------------------------------------
def _hydra_command(launcher: str, flavor: MpiFlavor, job: JobSpec) -> list[str]:
    argv = [launcher, "-n", str(job.np)]
    if job.hosts:
        if flavor.kind == INTEL_MPI:
            raise ValueError("Intel MPI takes hosts through a machine file; see needs_hostfile()")
        argv += ["-hosts", _host_list(job.hosts)]
    if job.hostfile:
        argv += ["-machinefile" if flavor.kind == INTEL_MPI else "-f", job.hostfile]
    if job.nics:
        if len(job.nics) > 1:
            raise ValueError(f"{FLAVOR_NAMES[flavor.kind]}'s launcher takes one network "
                             f"interface (-iface), got {','.join(job.nics)}")
        argv += ["-iface", job.nics[0]]
    argv += _hydra_ssh(flavor, job)
    for name, value in job.env.items():
        argv += ["-genv", name, value]
    return argv


def _open_mpi_mapping(flavor: MpiFlavor) -> list[str]:
    # Open MPI 5 (PRRTE) deprecates --oversubscribe in favour of a mapping qualifier.
    if flavor.version and flavor.version[0] >= 5:
        return ["--map-by", "slot:OVERSUBSCRIBE"]
    return ["--oversubscribe", "--map-by", "slot"]


def _open_mpi_command(launcher: str, flavor: MpiFlavor, job: JobSpec, is_root: bool,
                      forward: Sequence[str]) -> list[str]:
    argv = [launcher, "-np", str(job.np)]
    if is_root:
        argv.append("--allow-run-as-root")
    argv += _open_mpi_mapping(flavor) + ["--bind-to", "none"]
    if job.hosts:
        argv += ["-H", _host_list(job.hosts)]
    if job.hostfile:
        argv += ["--hostfile", job.hostfile]
    if job.nics:
        argv += ["--mca", "btl_tcp_if_include", ",".join(job.nics)]
    if job.ssh_args is not None:
        argv += ["--mca", "plm_rsh_args", job.ssh_args]
    names = list(job.env) + [name for name in forward if name not in job.env]
    for name in names:
        argv += ["-x", name]
    return argv


def build_command(launcher: str, flavor: MpiFlavor, job: JobSpec, is_root: bool = False,
                  forward: Sequence[str] = ()) -> list[str]:
    """The full launcher command line for ``job``.

    ``is_root`` adds Open MPI's ``--allow-run-as-root``; ``forward`` names extra variables that
    Open MPI should export to the ranks (Hydra forwards the whole environment by itself).
    """
    if job.hosts and job.hostfile:
        raise ValueError("give either hosts or a hostfile, not both")
    if flavor.kind == OPEN_MPI:
        argv = _open_mpi_command(launcher, flavor, job, is_root, forward)
    else:
        argv = _hydra_command(launcher, flavor, job)
    return argv + list(job.mpi_args) + list(job.command)


def open_mpi_forward(environ: Mapping[str, str]) -> list[str]:
    """The :data:`OPEN_MPI_FORWARD` variables that are set in ``environ``."""
    return [name for name in OPEN_MPI_FORWARD if environ.get(name)]


def child_environment(base: Mapping[str, str], job_env: Mapping[str, str],
                      bin_dir: str) -> dict[str, str]:
    """The launcher's environment: ``base`` plus ``job_env``, with ``bin_dir`` first on PATH."""
    env = dict(base)
    env.update(job_env)
    rest = [entry for entry in env.get("PATH", "").split(os.pathsep)
            if entry and entry != bin_dir]
    env["PATH"] = os.pathsep.join([bin_dir] + rest)
    return env
