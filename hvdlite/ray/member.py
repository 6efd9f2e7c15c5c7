"""One MPI world formed from processes that Ray started: the workers' side.

These functions run inside the Ray workers (actor processes), called by the driver through Ray
(see :mod:`hvdlite.ray.formation`).  They import neither Ray nor hvdlite's core: the worker's
process joins the world before ``hvd.init()`` runs in it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Optional, Sequence

PROXY_EXIT_WAIT_S = 2.0
_proxy: Optional[subprocess.Popen] = None
_release_path: Optional[str] = None


def describe() -> dict:
    """Where this worker runs: its Ray node (the world's host label), host name and pid, and
    whether it already belongs to an MPI world (initialised MPI or runs a proxy)."""
    import ray
    return {"node": ray.util.get_node_ip_address(), "node_id":
            ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
            "pid": os.getpid(), "in_a_world": "mpi4py.MPI" in sys.modules or _proxy is not None}


def start_proxy(command: Sequence[str], release_path: str) -> int:
    """Run this host's Hydra proxy (the command ``mpiexec -launcher manual`` printed); return
    its pid.  It starts this host's placeholders, whose environments the driver hands out;
    creating ``release_path`` ends them."""
    global _proxy, _release_path
    stop_proxy()
    _release_path = release_path
    _proxy = subprocess.Popen(list(command), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, start_new_session=True)
    return _proxy.pid


def stop_proxy() -> Optional[int]:
    """End this worker's proxy, if it runs one: release its placeholders (they exit 0, and
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
            pass
        proc.wait(PROXY_EXIT_WAIT_S)
    if release:
        try:
            os.unlink(release)
        except FileNotFoundError:
            pass
    return proc.pid


def join_world(env: dict, rank: int, size: int) -> dict:
    """Initialise MPI in this process as rank ``rank`` of the ``size``-rank world, from the PMI
    environment its placeholder received (blocks until every rank joins: call it on all
    workers at once).  ``MPI_Finalize`` is switched off: at exit the proxy that served this rank
    may be gone, and Finalize would wait for it; the process's exit ends the rank."""
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError(
            f"this Ray worker (pid {os.getpid()}) has already initialised MPI, so it cannot join "
            f"a new MPI world as rank {rank}; a Ray worker process serves one hvdlite job. Start "
            f"new workers (a new RayExecutor or Trainer run).")
    os.environ.update(env)
    import mpi4py
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    got = (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    if got != (rank, size):
        raise RuntimeError(f"this Ray worker joined the MPI world as rank {got[0]} of {got[1]}, "
                           f"expected rank {rank} of {size}")
    return {"rank": got[0], "size": got[1], "pid": os.getpid()}
