"""Early reductions (hvdlite/common/engine/early.py) under real MPI launches (2 and 3 ranks):
taken for small allreduces that run alone in a repeating order, the same bits as the usual path,
and dropped whenever a rank has not contributed."""
import pytest

from tests.mpi_harness import assert_case_passed, assert_every_case_reported
from tests.workers import core_cases as cc

CASES = tuple(f"early.{dt}" for dt in cc.DTYPES) + (
    "early.loop", "early.bits", "early.misses", "early.join", "early.off_and_large",
    "early.process_set")
WORKER = ["core/workers/core_early_worker.py"]


@pytest.mark.parametrize("np_", cc.NP_VALUES)
@pytest.mark.parametrize("case", CASES)
def test_early_reductions(mpi_job, np_, case):
    assert_case_passed(mpi_job(np_, WORKER, timeout=180), np_, case)


@pytest.mark.parametrize("np_", cc.NP_VALUES)
def test_every_case_reported(mpi_job, np_):
    assert_every_case_reported(mpi_job(np_, WORKER, timeout=180), np_, CASES)
