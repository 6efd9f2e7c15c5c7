"""``hvdlite run``: start a data-parallel job through the installed MPI launcher.

The hvdlite equivalent of ``horovodrun``::

    hvdlite run -np 4 -H host1:2,host2:2 --fusion-threshold-mb 32 python train.py

The launcher (``mpiexec``/``mpirun``) is found and identified by :mod:`.mpi_flavor`; this module
parses the command line, turns the tuning flags into ``HVDLITE_*`` environment variables for
every rank, and runs the job as a supervised child (:mod:`.job_process`), returning its exit
status.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Sequence, TextIO, TypeVar

from . import (check_build, config_file, elastic, horovodrun_flags, host_check, mpi_flavor,
               slurm)
from hvdlite.common.core import KNOBS, Flag, Knob
from ..version import __version__
from .job_process import run_job, start_job
from .launch_errors import LaunchError, UsageError
from .mpi_flavor import Host, HostfileError, JobSpec

Number = TypeVar("Number", int, float)

INSTALL_HINT = ("install one with `pip install mpich` (or your system's MPI, e.g. "
                "`apt-get install mpich` or `apt-get install openmpi-bin`)")
# Where launchers find their hosts when none are given on the command line (the Kubernetes MPI
# Operator sets the one of its MPI; a batch system's allocation is read by the launcher itself).
ENV_HOSTFILES = ("HYDRA_HOST_FILE", "I_MPI_HYDRA_HOST_FILE", "OMPI_MCA_orte_default_hostfile")


# --- argument parsing ----------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(cast: Callable[[str], Number]) -> Callable[[str], Number]:
    """An argparse ``type`` that applies ``cast`` and rejects negative or non-finite values."""
    def parse(text: str) -> Number:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
        return value
    parse.__name__ = cast.__name__
    return parse


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-np", "-n", "--num-proc", dest="np", type=_positive_int, metavar="N",
                        help="number of processes (default: the total slots of -H/--hostfile)")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots, e.g. host1:2,host2:2")
    hosts.add_argument("--hostfile", "-hostfile", dest="hostfile", metavar="FILE",
                       help="file with one 'host slots=N' or 'host:N' per line")
    parser.add_argument("-x", dest="env", action="append", default=[], metavar="VAR[=VALUE]",
                        help="export VAR (its current value, or VALUE) to every rank; repeatable")
    parser.add_argument("--mpi-args", dest="mpi_args", default="", metavar='"ARGS"',
                        help="extra arguments for the MPI launcher (use --mpi-args=\"...\" "
                             "when they start with a dash and contain no space)")
    parser.add_argument("--mpiexec", dest="mpiexec", metavar="PATH",
                        help="MPI launcher to use instead of searching for one")
    parser.add_argument("--verbose", action="store_true",
                        help="print the MPI command (and the variables set) before running it")
    parser.add_argument("--skip-host-check", action="store_true",
                        help="start the job without first logging in to every remote host "
                             "over ssh as the MPI launcher will")
    parser.add_argument("-cb", "--check-build", action="store_true",
                        help="show the available frameworks, controllers and operations")


def _flag_help(knob: Knob, flag: Flag) -> str:
    if flag.sets is not None:
        return f"{flag.help} ({knob.variable}={flag.sets})"
    values = f": {', '.join(flag.choices)}" if flag.choices else ""
    how = f" to {flag.conversion.text}" if flag.conversion.text else ""
    return f"{knob.help}{values} (sets {knob.variable}{how})"


def _add_knob_options(parser: argparse.ArgumentParser) -> None:
    """The flags of :data:`config.KNOBS`.  A knob has one flag that takes a value, or on/off
    flags (mutually exclusive, as in horovodrun); either way they store into the first flag's
    ``dest`` (None when not given)."""
    group = parser.add_argument_group("tuning (exported as HVDLITE_* variables)")
    for knob in KNOBS:
        if not knob.flags:
            continue
        dest = knob.flags[0].dest
        pair = group.add_mutually_exclusive_group() if len(knob.flags) > 1 else group
        for flag in knob.flags:
            if flag.sets is not None:
                pair.add_argument(*flag.spellings, dest=dest, action="store_const",
                                  const=flag.sets, help=_flag_help(knob, flag))
            elif flag.choices:
                group.add_argument(*flag.spellings, dest=dest, type=str.lower,
                                   choices=flag.choices, metavar=flag.metavar,
                                   help=_flag_help(knob, flag))
            else:
                kind = _non_negative(flag.value_type) if flag.value_type in (int, float) else None
                group.add_argument(*flag.spellings, dest=dest, type=kind, metavar=flag.metavar,
                                   help=_flag_help(knob, flag))


def build_parser() -> argparse.ArgumentParser:
    """The ``hvdlite [run]`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="hvdlite run", allow_abbrev=False,
        description="Launch an hvdlite (Horovod-compatible) job with the installed MPI.",
        epilog="Example: hvdlite run -np 4 -H host1:2,host2:2 python train.py")
    _add_launch_options(parser)
    elastic.add_options(parser)
    _add_knob_options(parser)
    horovodrun_flags.add_options(parser, __version__)
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program and its arguments, run on every rank")
    return parser


def parse_args(argv: Sequence[str],
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse ``hvdlite`` arguments; a leading ``run`` subcommand word is optional.  ``parser``
    (default: :func:`build_parser`'s) lets a caller change how errors are reported."""
    argv = list(argv)
    if argv[:1] == ["run"]:
        argv = argv[1:]
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.config_file:   # its settings where the command line gave none
        try:
            config_file.apply(args, build_parser)
        except UsageError as exc:
            parser.error(str(exc))
    return args


# --- environment ---------------------------------------------------------------------------------
def knob_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``HVDLITE_*`` variables that the tuning flags ask for (unset flags add nothing)."""
    env: dict[str, str] = {}
    for knob in KNOBS:
        if not knob.flags:
            continue
        flag = knob.flags[0]
        value = getattr(args, flag.dest)
        if value is None or value == "":
            continue
        env[knob.variable] = value if flag.sets is not None else flag.conversion.apply(value)
    return env


def parse_env_args(items: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """Turn ``-x VAR`` / ``-x VAR=VALUE`` into ``{VAR: VALUE}``.

    ``-x VAR`` takes VAR's value from ``environ`` and is an error when VAR is not set there.
    """
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise UsageError(f"-x {item!r}: {name!r} is not a valid variable name")
        if not sep:
            if name not in environ:
                raise UsageError(f"-x {name}: {name} is not set in this environment "
                                 f"(use -x {name}=VALUE)")
            value = environ[name]
        env[name] = value
    return env


def job_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """Every variable the ranks must see: ``-x`` ones first, then the tuning flags (which win).
    ``--network-interface`` also points NCCL at those interfaces unless ``-x`` set that."""
    env = parse_env_args(args.env, environ)
    for name, value in horovodrun_flags.nic_env(args.nics or []).items():
        env.setdefault(name, value)
    env.update(knob_env(args))
    env.update(horovodrun_flags.rank_env(args))
    return env


# --- hosts and the command line ------------------------------------------------------------------
def resolve_hosts(args: argparse.Namespace) -> tuple[list[Host] | None, bool]:
    """The host list from ``-H`` or ``--hostfile`` (None for the local host) and whether it came
    from a file."""
    try:
        if args.hosts:
            return mpi_flavor.parse_hosts(args.hosts), False
        if args.hostfile:
            text = Path(args.hostfile).read_text()
            return mpi_flavor.parse_hostfile_text(text, args.hostfile), True
    except OSError as exc:
        raise UsageError(f"cannot read hostfile {args.hostfile}: {exc.strerror}") from None
    except HostfileError as exc:
        raise UsageError(str(exc)) from None
    return None, False


def environment_hosts(environ: Mapping[str, str]) -> tuple[list[Host], str] | None:
    """The hosts of the launcher's own hostfile variable (:data:`ENV_HOSTFILES`, e.g.
    ``HYDRA_HOST_FILE``) and ``NAME=path``, or None when none is set.  The launcher reads the
    file itself; hvdlite uses the list for ``-np``'s default and the host check."""
    for name in ENV_HOSTFILES:
        path = environ.get(name)
        if path:
            where = f"{name}={path}"
            try:
                return mpi_flavor.parse_hostfile_text(Path(path).read_text(), where), where
            except OSError as exc:
                raise LaunchError(f"cannot read the hostfile {where}: {exc.strerror}") from None
            except HostfileError as exc:
                raise LaunchError(str(exc)) from None
    return None


def process_count(args: argparse.Namespace, hosts: list[Host] | None) -> int:
    """``-np``, or the total number of slots when only hosts were given."""
    if args.np is not None:
        return args.np
    if hosts:
        return sum(host.slots for host in hosts)
    raise UsageError("-np N is required (the number of processes to start)")


def ssh_options(args: argparse.Namespace) -> list[str]:
    """ssh's options for ``-p/--ssh-port`` and ``-i/--ssh-identity-file`` (the identity file
    must exist here: ssh reads it on this host)."""
    options = []
    if args.ssh_port is not None:
        options += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file is not None:
        path = os.path.abspath(os.path.expanduser(args.ssh_identity_file))
        if not os.path.isfile(path):
            raise UsageError(f"-i/--ssh-identity-file {args.ssh_identity_file}: no such file "
                             f"(ssh reads the identity file on this host)")
        options += ["-i", path]
    return options


def detect_launcher(explicit: str | None) -> tuple[str, mpi_flavor.MpiFlavor]:
    """The launcher's path and flavour; LaunchError when there is none or it is unknown."""
    launcher = explicit or mpi_flavor.find_launcher()
    if launcher is None:
        raise LaunchError(f"no MPI launcher (mpiexec/mpirun) found; {INSTALL_HINT}")
    try:
        text = mpi_flavor.launcher_version_text(launcher)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {launcher} --version ({exc}); {INSTALL_HINT}") from None
    flavor = mpi_flavor.detect_flavor(text)
    if flavor is None:
        first = text.strip().splitlines()[0] if text.strip() else "no output"
        raise LaunchError(f"{launcher} is not MPICH, Intel MPI or Open MPI ({first!r}); "
                          f"{INSTALL_HINT}")
    return launcher, flavor


def _mpi_args(text: str, flag: str = "--mpi-args") -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"{flag} {text!r}: {exc}") from None


def plan_job(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[JobSpec, bool]:
    """The flavour-independent job description (every command-line mistake surfaces here) and
    whether its hosts came from a hostfile."""
    if not args.command:
        raise UsageError("no command given; usage: hvdlite run -np N [options] command ...")
    hosts, from_file = resolve_hosts(args)
    known = environment_hosts(environ) if hosts is None else None
    if hosts is None and known is None:   # inside sbatch/salloc: the launcher reads it too
        try:
            known = slurm.allocation_hosts(environ)
        except slurm.SlurmError as exc:
            raise LaunchError(str(exc)) from None
    np = process_count(args, hosts or (known[0] if known else None))
    # every rank runs its command under the per-rank output tee / timestamping wrapper
    command = horovodrun_flags.wrapper_command(args.output_filename,
                                               args.prefix_output_with_timestamp, np, args.command)
    spec = JobSpec(np=np, command=command, hosts=hosts, env=job_env(args, environ),
                   mpi_args=(_mpi_args(args.binding_args, "--binding-args")
                             + _mpi_args(args.mpi_args)),
                   nics=list(args.nics or []))
    return spec, from_file


def place_hosts(spec: JobSpec, flavor: mpi_flavor.MpiFlavor, from_file: bool,
                workdir: str) -> None:
    """Move ``spec.hosts`` into a hostfile in ``workdir``, in the launcher's own format, when
    the flavour needs one (see :func:`mpi_flavor.needs_hostfile`)."""
    if spec.hosts and mpi_flavor.needs_hostfile(flavor, from_file):
        path = Path(workdir) / "hostfile"
        path.write_text(mpi_flavor.render_hostfile(flavor, spec.hosts))
        spec.hostfile, spec.hosts = str(path), None


# --- reaching the hosts --------------------------------------------------------------------------
def check_hosts(args: argparse.Namespace, spec: JobSpec, hosts: list[Host] | None,
                launcher: str, flavor: mpi_flavor.MpiFlavor, env: Mapping[str, str]) -> None:
    """Log in to every remote host of the job (``hosts``, else those of the launcher's hostfile
    variable) as the launcher will (see :mod:`.host_check`); LaunchError naming the hosts that
    cannot be reached.  ``env``: the launcher's environment.  Nothing is checked with
    ``--skip-host-check``, for a job on this host only, or when the launcher will not use
    ssh."""
    if args.skip_host_check:
        return
    if hosts is None:
        known = environment_hosts(env)
        hosts = known[0] if known else None
    if not hosts:
        return
    shell = host_check.remote_shell(flavor, spec.mpi_args, env, spec.ssh_args)
    remote = host_check.remote_hosts([host.name for host in hosts]) if shell else []
    if not remote:
        return
    probe, tested = host_check.probe_command(flavor, launcher)
    timeout = args.start_timeout or host_check.DEFAULT_TIMEOUT
    if args.verbose:
        print(f"hvdlite: checking {len(remote)} remote host(s): "
              f"{shlex.join([*shell, 'HOST', probe])}", file=sys.stderr, flush=True)
    problems = host_check.check(remote, shell, probe, timeout)
    if problems:
        raise LaunchError(host_check.describe(problems, len(remote), shell, probe, tested,
                                              timeout))


def unreachable_hosts(args: argparse.Namespace, names: Sequence[str],
                      environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The hosts among ``names`` that the host check cannot reach, each with what ssh said
    (for the elastic driver, which blacklists them instead of stopping)."""
    launcher, flavor = detect_launcher(args.mpiexec)
    try:
        ssh_args = mpi_flavor.ssh_arguments(flavor, ssh_options(args), environ)
    except ValueError as exc:
        raise UsageError(f"-p/-i: {exc}") from None
    mpi_args = _mpi_args(args.binding_args, "--binding-args") + _mpi_args(args.mpi_args)
    shell = host_check.remote_shell(flavor, mpi_args, environ, ssh_args)
    remote = host_check.remote_hosts(list(names)) if shell else []
    if not remote:
        return []
    probe, _ = host_check.probe_command(flavor, launcher)
    problems = host_check.check(remote, shell, probe,
                                args.start_timeout or host_check.DEFAULT_TIMEOUT)
    return [(p.host, f"exit status {p.status}" + (f": {p.output.splitlines()[-1]}"
                                                   if p.output else "")) for p in problems]


def _print_verbose(argv: Sequence[str], env: Mapping[str, str], flavor: mpi_flavor.MpiFlavor,
                   path: str) -> None:
    err = sys.stderr
    print(f"hvdlite: MPI: {flavor.description}", file=err)
    for name, value in env.items():
        print(f"hvdlite: env {name}={value}", file=err)
    print(f"hvdlite: PATH={path}", file=err)
    print(f"hvdlite: {shlex.join(argv)}", file=err, flush=True)


def prepare(args: argparse.Namespace, environ: Mapping[str, str], forward: Sequence[str],
            workdir: str) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line and environment for ``args`` (hostfiles go to
    ``workdir``), after the host check (unless ``--skip-host-check``)."""
    spec, from_file = plan_job(args, environ)
    options = ssh_options(args)
    launcher, flavor = detect_launcher(args.mpiexec)
    bin_dir = str(Path(sys.executable).parent)
    try:
        spec.ssh_args = mpi_flavor.ssh_arguments(flavor, options, environ)
    except ValueError as exc:
        raise UsageError(f"-p/-i: {exc}") from None
    given = mpi_flavor.ssh_arguments_in(flavor, spec.mpi_args)
    if spec.ssh_args is not None and given:
        raise UsageError(f"-p/-i and --mpi-args' {given} both set the launcher's ssh "
                         f"arguments; give them in one place")
    if args.tcp:
        mpi_flavor.apply_tcp(flavor, spec)
    env = mpi_flavor.child_environment(environ, spec.env, bin_dir)
    env.update(mpi_flavor.launcher_environment(flavor, spec))
    hosts = spec.hosts
    place_hosts(spec, flavor, from_file, workdir)
    try:
        argv = mpi_flavor.build_command(
            launcher, flavor, spec, is_root=os.geteuid() == 0,
            forward=mpi_flavor.open_mpi_forward(env) + list(forward))
    except ValueError as exc:   # e.g. several network interfaces for a Hydra launcher
        raise UsageError(str(exc)) from None
    check_hosts(args, spec, hosts, launcher, flavor, env)
    if args.verbose:
        _print_verbose(argv, {**spec.env, **mpi_flavor.launcher_environment(flavor, spec)},
                       flavor, env["PATH"])
    return argv, env


def launch(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
           forward: Sequence[str] = (), output: tuple[TextIO, TextIO] | None = None,
           on_world: Callable[[int, int], None] | None = None) -> int:
    """Build the MPI command for ``args`` and run it; returns the job's exit status.

    ``environ`` (default ``os.environ``) is the environment the ranks inherit; ``forward``
    names variables of it that must reach remote ranks without appearing on the launcher's
    command line (Hydra forwards the whole environment anyway; Open MPI gets ``-x NAME``).
    ``output``: see :func:`run_job`.  With elastic flags the elastic driver runs the job
    (:mod:`.elastic`); ``on_world(index, size)`` is then called as each world starts.
    """
    environ = os.environ if environ is None else environ
    if elastic.requested(args):
        return elastic.run(args, environ, forward, output, on_world,
                           prepare=prepare, start=start_job, check=unreachable_hosts)
    with tempfile.TemporaryDirectory(prefix="hvdlite-run-") as workdir:
        argv, env = prepare(args, environ, forward, workdir)
        if on_world is not None:
            on_world(0, plan_job(args, environ)[0].np)
        return run_job(argv, env, output)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hvdlite`` / ``python -m hvdlite.runner``; returns the exit status."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse already printed the message (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    if args.check_build:
        return check_build.main(args.mpiexec)
    with horovodrun_flags.launcher_log(args.log_with_timestamp):
        try:
            return launch(args)
        except LaunchError as exc:
            print(f"hvdlite: error: {exc}", file=sys.stderr)
            return exc.exit_status
