"""alltoall, reducescatter, grouped ops and op-level Adasum under real MPI launches (2, 3, 4 ranks).

One launch of tests/core/workers/core_collectives_worker.py per rank count runs every case against
numpy references; each case is its own test here, and one more test per rank count checks that
every rank reported exactly the expected cases.
"""
import pytest

from tests.mpi_harness import assert_case_passed, assert_every_case_reported
from tests.core.workers.core_collectives_worker import cases_for

NP_VALUES = (2, 3, 4)
TIMEOUT = 300   # generous: the test machine is small and shared


def _job(mpi_job, np_):
    return mpi_job(np_, ["core/workers/core_collectives_worker.py"], timeout=TIMEOUT)


def _params():
    return [pytest.param(n, case, id=f"np{n}-{case}") for n in NP_VALUES for case in cases_for(n)]


@pytest.mark.parametrize("np_,case", _params())
def test_collectives(mpi_job, np_, case):
    job = _job(mpi_job, np_)
    assert_case_passed(job, np_, case)


@pytest.mark.parametrize("np_", NP_VALUES)
def test_every_case_reported(mpi_job, np_):
    job = _job(mpi_job, np_)
    assert_every_case_reported(job, np_, cases_for(np_))
