"""An invalid HVDLITE_*/HOROVOD_* setting (or a timeline file rank 0 cannot write) makes
hvd.init() raise on every rank, under real MPI launches at 2 and 3 ranks, instead of leaving
the ranks with valid settings waiting for ever (tests/core/workers/core_init_settings_worker.py)."""
import pytest

from tests.mpi_harness import run_job

CASES = [   # variable, invalid value, which ranks have it ("all", or one rank; -1: the last)
    pytest.param("HVDLITE_FUSION_THRESHOLD", "64MB", "all", id="number-all"),
    # rank 0: its settings are the ones every rank would use
    pytest.param("HVDLITE_FUSION_THRESHOLD", "64MB", "0", id="number-rank0"),
    pytest.param("HOROVOD_CYCLE_TIME", "-1", "-1", id="horovod-negative-last"),
    pytest.param("HOROVOD_STALL_CHECK_DISABLE", "maybe", "0", id="switch-rank0"),
    pytest.param("HVDLITE_DIRECT_COPIES", "sometimes", "-1", id="cma-last"),
    pytest.param("HVDLITE_TIMELINE_MARK_CYCLES", "yes please", "all", id="flag-all"),
    # each rank's own knob: once checked only when the logger was set up, on that rank alone
    pytest.param("HVDLITE_LOG_LEVEL", "verbose", "-1", id="log-level-last"),
    pytest.param("HOROVOD_CACHE_CAPACITY", "inf", "0", id="integer-inf-rank0"),
    # only rank 0 records a timeline, so only its path can be wrong
    pytest.param("HOROVOD_TIMELINE", "/nonexistent/dir/timeline.json", "0",
                 id="timeline-unwritable-rank0"),
]


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("variable,value,where", CASES)
def test_invalid_setting_raises_on_every_rank(np_, variable, value, where):
    job = run_job(np_, ["core/workers/core_init_settings_worker.py", variable, value, where],
                  timeout=60)
    assert not job.timed_out, f"hung instead of raising\n{job.output}"
    assert job.returncode == 0, job.output
    assert len(job.results) == np_, job.output
    for rep in job.results:
        for case in ("init_refused", "init_after_fixing"):
            assert rep.get(case, "not reported") is None, f"{case}: {rep.get(case)}\n{job.output}"
    assert job.stderr.count("caught ValueError") == np_, job.output
