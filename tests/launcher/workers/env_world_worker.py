"""One rank of a job that torchrun, or a launcher following its env:// convention (a Kubeflow
PyTorchJob's pods), started: ``hvd.init()`` forms the world (issue 48).

Cases (each rank reports JSON, tests/workers/_report.py):

* ``identity``: hvd.rank() is RANK and hvd.size() is WORLD_SIZE in this very process (the one
  the launcher started: nothing is re-launched);
* ``topology``: local_rank/local_size/cross_rank/cross_size/is_homogeneous follow the hosts,
  by Horovod's definitions (ranks of one host form the local communicator, ordered by rank;
  ranks with the same local rank form the cross communicator), computed from every rank's
  host name gathered here;
* ``collectives``: allreduce (Sum, Average), allgather of uneven rows, broadcast from the last
  rank, alltoall, exact against numpy on every rank's deterministic input;
* ``process_set``: an allreduce on a dynamic set of ranks {0, size-1} ({size-1} at 2 ranks).
"""
import os
import socket

import numpy as np

import hvdlite as hvd
from tests.workers._report import Reporter

hvd.init(process_sets="dynamic")
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)
HOSTS = [h for h, _ in hvd.allgather_object((socket.gethostname(), RANK))]


def identity():
    want = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    assert (RANK, SIZE) == want, f"(rank, size) = {(RANK, SIZE)}, env says {want}"


def topology():
    mine = HOSTS[RANK]
    local = [q for q in range(SIZE) if HOSTS[q] == mine]
    local_rank = local.index(RANK)
    cross = [q for q in range(SIZE)
             if [p for p in range(SIZE) if HOSTS[p] == HOSTS[q]].index(q) == local_rank]
    sizes = {HOSTS.count(h) for h in HOSTS}
    want = (local_rank, len(local), cross.index(RANK), len(cross), len(sizes) == 1)
    got = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
           hvd.is_homogeneous())
    assert got == want, f"rank {RANK} on {mine}: {got}, expected {want} (hosts {HOSTS})"
    # torchrun's LOCAL_RANK is per agent: the same as hvdlite's when one agent runs per host
    # (two agents on one machine, as in the c10d test, share one host's local ranks).
    if os.environ.get("LOCAL_WORLD_SIZE") == str(hvd.local_size()):
        assert hvd.local_rank() == int(os.environ["LOCAL_RANK"])


def data(rank: int, n: int, tag: int) -> np.ndarray:
    return (np.arange(n, dtype=np.float64) * (rank + 1) + tag).astype(np.float32)


def collectives():
    n = 1000
    every = [data(q, n, 1) for q in range(SIZE)]
    got = hvd.allreduce(every[RANK], op=hvd.Sum, name="env.sum")
    np.testing.assert_array_equal(got, np.sum(every, axis=0, dtype=np.float32))
    got = hvd.allreduce(every[RANK], op=hvd.Average, name="env.avg")
    np.testing.assert_allclose(got, np.mean(every, axis=0), rtol=1e-6)
    rows = [np.full((q + 1, 3), q, dtype=np.int64) for q in range(SIZE)]
    np.testing.assert_array_equal(hvd.allgather(rows[RANK], name="env.gather"),
                                  np.concatenate(rows))
    root = SIZE - 1
    got = hvd.broadcast(data(RANK, 17, 2), root_rank=root, name="env.bcast")
    np.testing.assert_array_equal(got, data(root, 17, 2))
    send = np.arange(SIZE * 2, dtype=np.int32) + 100 * RANK
    got, received = hvd.alltoall(send, name="env.a2a")
    assert list(received) == [2] * SIZE, received
    want = np.concatenate([np.arange(SIZE * 2, dtype=np.int32)[2 * RANK:2 * RANK + 2] + 100 * q
                           for q in range(SIZE)])
    np.testing.assert_array_equal(got, want)


def process_set():
    members = [0, SIZE - 1] if SIZE > 2 else [SIZE - 1]   # never the global set's ranks
    ends = hvd.add_process_set(members)
    if RANK in members:
        got = hvd.allreduce(np.full(5, RANK + 1.0), op=hvd.Sum, name="env.set",
                            process_set=ends)
        np.testing.assert_array_equal(got, np.full(5, float(sum(q + 1 for q in members))))
    hvd.remove_process_set(ends)


r.case("identity", identity)
r.case("topology", topology)
r.case("collectives", collectives)
r.case("process_set", process_set)
r.write()
hvd.barrier()
hvd.shutdown()
