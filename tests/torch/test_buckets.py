"""DistributedOptimizer's gradient buckets under real MPI launches at 2 and 3 ranks.

The worker (tests/torch/workers/torch_buckets_worker.py) runs with a 2 KiB bucket cap so that its
small models fill several buckets; tests/torch/test_optimizer.py runs every optimizer case both with
the default buckets and with buckets off.
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV
from tests.torch.workers import torch_cases as C

WORKER = "torch/workers/torch_buckets_worker.py"
TIMEOUT = 240
ENV = {**STALL_SAFETY_NET_ENV, "HVDLITE_GRADIENT_BUCKET_MB": "0.002"}


def _job(mpi_job, np):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env=ENV)


@pytest.mark.parametrize("np", C.NP_VALUES)
def test_worker_reports_every_case(mpi_job, np):
    C.check_reported_cases(_job(mpi_job, np), np, C.BUCKET_CASES)


@pytest.mark.parametrize("np, case", C.pytest_params(C.BUCKET_CASES))
def test_gradient_buckets(mpi_job, np, case):
    C.check_case(_job(mpi_job, np), np, case)
