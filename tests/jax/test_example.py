"""examples/jax_digits.py reaches the PyTorch example's accuracy bar at 2 ranks (a shorter
schedule than its default: 10 epochs already pass the bar) and writes its checkpoint."""
import re
import sys

import pytest

from tests.mpi_harness import REPO, run_job

pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("sklearn")


def _accuracy(stdout: str) -> float:
    found = re.findall(r"test accuracy:? ([0-9.]+)", stdout)
    assert found, f"no test accuracy printed:\n{stdout[-3000:]}"
    return float(found[-1])


def test_jax_digits_reaches_accuracy(tmp_path):
    ckpt = tmp_path / "digits.pkl"
    script = str(REPO / "examples" / "jax_digits.py")
    job = run_job(2, [sys.executable, script, "--epochs", "10", "--min-accuracy", "0.95",
                      "--checkpoint", str(ckpt)], timeout=240)
    assert not job.timed_out and job.returncode == 0, job.output
    assert _accuracy(job.stdout) >= 0.95
    assert ckpt.exists()
