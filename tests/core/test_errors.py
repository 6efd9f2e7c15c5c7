"""Error cases under real MPI launches (2 and 3 ranks): every error reaches the right ranks with
a useful message and the job keeps working afterwards (tests/core/workers/core_errors_worker.py)."""
import pytest

from tests.mpi_harness import assert_case_passed
from tests.workers import core_cases as cc


@pytest.mark.parametrize("np_", cc.NP_VALUES)
@pytest.mark.parametrize("case", cc.ERROR_CASES)
def test_errors(mpi_job, np_, case):
    job = mpi_job(np_, ["core/workers/core_errors_worker.py"], timeout=120)
    assert_case_passed(job, np_, case)
