"""examples/ray_digits.py: the digits model trained with HvdliteTrainer on 2 Ray workers (the
script starts and stops its own local Ray cluster)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="hvdlite.ray needs Ray: pip install 'hvdlite[ray]'")
pytest.importorskip("sklearn")

from tests.ray.procs import REPO, launcher_processes  # noqa: E402


@pytest.mark.timeout(240)
def test_ray_digits_reaches_accuracy(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled",
               RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5")
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "ray_digits.py"), "--num-workers", "2",
         "--num-cpus", "2", "--epochs", "5", "--min-accuracy", "0.9",
         "--storage-path", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test accuracy: " in done.stdout and "after 5 epochs on 2 workers" in done.stdout
    assert launcher_processes() == []
