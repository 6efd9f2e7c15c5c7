"""hvdlite.jax under real MPI launches at 2 and 3 ranks: every collective (eagerly and inside
jax.jit), gradients, mismatches raising hvdlite's errors in jit (no hang), jit ordering and
naming, DistributedOptimizer (parameters bitwise identical across ranks, against a one-process
optax reference), broadcast_parameters, elastic state and the timeline.

One launch per rank count runs every case (tests/jax/workers/jax_worker.py); each case is
reported per rank and checked here as its own test.  The launches register the process sets of
even and odd ranks at ``hvd.init``.
"""
import pytest

from tests.jax.workers.jax_cases import CASES, NP_VALUES
from tests.mpi_harness import (STALL_SAFETY_NET_ENV, assert_case_passed,
                               assert_every_case_reported)

pytest.importorskip("jax")
pytest.importorskip("optax")

WORKER = "jax/workers/jax_worker.py"
TIMEOUT = 240


def _job(mpi_job, np):
    return mpi_job(np, [WORKER], timeout=TIMEOUT, env=STALL_SAFETY_NET_ENV)


@pytest.mark.parametrize("np", NP_VALUES)
def test_worker_reports_every_case(mpi_job, np):
    assert_every_case_reported(_job(mpi_job, np), np, CASES)


@pytest.mark.parametrize("np, case", [(np, case) for np in NP_VALUES for case in CASES])
def test_jax_case(mpi_job, np, case):
    assert_case_passed(_job(mpi_job, np), np, case)
