"""Elastic jobs: ``hvdlite run --min-np N --max-np M (--host-discovery-script S | -H ... |
--hostfile F)``, horovodrun's elastic flags, over MPI.

An MPI world cannot lose or gain a process, so the driver (this process) runs the job as a
sequence of worlds: it starts one ``mpiexec`` on the hosts available now, watches it (every
worker reports to it, see :mod:`.server`), and when a worker fails or hosts come and go it lets
that world end and starts the next one, at the new size, from the last commit it holds.  See
:mod:`.driver` for the loop (shared with Ray's and Spark's elastic jobs through
:mod:`.provider`), :mod:`.launcher` for worlds over the MPI launcher, :mod:`.hosts` for
discovery, blacklisting and placement, and docs/elastic.md for the user's view.
"""
from __future__ import annotations

import argparse
from typing import Callable, Mapping, Sequence, TextIO

from .options import add_options, requested, settings_from_args


def run(args: argparse.Namespace, environ: Mapping[str, str], forward: Sequence[str],
        output: tuple[TextIO, TextIO] | None, on_world: Callable[[int, int], None] | None,
        prepare: Callable, start: Callable, check: Callable) -> int:
    """Run the elastic job ``args`` asks for; its exit status.  ``prepare(args, environ,
    forward, workdir) -> (argv, env)``, ``start(argv, env, output) -> (proc, pumps)`` and
    ``check(args, hosts, environ) -> [(host, why)]`` are the launcher's own (:mod:`..launch`),
    used for every world."""
    from .launcher import run_job
    settings = settings_from_args(args, environ)
    return run_job(args, settings, dict(environ), forward, output, on_world, prepare, start,
                   check)


__all__ = ["add_options", "requested", "run"]
