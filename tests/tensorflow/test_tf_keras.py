"""Keras 2 code through tf-keras (issue 54): tests/tensorflow/workers/tf_keras2_worker.py under
``TF_USE_LEGACY_KERAS=1`` at 2 and 3 ranks, one launch per rank count (the Keras 3 tests in
this folder run the same API on Keras 3)."""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, assert_every_case_reported, case_failures

pytest.importorskip("tf_keras", reason="tf-keras is not installed (scripts/bootstrap.sh "
                                       "installs it)")
WORKER = "tensorflow/workers/tf_keras2_worker.py"
CASES = (["keras_is_2"] + [f"step.{n}.{h}" for n in ("current", "legacy")
                           for h in ("minimize", "tape", "tf.function")]
         + ["step.legacy._compute_gradients"]
         + [f"backward_passes.{n}.{m}" for n in ("current", "legacy")
            for m in ("eager", "tf.function")]
         + ["graph_mode", "lr_schedule_momentum_correction", "local_variables",
            "elastic_callbacks", "sparse_as_dense", "fit_with_callbacks", "load_model",
            "keras_state"])
ENV = {**STALL_SAFETY_NET_ENV, "TF_USE_LEGACY_KERAS": "1"}


@pytest.mark.parametrize("np_", [2, 3])
def test_every_case_reported(mpi_job, np_):
    assert_every_case_reported(mpi_job(np_, [WORKER], timeout=300, env=ENV), np_, CASES)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("np_", [2, 3])
def test_case(mpi_job, np_, case):
    problems = case_failures(mpi_job(np_, [WORKER], timeout=300, env=ENV), case)
    assert not problems, "\n".join(problems)
