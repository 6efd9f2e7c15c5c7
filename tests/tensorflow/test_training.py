"""TF / Keras training setups that need every rank to take the same decision (Keras mixed
precision's overflow check), under real MPI launches at 2 and 3 ranks (one launch per size;
every case reported per rank)."""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, assert_case_passed
from tests.tensorflow.workers.tf_training_cases import CASES, NP_VALUES

pytest.importorskip("tensorflow")


@pytest.mark.parametrize("np", NP_VALUES)
@pytest.mark.parametrize("case", CASES)
def test_tf_training(mpi_job, np, case):
    job = mpi_job(np, ["tensorflow/workers/tf_training_worker.py"], timeout=240,
                  env=STALL_SAFETY_NET_ENV)
    assert_case_passed(job, np, case)
