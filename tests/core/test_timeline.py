"""Horovod Timeline under real MPI launches (2 and 3 ranks): HOROVOD_TIMELINE at init, and
hvd.start_timeline / hvd.stop_timeline (tests/core/workers/core_timeline_worker.py)."""
import pytest

from tests.mpi_harness import assert_case_passed
from tests.workers import core_cases as cc


@pytest.mark.parametrize("np_", cc.NP_VALUES)
@pytest.mark.parametrize("case", ["timeline.env.operations", "timeline.env.file"])
def test_timeline_from_environment(mpi_job, tmp_path_factory, np_, case):
    # one job per rank count, shared by its cases (mpi_job caches by argv and env)
    path = tmp_path_factory.getbasetemp() / f"timeline-env-{np_}.json"
    env = {"HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    job = mpi_job(np_, ["core/workers/core_timeline_worker.py", "env"], timeout=90, env=env)
    assert_case_passed(job, np_, case)


@pytest.mark.parametrize("np_", cc.NP_VALUES)
@pytest.mark.parametrize("case", ["timeline.api.calls", "timeline.api.files"])
def test_start_and_stop_timeline(mpi_job, np_, case):
    job = mpi_job(np_, ["core/workers/core_timeline_worker.py", "api"], timeout=90)
    assert_case_passed(job, np_, case)
