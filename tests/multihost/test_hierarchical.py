"""Hierarchical allreduce and allgather across simulated hosts (issue 35, item 5): every op,
dtype and kind of batch exact against numpy, scaling, joined ranks standing in, process sets
spanning hosts, hosts that reduce within themselves differently, on homogeneous (2+2) and
heterogeneous (3+1, 1+2+1) layouts; the path's counters show it ran (see
tests/multihost/workers/multihost_hier_worker.py).  One launch per layout."""
import json

import pytest

from tests.mpi_harness import case_failures
from tests.multihost.hosts import check_host_job
from tests.multihost.layouts import LAYOUTS
from tests.multihost.workers.multihost_hier_worker import cases

TIMEOUT = 300
# per layout: the global ranks on each host, and a process set spanning hosts with two ranks
# on one of them (written down from the layouts: each host's slots are filled in order)
EXPECT = {
    "2+2": {"hosts": [[0, 1], [2, 3]], "subset": [0, 1, 2]},
    "3+1": {"hosts": [[0, 1, 2], [3]], "subset": [1, 2, 3]},
    "1+2+1": {"hosts": [[0], [1, 2], [3]], "subset": [0, 1, 2]},
}
ENV = {"HVDLITE_HIERARCHICAL_ALLREDUCE": "1", "HVDLITE_HIERARCHICAL_ALLGATHER": "1"}
CASES = cases()


def _job(host_job, key: str):
    env = {**ENV, "HVDLITE_TEST_EXPECT": json.dumps(EXPECT[key])}
    return host_job(LAYOUTS[key].layout, ["multihost/workers/multihost_hier_worker.py"],
                    timeout=TIMEOUT, env=env)


@pytest.mark.parametrize("key", sorted(EXPECT))
def test_job_ends_cleanly_and_reports_every_case(host_job, key):
    job = _job(host_job, key)
    check_host_job(job, 4)
    for rank, report in enumerate(job.results):
        assert sorted(report) == sorted(CASES), f"rank {rank}: cases differ\n{job.output}"


@pytest.mark.parametrize("key", sorted(EXPECT))
@pytest.mark.parametrize("case", CASES)
def test_case(host_job, key, case):
    job = _job(host_job, key)
    problems = case_failures(job, case)
    if len(job.results) < 4:
        problems.append(f"only {len(job.results)} of 4 ranks reported\n{job.output}")
    assert not problems, "\n".join(problems)


def test_a_failed_direct_copy_fails_the_allreduce_on_every_host(host_job):
    """A direct copy fails on one rank: its host's share is incomplete, and the other host
    received it, so every rank raises naming that rank (none returns a wrong result).  The
    engine stops then and frees no shared-memory window (its peers may be gone), which MPICH's
    OFI netmod turns into an abort at MPI_Finalize unless its RMA support is off."""
    env = {**ENV, "HVDLITE_TEST_EXPECT": json.dumps(EXPECT["2+2"]),
           "MPIR_CVAR_CH4_OFI_ENABLE_RMA": "0"}
    job = host_job(LAYOUTS["2+2"].layout, ["multihost/workers/multihost_hier_worker.py",
                                           "copy_fails"], timeout=120, env=env)
    check_host_job(job, 4)
    problems = case_failures(job, "copy_fails")
    assert not problems, "\n".join(problems)
