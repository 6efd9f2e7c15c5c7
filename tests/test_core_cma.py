"""Direct copies between ranks' memory (cross-memory attach) under real MPI launches (2 and 3
ranks): the collective fallback when one rank cannot make them, and a copy that fails in the
middle of an allreduce.  Their results for every dtype/op are checked by the steady-state worker
(steady.large_single) and, with a joined rank, by the join worker (join.direct.*)."""
import pytest

from tests.mpi_harness import assert_case_passed
from tests.workers import core_cases as cc


@pytest.mark.parametrize("np_", cc.NP_VALUES)
@pytest.mark.parametrize("mode,env", [
    ("refused", {}),
    ("refused", {"HVDLITE_CMA": "1"}),
    ("copy_fails", {}),
    ("peer_gone", {}),
])
def test_direct_copies(mpi_job, np_, mode, env):
    job = mpi_job(np_, ["core_cma_worker.py", mode], timeout=90, env=env)
    assert_case_passed(job, np_, f"cma.{mode}")
