"""Process sets in the framework-neutral numpy API under real MPI launches (2, 3 and 4 ranks).

One launch of tests/core/workers/core_process_sets_worker.py per (mode, rank count) runs every case
of that mode; each case is its own test here.  Modes differ in how sets are enabled (static at init,
HVDLITE_/HOROVOD_DYNAMIC_PROCESS_SETS, init(process_sets="dynamic")), so each is its own job.
Stalled operations become errors after HVDLITE_STALL_SHUTDOWN_TIME_SECONDS, and the worker writes
its report after every case, so a hang shows up as the failure of the case that hung.
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, case_failures, check_job
from tests.core.workers.core_process_sets_worker import cases

MODES = {   # mode -> (environment, rank counts)
    "static": ({}, (2, 3, 4)),
    "dynamic": ({"HVDLITE_DYNAMIC_PROCESS_SETS": "1"}, (2, 3, 4)),
    "dynamic_alias": ({"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, (3,)),
    "dynamic_init": ({}, (2, 4)),
}
TIMEOUT = 240


def _job(mpi_job, mode, np_):
    return mpi_job(np_, ["core/workers/core_process_sets_worker.py", mode], timeout=TIMEOUT,
                   env={**STALL_SAFETY_NET_ENV, **MODES[mode][0]})


def _params():
    for mode, (_, nps) in MODES.items():
        for n in nps:
            for case in cases(mode, n):
                yield pytest.param(mode, n, case, id=f"{mode}-np{n}-{case}")


@pytest.mark.parametrize("mode,np_,case", list(_params()))
def test_process_sets(mpi_job, mode, np_, case):
    job = _job(mpi_job, mode, np_)
    problems = case_failures(job, case)
    if len(job.results) < np_:
        problems.append(f"only {len(job.results)} of {np_} ranks wrote a report")
    if problems and (job.timed_out or job.returncode != 0):
        problems.append(f"(job {'timed out' if job.timed_out else 'exited with '}"
                        f"{'' if job.timed_out else job.returncode})\n{job.output}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("mode,np_", [pytest.param(m, n, id=f"{m}-np{n}")
                                      for m, (_, nps) in MODES.items() for n in nps])
def test_job_exits_cleanly(mpi_job, mode, np_):
    """The whole launch finished in time, exited 0, and every rank reported every case."""
    job = _job(mpi_job, mode, np_)
    check_job(job, np_)
    want = cases(mode, np_)
    for rank, report in enumerate(job.results):
        assert sorted(report) == sorted(want), f"rank {rank} reported {sorted(report)}"
