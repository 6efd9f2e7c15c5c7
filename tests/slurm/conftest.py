"""The SLURM cluster fixture (see cluster.py).  Where SLURM cannot run the tests are skipped
with the reason; with HVDLITE_TEST_REQUIRE_SLURM=1 (.ci/run sets it after installing SLURM)
that is a failure instead."""
import os

import pytest

from tests.slurm.cluster import Cluster, ClusterUnavailable, missing


def _unavailable(reason: str) -> None:
    message = f"SLURM tests need a local SLURM: {reason}"
    if os.environ.get("HVDLITE_TEST_REQUIRE_SLURM") == "1":
        pytest.fail(message + " (HVDLITE_TEST_REQUIRE_SLURM=1)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def slurm():
    reason = missing()
    if reason:
        _unavailable(reason)
    cluster = Cluster()
    try:
        cluster.start()
    except (ClusterUnavailable, OSError) as exc:
        cluster.stop()
        _unavailable(str(exc))
    yield cluster
    problems = cluster.stop()
    assert not problems, "stopping SLURM: " + "; ".join(problems)
