"""hvdlite.torch collectives under real MPI launches (2 and 3 ranks).

Every op x dtype x shape, in place / out of place / async, non-contiguous inputs, prescale and
postscale, broadcast from every root, uneven allgather, compression and autograd; each rank checks
the result against a torch reference built from every rank's deterministic input.  One launch per
rank count runs every case (see tests/torch/workers/torch_ops_worker.py).
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV
from tests.torch.workers import torch_cases as C

WORKER = "torch/workers/torch_ops_worker.py"
TIMEOUT = 300


def _job(mpi_job, np):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env=STALL_SAFETY_NET_ENV)


@pytest.mark.parametrize("np", C.NP_VALUES)
def test_worker_reports_every_case(mpi_job, np):
    C.check_reported_cases(_job(mpi_job, np), np, C.ops_cases(np))


@pytest.mark.parametrize("np, case", C.pytest_params(C.ops_cases))
def test_torch_ops(mpi_job, np, case):
    C.check_case(_job(mpi_job, np), np, case)
