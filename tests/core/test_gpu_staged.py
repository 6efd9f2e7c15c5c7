"""The GPU data path without a GPU, under real MPI launches (2 and 3 ranks).

tests/core/workers/gpu_staged_worker.py runs the host-staged backend (HVDLITE_GPU_OPERATIONS=mpi)
over the loopback runtime (tests/workers/gpu_loopback.py): every collective, op and dtype on
"device" arrays against numpy references, fusion of device entries, join, grouped operations,
process sets, CPU-vs-GPU mismatches and the one-GPU-per-process check.
tests/core/workers/gpu_errors_worker.py runs with the default HVDLITE_GPU_OPERATIONS (nccl) where
NCCL (or CuPy) is missing: GPU tensors fail at submission with an error saying what to do, and CPU
work goes on.  One launch per rank count and worker; each case is its own test here.
"""
import pytest

from tests.mpi_harness import (STALL_SAFETY_NET_ENV, assert_case_passed,
                               assert_every_case_reported)
from tests.core.workers import gpu_errors_worker, gpu_staged_worker

TIMEOUT = 240   # generous: the test machine is small and shared
STAGED_ENV = {"HVDLITE_GPU_OPERATIONS": "mpi", **STALL_SAFETY_NET_ENV}
ERRORS_NP = 2


# Each job's env: the default (asynchronous completion), and handles that complete only after
# the device work (HVDLITE_ENABLE_ASYNC_COMPLETION=0) at 2 ranks.
JOBS = {"np2": (2, {}), "np3": (3, {}),
        "np2-sync": (2, {"HVDLITE_ENABLE_ASYNC_COMPLETION": "0"})}


def _staged(mpi_job, job):
    np_, extra = JOBS[job]
    return mpi_job(np_, ["core/workers/gpu_staged_worker.py"], timeout=TIMEOUT,
                   env={**STAGED_ENV, **extra})


def _errors(mpi_job):
    return mpi_job(ERRORS_NP, ["core/workers/gpu_errors_worker.py"], timeout=TIMEOUT,
                   env=STALL_SAFETY_NET_ENV)


@pytest.mark.parametrize("job,case", [pytest.param(j, c, id=f"{j}-{c}") for j in JOBS
                                      for c in gpu_staged_worker.cases_for(JOBS[j][0])])
def test_staged(mpi_job, job, case):
    assert_case_passed(_staged(mpi_job, job), JOBS[job][0], case)


@pytest.mark.parametrize("job", list(JOBS))
def test_staged_every_case_reported(mpi_job, job):
    np_ = JOBS[job][0]
    assert_every_case_reported(_staged(mpi_job, job), np_, gpu_staged_worker.cases_for(np_))


@pytest.mark.parametrize("case", gpu_errors_worker.cases())
def test_gpu_unavailable(mpi_job, case):
    assert_case_passed(_errors(mpi_job), ERRORS_NP, case)


def test_gpu_unavailable_every_case_reported(mpi_job):
    assert_every_case_reported(_errors(mpi_job), ERRORS_NP, gpu_errors_worker.cases())
