"""DistributedOptimizer(process_set=...) and DistributedOptimizer(op=Adasum) under real MPI
launches at 2, 3 and 4 ranks (see tests/torch/workers/torch_optimizer_sets_worker.py)."""
import pytest

from tests.mpi_harness import case_failures, check_job

WORKER = "torch/workers/torch_optimizer_sets_worker.py"
CASES = ["process_set_training", "non_member_local_optimizer", "adasum_training"]


@pytest.mark.parametrize("np_", [2, 3, 4])
@pytest.mark.parametrize("case", CASES)
def test_optimizer_with_sets_and_adasum(mpi_job, np_, case):
    job = mpi_job(np_, [WORKER], timeout=240)
    check_job(job, np_)
    assert not case_failures(job, case), "\n".join(case_failures(job, case))
