"""hvdlite.tensorflow against Horovod's TensorFlow semantics (issue 33) under real MPI launches
at 2 and 3 ranks: gradients of every differentiable collective in TF1 sessions, tf.function (tape
inside, and tape outside around a traced forward) and eagerly; tf.IndexedSlices; error classes;
in-place broadcast and the TF1 optimizer in sessions; process-set non-members.

One launch per rank count runs every case (see tests/tensorflow/workers/tf_fidelity_worker.py); each
case is reported per rank and checked here as its own test.
"""
import os
import subprocess
import sys

import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, assert_case_passed, assert_every_case_reported
from tests.tensorflow.workers.tf_fidelity_cases import CASES, NP_VALUES

pytest.importorskip("tensorflow")

WORKER = "tensorflow/workers/tf_fidelity_worker.py"
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


NOT_INITIALIZED = """
import tensorflow as tf
import hvdlite.tensorflow as hvd
calls = [lambda: hvd.allreduce(tf.ones([2])), lambda: hvd.allgather(tf.ones([2])),
         lambda: hvd.broadcast(tf.ones([2]), 0), lambda: hvd.alltoall(tf.ones([2])),
         lambda: hvd.rank_op(), lambda: hvd.size_op()]
for graph in (False, True):
    for call in calls:
        try:
            tf.function(call)() if graph else call()
        except tf.errors.FailedPreconditionError as exc:
            assert isinstance(exc, ValueError) and "hvd.init()" in str(exc), exc
        else:
            raise AssertionError("no error before hvd.init()")
print("ok")
"""


def test_ops_before_init_raise_horovods_class():
    """Horovod's ops fail with FailedPreconditionError before hvd.init() (its Python allreduce
    with a ValueError): hvdlite's error is both, eagerly and while tracing."""
    proc = subprocess.run([sys.executable, "-c", NOT_INITIALIZED], capture_output=True,
                          text=True, timeout=180, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
