"""One MPI world formed from processes that Ray started: the workers' side.

These functions run inside the Ray workers (actor processes), called by the driver through Ray
(see :mod:`hvdlite.ray.formation`).  The worker's process joins the world before
``hvd.init()`` runs in it.  The proxy and the join
are :mod:`hvdlite.common.runtime.hydra_member`'s, shared with the torchrun formation.
"""
from __future__ import annotations

import os
import socket
import sys

from hvdlite.common.core import hydra_member

start_proxy = hydra_member.start_proxy
stop_proxy = hydra_member.stop_proxy

__all__ = ["describe", "start_proxy", "stop_proxy", "join_world"]


def describe() -> dict:
    """Where this worker runs: its Ray node (the world's host label), host name and pid, and
    whether it already belongs to an MPI world (initialised MPI or runs a proxy)."""
    import ray
    return {"node": ray.util.get_node_ip_address(), "node_id":
            ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "in_a_world": "mpi4py.MPI" in sys.modules or hydra_member.proxy_pid() is not None}


def join_world(env: dict, rank: int, size: int) -> dict:
    """Join the world as rank ``rank`` of ``size`` (see ``hydra_member.join_world``)."""
    hydra_member.join_world(env, rank, size, "this Ray worker; a Ray worker process serves one "
                                              "hvdlite job (start new workers: a new "
                                              "RayExecutor or Trainer run)")
    return {"rank": rank, "size": size, "pid": os.getpid()}
