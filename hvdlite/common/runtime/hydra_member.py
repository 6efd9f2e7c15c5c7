"""One MPI world formed from processes that another system started: the members' side.

A member is a process that will be one rank of the world (a Ray worker, a process that torchrun
started).  The first member on each host runs that host's Hydra proxy (:func:`start_proxy`);
every member then joins the world with the PMI environment of its rank (:func:`join_world`),
before ``hvd.init()`` uses MPI.  See :mod:`hvdlite.common.runtime.hydra_world` for the side that
runs ``mpiexec``.  Nothing here imports mpi4py until :func:`join_world`.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Mapping, Optional, Sequence

PROXY_EXIT_WAIT_S = 2.0
_PR_SET_PDEATHSIG = 1
_proxy: Optional[subprocess.Popen] = None
_release_path: Optional[str] = None


def die_with_parent() -> None:
    """``preexec_fn`` for a helper process that must not outlive the process that started it
    (Linux: the kernel sends it SIGKILL when that process ends, however it ends)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def proxy_pid() -> Optional[int]:
    """The pid of the host's proxy this process runs (it then belongs to a world already),
    or None."""
    return None if _proxy is None else _proxy.pid


def start_proxy(command: Sequence[str], release_path: str, tied: bool = False) -> int:
    """Run this host's Hydra proxy (the command ``mpiexec -launcher manual`` printed); return
    its pid.  It starts this host's placeholders, whose environments the side running
    ``mpiexec`` hands out; creating ``release_path`` ends them.  ``tied``: the proxy is killed
    when this process ends (a member that is itself a rank; a Ray worker's proxy is ended by
    :func:`stop_proxy` instead)."""
    global _proxy, _release_path
    stop_proxy()
    _release_path = release_path
    _proxy = subprocess.Popen(list(command), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, start_new_session=not tied,
                              preexec_fn=die_with_parent if tied else None)
    return _proxy.pid


def stop_proxy() -> Optional[int]:
    """End this member's proxy, if it runs one: release its placeholders (they exit 0, and
    so, once every host's have, do the proxies and ``mpiexec``); a proxy still running after
    :data:`PROXY_EXIT_WAIT_S` is killed (it ignores SIGTERM; its placeholders then see it
    gone).  Returns the proxy's pid, or None."""
    global _proxy, _release_path
    proc, _proxy = _proxy, None
    release, _release_path = _release_path, None
    if proc is None:
        return None
    if release:
        with open(release, "w"):
            pass
    try:
        proc.wait(PROXY_EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            proc.kill()
        proc.wait(PROXY_EXIT_WAIT_S)
    if release:
        try:
            os.unlink(release)
        except FileNotFoundError:
            pass
    return proc.pid


def join_world(env: Mapping[str, str], rank: int, size: int, who: str) -> None:
    """Initialise MPI in this process as rank ``rank`` of the ``size``-rank world, from the PMI
    environment its placeholder received (blocks until every rank joins: call it on all
    members at once).  ``MPI_Finalize`` is switched off: at exit the proxy that served this
    rank may be gone, and Finalize would wait for it; the process's exit ends the rank.
    ``who`` names the process in errors (e.g. "this Ray worker")."""
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError(
            f"{who} (pid {os.getpid()}) has already initialised MPI, so it cannot join a new MPI "
            f"world as rank {rank}.")
    os.environ.update(env)
    import mpi4py
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    got = (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    if got != (rank, size):
        raise RuntimeError(f"{who} joined the MPI world as rank {got[0]} of {got[1]}, expected "
                           f"rank {rank} of {size}")
