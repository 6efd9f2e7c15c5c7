"""broadcast_parameters / broadcast_optimizer_state / broadcast_object / allgather_object under
real MPI launches (2 and 3 ranks).

Ranks start with different parameters, hyper-parameters and (possibly missing) optimizer state;
after broadcasting from root 0 or 1 every rank must hold exactly the root's state (rebuilt locally
as the reference) and keep training identically (see tests/torch/workers/torch_state_worker.py).
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV
from tests.torch.workers import torch_cases as C

WORKER = "torch/workers/torch_state_worker.py"
TIMEOUT = 240


def _job(mpi_job, np):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env=STALL_SAFETY_NET_ENV)


@pytest.mark.parametrize("np", C.NP_VALUES)
def test_worker_reports_every_case(mpi_job, np):
    C.check_reported_cases(_job(mpi_job, np), np, C.state_cases(np))


@pytest.mark.parametrize("np, case", C.pytest_params(C.state_cases))
def test_state_broadcast(mpi_job, np, case):
    C.check_case(_job(mpi_job, np), np, case)
