"""hvdlite.torch.DistributedOptimizer end to end under real MPI launches (2 and 3 ranks).

Each case trains a small MLP on per-rank shards and checks that parameters are bitwise identical
on every rank and match a single-process reference trained on the full batch inside the worker
(see tests/torch/workers/torch_optimizer_worker.py).
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV
from tests.torch.workers import torch_cases as C

WORKER = "torch/workers/torch_optimizer_worker.py"
TIMEOUT = 240


# Every case runs with gradient buckets (the default 25 MiB: after the first step the gradients
# of these models share one bucket) and without them (each gradient reduced on its own).
BUCKETS = {"buckets": {}, "per_gradient": {"HVDLITE_GRADIENT_BUCKET_MB": "0"}}


def _job(mpi_job, np, buckets="buckets"):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env={**STALL_SAFETY_NET_ENV, **BUCKETS[buckets]})


@pytest.mark.parametrize("buckets", list(BUCKETS))
@pytest.mark.parametrize("np", C.NP_VALUES)
def test_worker_reports_every_case(mpi_job, np, buckets):
    C.check_reported_cases(_job(mpi_job, np, buckets), np, C.OPTIMIZER_CASES)


@pytest.mark.parametrize("buckets", list(BUCKETS))
@pytest.mark.parametrize("np, case", C.pytest_params(C.OPTIMIZER_CASES))
def test_distributed_optimizer(mpi_job, np, case, buckets):
    C.check_case(_job(mpi_job, np, buckets), np, case)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_backward_streams_gradients_in_few_rounds(mpi_job, np):
    """tests/torch/workers/torch_stream_worker.py: streams close after every step, ranks agree, and
    at one rank the gradients take a few negotiation rounds per step, not one each."""
    job = mpi_job(np, ["torch/workers/torch_stream_worker.py"], timeout=TIMEOUT,
                  env={"HVDLITE_CYCLE_TIME": "100"})
    C.check_case(job, np, "streams_close_and_ranks_agree")


@pytest.mark.parametrize("np", [1, 2, 3])
def test_zero_grad_closes_an_unfinished_gradient_stream(mpi_job, np):
    job = mpi_job(np, ["torch/workers/torch_stream_worker.py"], timeout=TIMEOUT,
                  env={"HVDLITE_CYCLE_TIME": "100"})
    C.check_case(job, np, "zero_grad_closes_an_unfinished_stream")
