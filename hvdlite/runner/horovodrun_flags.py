"""``horovodrun`` flags that ``hvdlite run`` understands beyond its own, so that a Horovod
launch command keeps working after replacing ``horovodrun`` with ``hvdlite run``.

Three kinds:

* flags with an hvdlite meaning (``--output-filename``, ``--network-interface(s)``,
  ``--binding-args``, ``-p/--ssh-port``, ``-i/--ssh-identity-file``, ``--start-timeout``,
  ``-cb``, ``-v``) are ordinary options of the parser;
* flags whose Horovod purpose is already met (``--mpi``: hvdlite always runs over MPI;
  ``--disable-cache``: ``hvdlite run`` caches no start-up checks) are accepted and do nothing;
* flags for features hvdlite does not have stop the launch with a message that says why and
  what to use instead (:data:`UNSUPPORTED`), rather than argparse's bare "unrecognized
  arguments" or, worse, a silently different job.
"""
from __future__ import annotations

import argparse
from typing import Sequence

_AUTOTUNE = ("hvdlite has no autotuner; set --fusion-threshold-mb and --cycle-time-ms "
             "(docs/knobs.md lists every knob).")

# flag spellings -> (number of values it takes, why it is refused)
UNSUPPORTED: dict[tuple[str, ...], tuple[int, str]] = {
    ("--gloo",): (0, "hvdlite runs over MPI only (no Gloo controller); drop --gloo."),
    ("--jsrun",): (0, "hvdlite does not drive jsrun; it uses the installed mpiexec/mpirun "
                      "(choose one with --mpiexec)."),
    ("--gloo-timeout-seconds",): (1, "hvdlite has no Gloo controller; drop this flag."),
    ("--autotune",): (0, _AUTOTUNE),
    ("--autotune-log-file",): (1, _AUTOTUNE),
    ("--autotune-warmup-samples",): (1, _AUTOTUNE),
    ("--autotune-steps-per-sample",): (1, _AUTOTUNE),
    ("--autotune-bayes-opt-max-samples",): (1, _AUTOTUNE),
    ("--autotune-gaussian-process-noise",): (1, _AUTOTUNE),
    ("--num-nccl-streams",): (1, "hvdlite runs NCCL operations on one stream; drop this flag."),
    ("--thread-affinity",): (1, "hvdlite does not pin its background thread; bind processes "
                                "with --binding-args or your launcher's options instead."),
    ("--mpi-threads-disable",): (0, "hvdlite's background thread needs a thread-capable MPI "
                                    "(MPI_THREAD_MULTIPLE); this switch does not exist."),
    ("--tcp",): (0, "choose MPI's transport through the launcher instead, e.g. for Open MPI "
                    "--mpi-args=\"--mca btl tcp,self,vader\"."),
    ("--config-file",): (1, "hvdlite run reads no YAML configuration; give the flags on the "
                            "command line or set HVDLITE_* variables."),
    ("-prefix-timestamp", "--prefix-output-with-timestamp"): (
        0, "hvdlite run does not timestamp output lines; Open MPI can: "
           "--mpi-args=--timestamp-output."),
    ("--log-with-timestamp",): (0, "hvdlite's log format is fixed; drop this flag."),
    ("--log-without-timestamp", "--log-hide-timestamp"): (
        0, "hvdlite's log format is fixed; drop this flag."),
}


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
