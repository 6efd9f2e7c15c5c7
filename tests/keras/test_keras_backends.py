"""``import hvdlite.keras as hvd`` with Keras 3 on the JAX and torch backends (issue #52):
tests/keras/workers/keras_backends_worker.py at 2 and 3 ranks, one launch per (backend, rank
count), every case reported per rank.  The TensorFlow backend is hvdlite.tensorflow.keras,
covered by tests/tensorflow/test_tf_keras.py.  Then an elastic Keras-JAX job that loses a rank
and resumes from its commit."""
import sys

import pytest

from tests.mpi_harness import (STALL_SAFETY_NET_ENV, TESTS, assert_every_case_reported,
                               case_failures, run_command)

WORKER = "keras/workers/keras_backends_worker.py"
ELASTIC_WORKER = "keras/workers/keras_elastic_worker.py"
HVDLITE_RUN = [sys.executable, "-m", "hvdlite.runner", "run"]
AT_THREE = ["backend", "collectives", "fit_step.compiled", "fit_with_callbacks.compiled",
            "fit_with_callbacks.eager", "elastic_callbacks", "keras_state_sync"]
AT_TWO = AT_THREE + ["backward_passes.compiled", "backward_passes.eager",
                     "backward_passes.average", "fit_step.eager", "compression_fp16",
                     "local_variables", "lr_schedule", "load_model"]
JAX_ONLY = ["mismatch_in_jit"]


def cases(backend: str, np_: int) -> list[str]:
    """The worker's cases at ``np_`` ranks (every one at 2, those that depend on the ranks'
    pairing at 3: see the worker)."""
    return (AT_TWO if np_ == 2 else AT_THREE) + (JAX_ONLY if backend == "jax" else [])


def _env(backend):
    pytest.importorskip(backend)
    return {**STALL_SAFETY_NET_ENV, "KERAS_BACKEND": backend}


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_every_case_reported(mpi_job, backend, np_):
    assert_every_case_reported(mpi_job(np_, [WORKER], timeout=300, env=_env(backend)), np_,
                               cases(backend, np_))


@pytest.mark.parametrize("backend,case,np_", [(b, c, n) for b in ("jax", "torch")
                                               for n in (2, 3) for c in cases(b, n)])
def test_case(mpi_job, backend, case, np_):
    problems = case_failures(mpi_job(np_, [WORKER], timeout=300, env=_env(backend)), case)
    assert not problems, "\n".join(problems)


def test_elastic_reset_in_jit_on_jax():
    """tests/keras/workers/keras_elastic_worker.py as an elastic job of two "hosts" (two names
    of this machine): rank 1 is SIGKILLed in the first world, rank 0's next allreduce inside the
    jitted step fails, and the job finishes in a second world alone, from the last commit, with
    the numpy reference's weights."""
    env = _env("jax")
    job = run_command(HVDLITE_RUN + ["-np", "2", "--min-np", "1", "--max-np", "2",
                                     "-H", "localhost:1,127.0.0.1:1",
                                     sys.executable, str(TESTS / ELASTIC_WORKER)],
                      1, timeout=300, env=env)   # 1: the report of the last world
    assert job.returncode == 0, job.output
    assert "world 1: 1 rank(s)" in job.stderr, job.output
    assert len(job.results) == 1, job.output   # world 1's rank 0 (world 0's wrote none)
    assert job.results[0] == {"elastic_reset_in_jit": None}, job.results[0]
