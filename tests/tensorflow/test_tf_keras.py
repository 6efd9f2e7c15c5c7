"""Horovod's Keras API under both Keras that ``tf.keras`` can be (issue 54):
tests/tensorflow/workers/tf_keras_api_worker.py at 2 and 3 ranks with Keras 2 through tf-keras
(``TF_USE_LEGACY_KERAS=1`` in the ranks' environment) and with Keras 3 (the default), one launch
per (Keras, rank count)."""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, assert_every_case_reported, case_failures

WORKER = "tensorflow/workers/tf_keras_api_worker.py"
BOTH = ["lr_schedule_momentum_correction", "local_variables", "elastic_callbacks",
        "fit_with_callbacks", "load_model", "keras_state", "tensorflow_state"]
CASES = {
    "keras2": (["keras_is_2"] + [f"step.{n}.{h}" for n in ("current", "legacy")
                                 for h in ("minimize", "tape", "tf.function")]
               + ["step.legacy._compute_gradients"]
               + [f"backward_passes.{n}.{m}" for n in ("current", "legacy")
                  for m in ("eager", "tf.function")]
               + ["graph_mode", "sparse_as_dense", "horovod_keras_mnist_script"] + BOTH),
    "keras3": (["keras_is_3", "step.current.tape", "backward_passes.current.eager",
                "backward_passes.current.tf.function"] + BOTH),
}
ENV = {"keras2": {**STALL_SAFETY_NET_ENV, "TF_USE_LEGACY_KERAS": "1"},
       "keras3": {**STALL_SAFETY_NET_ENV, "TF_USE_LEGACY_KERAS": "0"}}


def _needs(keras):
    if keras == "keras2":
        pytest.importorskip("tf_keras", reason="tf-keras is not installed (scripts/bootstrap.sh "
                                               "installs it)")


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("keras", ["keras2", "keras3"])
def test_every_case_reported(mpi_job, keras, np_):
    _needs(keras)
    assert_every_case_reported(mpi_job(np_, [WORKER], timeout=300, env=ENV[keras]), np_,
                               CASES[keras])


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("keras,case", [(k, c) for k in CASES for c in CASES[k]])
def test_case(mpi_job, keras, case, np_):
    _needs(keras)
    problems = case_failures(mpi_job(np_, [WORKER], timeout=300, env=ENV[keras]), case)
    assert not problems, "\n".join(problems)
