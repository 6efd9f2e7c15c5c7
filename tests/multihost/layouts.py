"""The simulated hosts and the rank layouts the multi-host tests use, with what Horovod's
definitions say each rank must see, written down by hand from the layout (not computed).

Launchers fill each host's slots in order: with ``-hosts a:3,b:1`` ranks 0-2 run on a, rank 3
on b.  Horovod (horovod/common/mpi/mpi_context.cc, CreateMPILocalAndCrossComm; mpi_controller.cc,
DoInitialization): the local communicator holds the ranks of one node (local_rank/local_size);
the cross communicator holds the ranks with the same local rank, ordered by rank
(cross_rank/cross_size); the job is homogeneous when every node has the same local size.
"""
from __future__ import annotations

import dataclasses
import json

from tests.multihost.hosts import Layout

HOST_NAMES = ("hvdnode1", "hvdnode2", "hvdnode3")
N1, N2, N3 = HOST_NAMES


@dataclasses.dataclass(frozen=True)
class Expected:
    layout: Layout
    # per rank: (host, local_rank, local_size, cross_rank, cross_size)
    ranks: list[tuple[str, int, int, int, int]]
    homogeneous: bool
    # process sets to register: name -> (ranks, whether they all share one host); "global"
    # stands for the global process set
    sets: dict[str, tuple[list[int], bool]]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def env(self) -> dict[str, str]:
        """HVDLITE_TEST_EXPECT for tests/multihost/workers/multihost_worker.py."""
        return {"HVDLITE_TEST_EXPECT": json.dumps(
            {"ranks": self.ranks, "homogeneous": self.homogeneous, "sets": self.sets})}


LAYOUTS = {
    "2+2": Expected(
        layout=((N1, 2), (N2, 2)),
        ranks=[(N1, 0, 2, 0, 2), (N1, 1, 2, 0, 2), (N2, 0, 2, 1, 2), (N2, 1, 2, 1, 2)],
        homogeneous=True,
        sets={"global": ([0, 1, 2, 3], False), "node1": ([0, 1], True),
              "node2": ([2, 3], True), "across": ([1, 2], False), "even": ([0, 2], False)}),
    "3+1": Expected(
        layout=((N1, 3), (N2, 1)),
        ranks=[(N1, 0, 3, 0, 2), (N1, 1, 3, 0, 1), (N1, 2, 3, 0, 1), (N2, 0, 1, 1, 2)],
        homogeneous=False,
        sets={"global": ([0, 1, 2, 3], False), "node1": ([0, 1, 2], True),
              "pair": ([1, 2], True), "across": ([2, 3], False), "ends": ([0, 3], False)}),
    "1+2+1": Expected(
        layout=((N1, 1), (N2, 2), (N3, 1)),
        ranks=[(N1, 0, 1, 0, 3), (N2, 0, 2, 1, 3), (N2, 1, 2, 0, 1), (N3, 0, 1, 2, 3)],
        homogeneous=False,
        sets={"global": ([0, 1, 2, 3], False), "node2": ([1, 2], True),
              "across": ([0, 1, 3], False)}),
}
