"""DistributedOptimizer(compression=Compression.powersgd(...)) under real MPI launches at 2 and 3
ranks: exact against a numpy reference, bitwise identical across ranks, composed with Sum,
backward_passes_per_step, process sets, fp16 factors and join (see
tests/torch/workers/torch_powersgd_worker.py)."""
import pytest

from tests.mpi_harness import case_failures, check_job

WORKER = "torch/workers/torch_powersgd_worker.py"
CASES = ["average_exact", "sum_exact", "no_warm_start_no_error_feedback", "passes_per_step",
         "process_set", "fp16_factors", "adasum_refused", "join_then_continue"]


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_powersgd(mpi_job, np_, case):
    job = mpi_job(np_, [WORKER], timeout=180)
    check_job(job, np_)
    assert not case_failures(job, case), "\n".join(case_failures(job, case))


def test_digits_example_powersgd_reaches_uncompressed_accuracy():
    """examples/pytorch_digits.py at 2 ranks, 20 epochs: PowerSGD (rank 2) within one point of
    the uncompressed run's test accuracy."""
    import re
    import sys

    from tests.mpi_harness import REPO, run_job

    accuracies = {}
    for compression in ("none", "powersgd"):
        job = run_job(2, [sys.executable, str(REPO / "examples" / "pytorch_digits.py"),
                          "--epochs", "20", "--checkpoint", "", "--compression", compression],
                      timeout=240)
        assert not job.timed_out and job.returncode == 0, job.output
        accuracies[compression] = float(re.findall(r"test accuracy: ([0-9.]+)", job.stdout)[-1])
    assert accuracies["powersgd"] >= accuracies["none"] - 0.01, accuracies
