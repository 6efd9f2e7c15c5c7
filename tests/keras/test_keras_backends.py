"""``import hvdlite.keras as hvd`` with Keras 3 on the JAX and torch backends (issue #52):
tests/keras/workers/keras_backends_worker.py at 2 and 3 ranks, one launch per (backend, rank
count), every case reported per rank.  The TensorFlow backend is hvdlite.tensorflow.keras,
covered by tests/tensorflow/test_tf_keras.py."""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, assert_every_case_reported, case_failures

WORKER = "keras/workers/keras_backends_worker.py"
COMMON = (["backend", "collectives"]
          + [f"{c}.{how}" for how in ("compiled", "eager")
             for c in ("fit_step", "fit_with_callbacks", "backward_passes")]
          + ["backward_passes.average", "compression_fp16", "local_variables", "lr_schedule",
             "elastic_callbacks", "keras_state_sync", "load_model"])
CASES = {"jax": COMMON + ["mismatch_in_jit"], "torch": COMMON}


def _env(backend):
    pytest.importorskip(backend)
    return {**STALL_SAFETY_NET_ENV, "KERAS_BACKEND": backend}


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("backend", sorted(CASES))
def test_every_case_reported(mpi_job, backend, np_):
    assert_every_case_reported(mpi_job(np_, [WORKER], timeout=300, env=_env(backend)), np_,
                               CASES[backend])


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("backend,case", [(b, c) for b in sorted(CASES) for c in CASES[b]])
def test_case(mpi_job, backend, case, np_):
    problems = case_failures(mpi_job(np_, [WORKER], timeout=300, env=_env(backend)), case)
    assert not problems, "\n".join(problems)
