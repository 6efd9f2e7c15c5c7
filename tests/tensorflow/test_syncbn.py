"""hvdlite.tensorflow.SyncBatchNormalization under real MPI launches at 2 and 3 ranks.

Every rank feeds its own (often differently sized) batch; the worker compares outputs,
gradients and moving statistics with one plain ``keras.layers.BatchNormalization`` applied to the
concatenation of all ranks' batches, and model.fit with DistributedOptimizer with one process
training on the global batch (see tests/tensorflow/workers/tf_syncbn_worker.py).  All cases run in
one launch per size (importing TensorFlow costs seconds per rank); each is checked here as its own
test.
"""
import pytest

from tests.mpi_harness import (STALL_SAFETY_NET_ENV, assert_case_passed,
                               assert_every_case_reported)
from tests.tensorflow.workers.tf_syncbn_cases import NP_VALUES, cases_for

pytest.importorskip("tensorflow")

WORKER = "tensorflow/workers/tf_syncbn_worker.py"
TIMEOUT = 300


def _job(mpi_job, np):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env=STALL_SAFETY_NET_ENV)


@pytest.mark.parametrize("np", NP_VALUES)
def test_worker_reports_every_case(mpi_job, np):
    assert_every_case_reported(_job(mpi_job, np), np, cases_for(np))


@pytest.mark.parametrize("np, case", [pytest.param(n, case, id=f"np{n}-{case}")
                                      for n in NP_VALUES for case in cases_for(n)])
def test_sync_batch_normalization(mpi_job, np, case):
    assert_case_passed(_job(mpi_job, np), np, case)
