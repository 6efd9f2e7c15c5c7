"""The names hvdlite.tensorflow traces (graph nodes, their order, registered gradients, the
names collectives are matched by) stay exactly as pinned, under real MPI launches at 2 and 3
ranks; see tests/tensorflow/workers/tf_trace_names_worker.py."""
import pytest

from tests.mpi_harness import assert_case_passed, assert_every_case_reported
from tests.tensorflow.workers.tf_trace_names_cases import CASES, NP_VALUES

pytest.importorskip("tensorflow")


def _job(mpi_job, np):
    return mpi_job(np, ["tensorflow/workers/tf_trace_names_worker.py"], timeout=240)


@pytest.mark.parametrize("np", NP_VALUES)
def test_every_case_reported(mpi_job, np):
    assert_every_case_reported(_job(mpi_job, np), np, CASES)


@pytest.mark.parametrize("np", NP_VALUES)
@pytest.mark.parametrize("case", CASES)
def test_tf_trace_names(mpi_job, np, case):
    assert_case_passed(_job(mpi_job, np), np, case)
