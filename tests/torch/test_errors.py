"""hvdlite.torch error handling under real MPI launches (2 and 3 ranks): every rank must raise the
documented exception, and a collective right after it must still work
(see tests/torch/workers/torch_errors_worker.py)."""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV
from tests.torch.workers import torch_cases as C

WORKER = "torch/workers/torch_errors_worker.py"
TIMEOUT = 240


def _job(mpi_job, np):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env=STALL_SAFETY_NET_ENV)


@pytest.mark.parametrize("np", C.NP_VALUES)
def test_worker_reports_every_case(mpi_job, np):
    C.check_reported_cases(_job(mpi_job, np), np, C.ERROR_CASES)


@pytest.mark.parametrize("np, case", C.pytest_params(C.ERROR_CASES))
def test_errors(mpi_job, np, case):
    C.check_case(_job(mpi_job, np), np, case)
