"""The fast submission path of named host allreduces, under real MPI launches (2 and 3 ranks):
taken once a dtype/op pair is known, correct, and no weaker in its checks."""
import pytest

from tests.mpi_harness import assert_case_passed, assert_every_case_reported
from tests.workers import core_cases as cc

CASES = ("fast.taken", "fast.checks", "fast.mismatch", "fast.group", "fast.group_checks")
WORKER = ["core/workers/core_fast_submit_worker.py"]


@pytest.mark.parametrize("np_", cc.NP_VALUES)
@pytest.mark.parametrize("case", CASES)
def test_fast_submit(mpi_job, np_, case):
    assert_case_passed(mpi_job(np_, WORKER, timeout=120), np_, case)


@pytest.mark.parametrize("np_", cc.NP_VALUES)
def test_every_case_reported(mpi_job, np_):
    assert_every_case_reported(mpi_job(np_, WORKER, timeout=120), np_, CASES)
