"""``horovodrun`` flags that ``hvdlite run`` understands beyond its own, so that a Horovod
launch command keeps working after replacing ``horovodrun`` with ``hvdlite run``.

Three kinds:

* flags with an hvdlite meaning (``--output-filename``, ``--network-interface(s)``,
  ``--binding-args``, ``-p/--ssh-port``, ``-i/--ssh-identity-file``, ``--start-timeout``,
  ``--config-file`` (:mod:`.config_file`), ``--prefix-output-with-timestamp``,
  ``--log-with-timestamp``, ``--thread-affinity``, ``--tcp``, ``-cb``, ``-v``) are ordinary
  options of the parser;
* flags whose Horovod purpose is already met (``--mpi``: hvdlite always runs over MPI;
  ``--disable-cache``: ``hvdlite run`` caches no start-up checks;
  ``--log-without-timestamp``: the default; ``--num-nccl-streams 1``: hvdlite's one stream) are
  accepted and do nothing;
* flags for features hvdlite does not have stop the launch with a message that says why and
  what to use instead (:data:`UNSUPPORTED`), rather than argparse's bare "unrecognized
  arguments" or, worse, a silently different job.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from typing import Iterator, Sequence, TextIO

NCCL_STREAMS = ("hvdlite runs NCCL operations on one CUDA stream per GPU (1, Horovod's default, "
                "is accepted); several streams are not implemented.")

# flag spellings -> (number of values it takes, why it is refused)
UNSUPPORTED: dict[tuple[str, ...], tuple[int, str]] = {
    ("--gloo",): (0, "hvdlite runs over MPI only (no Gloo controller); drop --gloo."),
    ("--jsrun",): (0, "hvdlite does not drive jsrun (IBM LSF); it uses the installed "
                      "mpiexec/mpirun (choose one with --mpiexec)."),
    ("--gloo-timeout-seconds",): (1, "hvdlite has no Gloo controller; drop this flag."),
    ("--mpi-threads-disable",): (0, "hvdlite calls MPI from several threads at once (one "
                                    "engine thread per process set, and the calling thread for "
                                    "process-set registration and object collectives), which "
                                    "needs MPI_THREAD_MULTIPLE."),
}
# read by each rank's engine thread (hvdlite.common.runtime.affinity, which the launcher does
# not import: the core is reached only through hvdlite.common.core)
THREAD_AFFINITY_VARIABLE = "HVDLITE_THREAD_AFFINITY"
# the per-rank output wrapper's (rank_output's) option, and its DIR when no files are wanted
WRAPPER_TIMESTAMP_FLAG = "--prefix-timestamp"
WRAPPER_NO_FILES = "-"
# Horovod's line prefix for its log with timestamps: [2026-11-29 10:00:00.123456: ...]
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _cores(text: str) -> str:
    """``--thread-affinity``: one core id per local rank, comma-separated (horovodrun's flag
    takes one integer, its variable a list; both are accepted)."""
    words = [word.strip() for word in text.split(",")]
    for word in words:
        if not word.isdigit():
            raise argparse.ArgumentTypeError(
                f"{word!r} is not a core id (a non-negative integer); give one core per local "
                f"rank, separated by commas, e.g. 0,1")
    return ",".join(str(int(word)) for word in words)


def _nccl_streams(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value != 1:
        raise argparse.ArgumentTypeError(f"{value} is not supported: {NCCL_STREAMS}")
    return value


class _Refuse(argparse.Action):
    """Stop parsing with a message naming the flag and why hvdlite does not take it."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} (a horovodrun flag) is not supported: {self.reason}")


class _Union(argparse.Action):
    """``--network-interface eth0 --network-interfaces eth1,eth2``: the union, in order."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        names = list(getattr(namespace, self.dest) or [])
        for name in values.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
        setattr(namespace, self.dest, names)


def add_options(parser: argparse.ArgumentParser, version: str) -> None:
    """Add the horovodrun flags (see the module docstring) to ``parser``."""
    parser.add_argument("-v", "--version", action="version", version=f"hvdlite {version}")
    group = parser.add_argument_group("horovodrun compatibility")
    group.add_argument("--output-filename", metavar="DIR",
                       help="also write each rank's stdout/stderr to DIR/rank.<rank>/stdout "
                            "and .../stderr (rank zero-padded, as horovodrun does)")
    group.add_argument("--network-interface", "--network-interfaces", dest="nics",
                       action=_Union, metavar="NIC[,NIC]",
                       help="network interface(s) for MPI's TCP traffic and NCCL's sockets; "
                            "repeatable")
    group.add_argument("--binding-args", metavar='"ARGS"', default="",
                       help="process binding arguments for the MPI launcher, e.g. "
                            "--binding-args=\"--bind-to core\"")
    group.add_argument("-p", "--ssh-port", dest="ssh_port", type=_port, metavar="PORT",
                       help="ssh port on every host (given to the MPI launcher's ssh)")
    group.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
                       help="ssh identity (private key) file on this host, for the MPI "
                            "launcher's ssh")
    group.add_argument("--start-timeout", type=_seconds, metavar="S",
                       help="seconds the check that every remote host can be reached over ssh "
                            "may take (default 30)")
    group.add_argument("--config-file", metavar="FILE",
                       help="horovodrun's YAML configuration file (params, timeline, stall_check, "
                            "library_options, logging); flags on the command line win")
    group.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                       dest="prefix_output_with_timestamp", action="store_true",
                       help="start every line of the ranks' output with the time and rank: "
                            "'Mon Nov 30 10:00:00 2026[1]<stdout>:'")
    stamps = group.add_mutually_exclusive_group()
    for spellings, value, text in (
            (("--log-with-timestamp", "--no-log-hide-timestamp"), True,
             "start hvdlite run's own message lines with the date and time"),
            (("--log-without-timestamp", "--log-hide-timestamp"), False,
             "hvdlite run's own message lines without the time (the default)")):
        stamps.add_argument(*spellings, dest="log_with_timestamp", action="store_const",
                            const=value, help=text)
    group.add_argument("--thread-affinity", type=_cores, metavar="CORE[,CORE]",
                       help="pin each rank's engine thread to a core: one core id per local "
                            "rank (sets HVDLITE_THREAD_AFFINITY)")
    group.add_argument("--tcp", action="store_true",
                       help="MPI and NCCL traffic between hosts over TCP only (not InfiniBand "
                            "or other fabrics)")
    group.add_argument("--num-nccl-streams", type=_nccl_streams, metavar="1",
                       help="accepted with 1: hvdlite uses one NCCL stream per GPU")
    group.add_argument("--mpi", action="store_true",
                       help="accepted: hvdlite always runs over MPI")
    group.add_argument("--disable-cache", action="store_true",
                       help="accepted: hvdlite run caches no start-up checks")
    for flags, (nargs, reason) in UNSUPPORTED.items():
        parser.add_argument(*flags, action=_Refuse, reason=reason, nargs=nargs,
                            dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)


def nic_env(nics: Sequence[str]) -> dict[str, str]:
    """Variables that point NCCL's sockets at ``nics`` (as horovodrun does) and, for one
    interface, libfabric's TCP provider (MPICH 4+ and Intel MPI carry MPI traffic over
    libfabric or UCX; the launcher's ``-iface`` covers only its own connections and MPICH's
    older ch3 device)."""
    if not nics:
        return {}
    env = {"NCCL_SOCKET_IFNAME": ",".join(nics)}
    if len(nics) == 1:
        env["FI_TCP_IFACE"] = nics[0]
    return env


def rank_env(args: argparse.Namespace) -> dict[str, str]:
    """Variables the ranks get from horovodrun flags that are not knobs: the engine thread's
    core list of ``--thread-affinity`` (read by :mod:`hvdlite.common.runtime.affinity`)."""
    if args.thread_affinity is None:
        return {}
    return {THREAD_AFFINITY_VARIABLE: args.thread_affinity}


class TimestampedLines:
    """A text stream that starts each of ``hvdlite run``'s own message lines (those that begin
    with ``hvdlite``) with ``[date time]``, for ``--log-with-timestamp``; other text passes
    through unchanged."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        """Write ``text``, stamping the message lines that start in it."""
        out = []
        for line in text.splitlines(keepends=True):
            if self.at_line_start and line.startswith("hvdlite"):
                out.append(f"[{datetime.datetime.now().strftime(LOG_TIME_FORMAT)}] ")
            out.append(line)
            self.at_line_start = line.endswith("\n")
        return self.stream.write("".join(out))

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def launcher_log(with_timestamp: bool | None) -> Iterator[None]:
    """Within it, ``hvdlite run``'s messages on ``sys.stderr`` carry a timestamp when
    ``with_timestamp`` (``--log-with-timestamp``)."""
    if not with_timestamp:
        yield
        return
    previous, sys.stderr = sys.stderr, TimestampedLines(sys.stderr)
    try:
        yield
    finally:
        sys.stderr = previous


def wrapper_command(output_dir: str | None, timestamps: bool, np: int,
                    command: Sequence[str]) -> list[str]:
    """``command`` run under the per-rank output wrapper (:mod:`.rank_output`) for
    ``--output-filename output_dir`` and/or ``--prefix-output-with-timestamp`` (``command``
    itself when neither is asked for)."""
    if output_dir is None and not timestamps:
        return list(command)
    return ([sys.executable, "-m", "hvdlite.runner.rank_output"]
            + ([WRAPPER_TIMESTAMP_FLAG] if timestamps else [])
            + [WRAPPER_NO_FILES if output_dir is None else os.path.abspath(output_dir), str(np)]
            + list(command))
