"""The elastic flags of ``hvdlite run`` (horovodrun's: ``--min-np``, ``--max-np``,
``--host-discovery-script``, ``--slots-per-host``, ``--reset-limit``,
``--blacklist-cooldown-range``, ``--elastic-timeout``) and the settings they make."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Mapping

from .. import mpi_flavor
from ..launch_errors import UsageError
from . import hosts as hostmod

ELASTIC_TIMEOUT_SECONDS = 600   # horovodrun's default for --elastic-timeout
TIMEOUT_VARIABLES = ("HVDLITE_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT")


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def add_options(parser: argparse.ArgumentParser) -> None:
    """horovodrun's elastic flags (``--min-np`` and the others)."""
    group = parser.add_argument_group(
        "elastic training (as horovodrun; see docs/elastic.md)")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_count(1),
                       metavar="N", help="fewest processes to train with; with fewer slots the "
                       "job waits for hosts (default: -np)")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_count(1),
                       metavar="N", help="most processes to train with (default: every slot)")
    group.add_argument("--host-discovery-script", dest="host_discovery_script", metavar="S",
                       help="executable printing the available hosts, one 'host:slots' (or "
                            "'host') per line; run every second")
    group.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=_count(1),
                       metavar="N", help="slots of a host the discovery script prints without "
                                         "':slots'")
    group.add_argument("--reset-limit", dest="reset_limit", type=_count(0), metavar="N",
                       help="stop the job after this many resets (default: no limit)")
    group.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=_count(1),
                       nargs=2, metavar=("LOW", "HIGH"),
                       help="seconds a failing host stays blacklisted: LOW*2**n plus up to "
                            "LOW more, at most HIGH (default: for the rest of the job)")
    group.add_argument("--elastic-timeout", dest="elastic_timeout", type=_count(1),
                       metavar="S", help="seconds to wait for --min-np slots before giving up "
                                         "(default: $HOROVOD_ELASTIC_TIMEOUT or 600)")


def requested(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for an elastic job."""
    return any(getattr(args, name, None) is not None
               for name in ("min_np", "max_np", "host_discovery_script"))


def elastic_timeout(args: argparse.Namespace, environ: Mapping[str, str]) -> float:
    if args.elastic_timeout is not None:
        return float(args.elastic_timeout)
    for name in TIMEOUT_VARIABLES:
        text = environ.get(name)
        if text:
            try:
                value = float(text)
            except ValueError:
                raise UsageError(f"{name}={text!r} is not a number of seconds") from None
            if value <= 0:
                raise UsageError(f"{name}={text!r} must be positive")
            return value
    return float(ELASTIC_TIMEOUT_SECONDS)


@dataclasses.dataclass
class ElasticSettings:
    start_np: int
    min_np: int
    max_np: int | None
    discovery: object
    reset_limit: int | None
    cooldown_range: tuple[int, int] | None
    elastic_timeout: float


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ElasticSettings:
    """The elastic settings of ``args``; UsageError for inconsistent ones."""
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise UsageError("give the elastic job's hosts one way: --host-discovery-script, -H or "
                         "--hostfile")
    if args.host_discovery_script:
        discovery = hostmod.HostDiscoveryScript(args.host_discovery_script, args.slots_per_host)
    elif args.hosts or args.hostfile:
        try:
            if args.hosts:
                pool = mpi_flavor.parse_hosts(args.hosts)
            else:
                with open(args.hostfile) as f:
                    pool = mpi_flavor.parse_hostfile_text(f.read(), args.hostfile)
        except OSError as exc:
            raise UsageError(f"cannot read hostfile {args.hostfile}: {exc.strerror}") from None
        except mpi_flavor.HostfileError as exc:
            raise UsageError(str(exc)) from None
        discovery = hostmod.FixedHosts({h.name: h.slots for h in pool})
    else:
        raise UsageError("an elastic job (--min-np/--max-np) needs its hosts: "
                         "--host-discovery-script S, or a fixed pool with -H or --hostfile")
    if args.slots_per_host is not None and not args.host_discovery_script:
        raise UsageError("--slots-per-host is for hosts a --host-discovery-script prints "
                         "without ':slots'; -H/--hostfile give each host's slots")
    min_np = args.min_np if args.min_np is not None else args.np
    start_np = args.np if args.np is not None else min_np
    if min_np is None:
        if isinstance(discovery, hostmod.FixedHosts):
            min_np = start_np = sum(discovery.host_slots.values())
        else:
            raise UsageError("an elastic job needs -np N or --min-np N (the processes to start "
                             "with, and the fewest to train with)")
    if start_np < min_np:
        raise UsageError(f"-np {start_np} is below --min-np {min_np}")
    if args.max_np is not None and args.max_np < max(min_np, start_np):
        raise UsageError(f"--max-np {args.max_np} is below -np/--min-np "
                         f"{max(min_np, start_np)}")
    cooldown = tuple(args.cooldown_range) if args.cooldown_range else None
    if cooldown is not None:
        try:
            hostmod.check_cooldown_range(*cooldown)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return ElasticSettings(start_np, min_np, args.max_np, discovery, args.reset_limit,
                           cooldown, elastic_timeout(args, environ))
