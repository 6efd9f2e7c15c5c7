import os

import pytest

from tests.mpi_harness import run_job

# Ray reads this when it is imported: every node of the Ray tests' clusters then runs on
# 127.0.0.1 instead of the machine's network address, so their traffic stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
_jobs: dict = {}


@pytest.fixture(scope="session")
def mpi_job():
    """Run (and cache for the session) one MPI job per (np, argv, env): many cases per launch."""
    def get(np: int, argv: list[str], timeout: float = 180, env: dict | None = None):
        key = (np, tuple(argv), tuple(sorted((env or {}).items())))
        if key not in _jobs:
            _jobs[key] = run_job(np, argv, timeout=timeout, env=env)
        return _jobs[key]
    return get
