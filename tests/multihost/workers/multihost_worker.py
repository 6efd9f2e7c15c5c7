"""Topology and intra-node paths of a job whose ranks span hosts (tests/multihost).

HVDLITE_TEST_EXPECT (JSON, from tests/multihost/layouts.py): per rank its host and (local_rank,
local_size, cross_rank, cross_size), whether the layout is homogeneous, and process sets, each
with its ranks and whether they all share one host ("global" is the global process set; the
others are registered at init).  Cases:

* ``placement``: this rank runs on the host the layout gives it (its host name);
* ``topology``: hvd.rank/size/local_rank/local_size/cross_rank/cross_size/is_homogeneous;
* ``paths.<set>``: on each set of two ranks or more, one fused batch of 3 x 120 KB and one
  4 MiB tensor, exact against numpy; hvdlite's intra-node paths (the shared-memory window of
  shm_fusion.py, direct copies of direct_allreduce.py) served them if and only if the set's ranks
  share one host.  The evidence is each path's own count of what it reduced: MPI between hosts
  leaves them at zero.
"""
import json
import os
import socket

import numpy as np

import hvdlite as hvd
from tests.workers.nodes import intranode  # noqa: E402
from hvdlite.common.runtime import registry
from tests.workers import core_cases as cc
from tests.workers.core_refs import allreduce_expected, check_array
from tests.workers._report import Reporter

EXPECT = json.loads(os.environ["HVDLITE_TEST_EXPECT"])
SETS = {name: hvd.ProcessSet(ranks) for name, (ranks, _) in EXPECT["sets"].items()
        if name != "global"}
hvd.init(process_sets=list(SETS.values()))
from mpi4py import MPI  # noqa: E402  (after init: under torchrun, init() forms the MPI world)
SETS["global"] = hvd.global_process_set
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)


def placement():
    host = EXPECT["ranks"][RANK][0]
    assert socket.gethostname() == host, f"rank {RANK} runs on {socket.gethostname()}, not {host}"


def topology():
    host, local_rank, local_size, cross_rank, cross_size = EXPECT["ranks"][RANK]
    got = (hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
           hvd.is_homogeneous())
    want = (len(EXPECT["ranks"]), local_rank, local_size, cross_rank, cross_size,
            EXPECT["homogeneous"])
    assert got == want, (f"rank {RANK} on {host}: (size, local_rank, local_size, cross_rank, "
                         f"cross_size, is_homogeneous) = {got}, expected {want}")


def values(tag: str, rank: int, n: int) -> np.ndarray:
    """Small integers as float32: every sum is exact, whatever order MPI adds in."""
    return cc.op_input(tag, rank, "float32", "Sum", (n,))


def paths(name: str) -> None:
    ranks, one_host = EXPECT["sets"][name]
    ps = SETS[name]
    backend = intranode(registry.process_set_engine(ps, "test")[0])
    shared, direct = backend.shared, backend.direct
    before = (shared.batches, shared.singles, direct.singles)
    tag = f"paths.{name}"
    group = [[values(f"{tag}.fused{i}", g, 30000) for g in ranks] for i in range(3)]
    got = hvd.grouped_allreduce([x[ranks.index(RANK)] for x in group], op=hvd.Sum,
                                name=tag + ".fused", process_set=ps)
    single = [values(tag + ".single", g, 1 << 20) for g in ranks]
    got_single = hvd.allreduce(single[ranks.index(RANK)], op=hvd.Sum, name=tag + ".single",
                               process_set=ps)
    for i, (x, g) in enumerate(zip(group, got)):
        check_array(f"{tag}: fused member {i}", g, allreduce_expected(x, "float32", "Sum",
                                                                      len(ranks)))
    check_array(f"{tag}: single 4 MiB", got_single,
                allreduce_expected(single, "float32", "Sum", len(ranks)))
    counts = (shared.batches - before[0], shared.singles - before[1],
              direct.singles - before[2])
    if one_host:   # the batch through the window; the tensor by direct copies where allowed
        by_copies = cc.direct_copies_expected(backend)
        want = (1, 0 if by_copies else 1, 1 if by_copies else 0)
    else:
        want = (0, 0, 0)
        assert "not all on one node" in (direct.unavailable_reason or ""), \
            f"direct copies refused for another reason: {direct.unavailable_reason}"
    assert counts == want, (f"{tag} ({'one host' if one_host else 'across hosts'}): "
                            f"(window batches, window singles, direct copies) = {counts}, "
                            f"expected {want}")


r.case("placement", placement)
r.case("topology", topology)
for set_name, (set_ranks, _) in EXPECT["sets"].items():
    if len(set_ranks) > 1 and RANK in set_ranks:
        r.case(f"paths.{set_name}", paths, set_name)
r.write()
MPI.COMM_WORLD.Barrier()   # ranks in fewer sets finish first: shut down together
hvd.shutdown()
