import pytest

from tests.mpi_harness import run_job

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
