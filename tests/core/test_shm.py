"""Shared-memory fusion window edge cases under real MPI launches (2 and 3 ranks).  The window's
results for every dtype/op are checked by the steady-state worker (steady.shared_fusion)."""
import pytest

from tests.mpi_harness import assert_case_passed
from tests.workers import core_cases as cc


@pytest.mark.parametrize("np_", cc.NP_VALUES)
@pytest.mark.parametrize("mode,case", [
    ("no_space", "shm.no_space_falls_back"),
    ("space_runs_out", "shm.space_runs_out_frees_the_window"),
    ("reinit", "shm.reinit_gets_a_new_window"),
])
def test_shared_fusion_window(mpi_job, np_, mode, case):
    assert_case_passed(mpi_job(np_, ["core/workers/core_shm_worker.py", mode], timeout=90), np_,
                       case)
