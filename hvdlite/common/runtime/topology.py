"""Where this process sits among the job's hosts: its rank on its host and its host's rank,
found the way Horovod finds them (MPI's shared-memory split, then a split by local rank)."""
from __future__ import annotations

import dataclasses

from hvdlite.common.runtime import liveness


@dataclasses.dataclass(frozen=True)
class Topology:
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool = True   # every host runs as many ranks (known once all ranks report)


def discover(world) -> Topology:
    """Collective over ``world``.  Also records the node-local peers' processes for the
    liveness check (:mod:`liveness`), which only ranks of one node can observe."""
    from mpi4py import MPI
    rank = world.Get_rank()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = local.Get_rank(), local.Get_size()
        liveness.record(local.allgather((rank, *liveness.own_identity())), rank)
    finally:
        local.Free()
    cross = world.Split(color=local_rank, key=rank)
    try:
        cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    finally:
        cross.Free()
    return Topology(local_rank, local_size, cross_rank, cross_size)
