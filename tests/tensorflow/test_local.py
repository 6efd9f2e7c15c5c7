"""Model-parallel local variables (PartialDistributedGradientTape / PartialDistributedOptimizer,
register_local_source / register_local_var, BroadcastGlobalVariablesCallback(local_variables)),
broadcast_object_fn, object collectives on process sets and BestModelCheckpoint, under real MPI
launches at 2 and 3 ranks (one launch per size; every case reported per rank)."""
import pytest

from tests.mpi_harness import assert_case_passed
from tests.tensorflow.workers.tf_local_cases import CASES, NP_VALUES

pytest.importorskip("tensorflow")


@pytest.mark.parametrize("np", NP_VALUES)
@pytest.mark.parametrize("case", CASES)
def test_tf_local(mpi_job, np, case):
    job = mpi_job(np, ["tensorflow/workers/tf_local_worker.py"], timeout=240)
    assert_case_passed(job, np, case)
