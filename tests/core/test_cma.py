"""Direct copies between ranks' memory (cross-memory attach) under real MPI launches (2 and 3
ranks): the collective fallback when one rank cannot make them, Yama's ptrace_scope 1 (each
rank lets in its launcher process), and a copy that fails in the middle of an allreduce.  Their
results for every dtype/op are checked by the steady-state worker (steady.large_single) and,
with a joined rank, by the join worker (join.direct.*)."""
import sys

import pytest

from tests.mpi_harness import TESTS, assert_case_passed
from tests.workers import core_cases as cc


@pytest.mark.parametrize("np_", cc.NP_VALUES)
@pytest.mark.parametrize("mode,env", [
    ("refused", {}),
    ("refused", {"HVDLITE_DIRECT_COPIES": "1"}),
    ("copy_fails", {}),
    ("peer_gone", {}),
    ("yama_prctl", {}),
    ("yama_declared", {}),
    ("yama_no_launcher", {}),
    ("yama_withdrawn", {}),
])
def test_direct_copies(mpi_job, np_, mode, env):
    job = mpi_job(np_, ["core/workers/core_cma_worker.py", mode], timeout=90, env=env)
    assert_case_passed(job, np_, f"cma.{mode}")


@pytest.mark.parametrize("np_", cc.NP_VALUES)
def test_yama_launcher_above_wrappers(mpi_job, tmp_path, np_):
    """Each rank under a wrapper process of its own (hvdlite run --output-filename's): the
    process every rank lets in is their common launcher, not a rank's own parent."""
    worker = str(TESTS / "core/workers/core_cma_worker.py")
    job = mpi_job(np_, [sys.executable, "-m", "hvdlite.runner.rank_output", str(tmp_path),
                        str(np_), sys.executable, worker, "yama_wrapped"], timeout=90)
    assert_case_passed(job, np_, "cma.yama_wrapped")


def test_yama_declaration_shared_by_process_sets(mpi_job):
    """One process declaration serves every process set (3 ranks: a pair set inside the
    global one); a set whose probe fails must not withdraw what the global set uses."""
    job = mpi_job(3, ["core/workers/core_cma_worker.py", "yama_sets"], timeout=90,
                  env={"HVDLITE_DYNAMIC_PROCESS_SETS": "1"})
    assert_case_passed(job, 3, "cma.yama_sets")
