"""hvdlite.tensorflow against Horovod's TensorFlow semantics (issue 33) under real MPI launches
at 2 and 3 ranks: gradients of every differentiable collective in TF1 sessions, tf.function (tape
inside, and tape outside around a traced forward) and eagerly; tf.IndexedSlices; error classes;
in-place broadcast and the TF1 optimizer in sessions; process-set non-members.

One launch per rank count runs every case (see tests/workers/tf_fidelity_worker.py); each case
is reported per rank and checked here as its own test.
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, assert_case_passed, assert_every_case_reported
from tests.workers.tf_fidelity_cases import CASES, NP_VALUES

pytest.importorskip("tensorflow")

WORKER = "tf_fidelity_worker.py"
TIMEOUT = 420


def _job(mpi_job, np):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env=STALL_SAFETY_NET_ENV)


@pytest.mark.parametrize("np", NP_VALUES)
def test_worker_reports_every_case(mpi_job, np):
    assert_every_case_reported(_job(mpi_job, np), np, CASES)


@pytest.mark.parametrize("np", NP_VALUES)
@pytest.mark.parametrize("case", CASES)
def test_tf_fidelity(mpi_job, np, case):
    assert_case_passed(_job(mpi_job, np), np, case)
