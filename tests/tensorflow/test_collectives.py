"""hvdlite.tensorflow's alltoall, reducescatter, grouped ops, join, process sets and Adasum under
real MPI launches: 2 and 3 ranks for everything, 4 ranks for Adasum.

One launch per rank count runs every case (see tests/tensorflow/workers/tf_collectives_worker.py);
each case is reported per rank and checked here as its own test.  The 2- and 3-rank launches
register the process sets of even and odd ranks at ``hvd.init`` and allow dynamic sets.
"""
import pytest

from tests.mpi_harness import assert_case_passed, assert_every_case_reported

pytest.importorskip("tensorflow")

WORKER = "tensorflow/workers/tf_collectives_worker.py"
TIMEOUT = 300
ENV = {"HVDLITE_DYNAMIC_PROCESS_SETS": "1"}

_PER_MODE = [
    "alltoall.even", "alltoall.uneven", "alltoall.grad",
    "reducescatter.ops", "reducescatter.grad",
    "grouped_allgather", "grouped_allgather.grad",
    "grouped_reducescatter", "grouped_reducescatter.grad",
    "grouped_allreduce", "grouped_allreduce.grad", "grouped_allreduce.flat",
    "join", "adasum", "process_set.ops", "process_set.tape",
]
MAIN_CASES = [f"{c}.{mode}" for mode in ("eager", "graph") for c in _PER_MODE] + [
    "alltoall.static_shapes",
    "alltoall.errors",
    "reducescatter.static_shape",
    "reducescatter.errors",
    "adasum.errors",
    "process_set.graph_naming",
    "process_set.errors",
    "process_set.keras_optimizer",
    "process_set.join",
    "process_set.dynamic",
]
ADASUM_CASES = ["adasum.eager", "adasum.graph", "adasum.errors"]

# (np, worker argv, cases)
JOBS = {2: ([WORKER], MAIN_CASES), 3: ([WORKER], MAIN_CASES), 4: ([WORKER, "adasum"], ADASUM_CASES)}


def _job(mpi_job, np):
    argv, _ = JOBS[np]
    return mpi_job(np, argv, timeout=TIMEOUT, env=ENV)


@pytest.mark.parametrize("np", sorted(JOBS))
def test_worker_reports_every_case(mpi_job, np):
    assert_every_case_reported(_job(mpi_job, np), np, JOBS[np][1])


@pytest.mark.parametrize("np, case", [(np, case) for np in sorted(JOBS) for case in JOBS[np][1]])
def test_tf_collectives(mpi_job, np, case):
    assert_case_passed(_job(mpi_job, np), np, case)
