"""Which host each rank runs on, for worker checks that depend on it: hvdlite's intra-node paths
(the shared-memory window, direct copies between the ranks' memory) serve a process set only
when all its ranks share a node.  The evidence is the host name: on one machine every rank has
the same, on the simulated hosts of tests/multihost each host has its own."""
from __future__ import annotations

import socket
from typing import Iterable


def host_of_rank(comm) -> list[str]:
    """Every rank's host name, indexed by its rank in ``comm`` (collective on ``comm``)."""
    return comm.allgather(socket.gethostname())


def on_one_node(hosts: list[str], ranks: Iterable[int]) -> bool:
    """Whether the ``ranks`` (indices into ``hosts``) all run on one host."""
    return len({hosts[rank] for rank in ranks}) == 1


class IntranodePaths:
    """An engine's two intra-node data paths' mechanisms, as the workers inspect them:
    ``shared`` (the shared-memory window, or None) and ``direct`` (the direct-copy allreduce,
    or None)."""

    def __init__(self, engine) -> None:
        self.shared = engine.path("shared_window").window
        self.direct = engine.path("direct_copies").direct


def intranode(engine) -> IntranodePaths:
    """The intra-node paths of ``engine`` (an hvdlite engine, e.g. ``state.engine()``)."""
    return IntranodePaths(engine)
