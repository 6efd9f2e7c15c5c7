"""init/shutdown/topology queries under a real MPI launch."""
import pytest

from tests.mpi_harness import case_failures, check_job

CASES = ["before_init_raises", "topology", "shutdown_then_op", "reinit"]


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_topology(mpi_job, np, case):
    job = mpi_job(np, ["core/workers/topology_worker.py"])
    check_job(job, np)
    assert not case_failures(job, case), "\n".join(case_failures(job, case))
