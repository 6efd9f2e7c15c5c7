"""hvdlite.tensorflow and hvdlite.tensorflow.keras under real MPI launches at 2 and 3 ranks.

All cases run in one launch per size (importing TensorFlow costs seconds per rank); each case is
reported per rank and checked here as its own test.
"""
import pytest

from tests.mpi_harness import case_failures, check_job
from tests.tensorflow.workers.tf_cases import CASES, NP_VALUES

pytest.importorskip("tensorflow")


@pytest.mark.parametrize("np", NP_VALUES)
@pytest.mark.parametrize("case", CASES)
def test_tf(mpi_job, np, case):
    job = mpi_job(np, ["tensorflow/workers/tf_worker.py"], timeout=240)
    check_job(job, np)
    assert not case_failures(job, case), "\n".join(case_failures(job, case))
