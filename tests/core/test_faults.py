"""Jobs that are meant to go wrong: a rank dies or stalls while the others wait on it.

Each scenario is one real mpiexec launch of tests/core/workers/core_fault_worker.py under a timeout
(shared by the tests of that scenario).  Ranks may be missing from ``results`` (a rank that died
writes nothing after it died), so survivors are recognised by the cases they report.
"""
import functools
import re
import time

import pytest

from tests.mpi_harness import run_job

STALL_WARN_ENV = {"HVDLITE_STALL_CHECK_TIME_SECONDS": "1"}
STALL_SHUTDOWN_ENV = {"HVDLITE_STALL_CHECK_TIME_SECONDS": "1",
                      "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "2"}
ENVS = {"stall_warn": STALL_WARN_ENV, "stall_shutdown": STALL_SHUTDOWN_ENV,
        "stall_late": STALL_SHUTDOWN_ENV, "stall_mismatch": STALL_SHUTDOWN_ENV,
        "data_stall_warn": STALL_WARN_ENV, "data_stall_shutdown": STALL_SHUTDOWN_ENV,
        "vanished_before_set_change": {"HVDLITE_DYNAMIC_PROCESS_SETS": "1"}}


@functools.lru_cache(maxsize=None)
def launch(scenario: str, np_: int, odd: int, extra_env: tuple = ()):
    start = time.monotonic()
    job = run_job(np_, ["core/workers/core_fault_worker.py", scenario, str(odd)], timeout=60,
                  env={**ENVS.get(scenario, {}), **dict(extra_env)})
    return job, time.monotonic() - start


def reports_with(job, case):
    return [rep for rep in job.results if case in rep]


def assert_every_rank_passed(job, np_: int, cases) -> None:
    """The job ended cleanly and every rank reported each of ``cases`` as passed."""
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output
    assert len(job.results) == np_, job.output
    for rep in job.results:
        for case in cases:
            assert rep.get(case, "not reported") is None, f"{case}: {rep.get(case)}\n{job.output}"


NPS = [2, 3]
# (np, the misbehaving rank): the last rank, and rank 0 (the coordinator) too
LAYOUTS = [pytest.param(2, 1, id="np2-odd1"), pytest.param(3, 2, id="np3-odd2"),
           pytest.param(3, 0, id="np3-odd0")]


def assert_survivors_passed(job, wall: float, np_: int, cases: tuple[str, ...]) -> None:
    """The job ended non-zero within seconds instead of hanging, and every rank but the odd
    one reported each of ``cases`` as passed."""
    assert not job.timed_out, f"hung instead of failing fast\n{job.output}"
    assert job.returncode not in (0, None), f"mpiexec exited {job.returncode}\n{job.output}"
    survivors = reports_with(job, cases[-1])
    assert len(survivors) == np_ - 1, f"{len(survivors)} survivors reported\n{job.output}"
    for rep in survivors:
        for case in cases:
            assert rep[case] is None, f"{case}: {rep[case]}\n{job.output}"
    assert wall < 30, f"job took {wall:.1f} s"


def assert_survivors_failed_fast(job, wall: float, np_: int, odd: int) -> None:
    """Every rank but ``odd`` caught RankExitedError within seconds and passed its checks, and
    the job ended non-zero instead of hanging."""
    assert_survivors_passed(job, wall, np_, ("warmup", "later_ops_fail", "wait_on_exited_rank"))
    caught = re.findall(r"\[fault-worker rank (\d+)\] caught RankExitedError after", job.stderr)
    assert sorted(int(c) for c in caught) == [k for k in range(np_) if k != odd], job.output


@pytest.mark.parametrize("np_,odd", LAYOUTS)
@pytest.mark.parametrize("scenario", ["raise", "exit"])
def test_peer_exit_fails_waiters_fast(scenario, np_, odd):
    """A rank raising (or ending its script) while the others wait on it: every other rank gets
    RankExitedError within seconds (their pending async handles too), and mpiexec fails."""
    job, wall = launch(scenario, np_, odd)
    assert_survivors_failed_fast(job, wall, np_, odd)
    assert "RankExitedError" in job.stderr
    if scenario == "raise":
        assert f"RuntimeError: deliberate failure on rank {odd}" in job.stderr, job.output


@pytest.mark.parametrize("np_", NPS)
def test_hard_exit_does_not_hang(np_):
    """A rank leaving without any shutdown (os._exit) must not leave the job hanging."""
    job, wall = launch("hard_exit", np_, np_ - 1)
    assert not job.timed_out, f"hung after a rank vanished\n{job.output}"
    assert job.returncode not in (0, None), job.output
    assert wall < 30, f"job took {wall:.1f} s"


@pytest.mark.parametrize("np_,odd", LAYOUTS)
def test_process_set_change_after_a_rank_left(np_, odd):
    """add_process_set / remove_process_set are collectives over every rank outside the
    engine: with a rank gone (found out while waiting in add_process_set), each survivor's
    call raises RankExitedError naming it within seconds, and the job ends non-zero instead
    of hanging."""
    job, wall = launch("vanished_before_set_change", np_, odd)
    assert_survivors_passed(job, wall, np_,
                            ("warmup", "remove_set_after_exit", "add_set_after_exit"))


@pytest.mark.parametrize("np_,odd", LAYOUTS)
def test_vanished_local_peer_detected_by_hvdlite(np_, odd):
    """A node-local rank whose process is gone while the launcher keeps the job running (srun
    without --kill-on-bad-exit, or a launcher that missed the exit): hvdlite itself notices
    within seconds and every survivor raises RankExitedError naming that rank and each tensor."""
    job, wall = launch("vanished", np_, odd)
    assert_survivors_failed_fast(job, wall, np_, odd)
    assert "exited without shutting down hvdlite" in job.stderr, job.output


@pytest.mark.parametrize("np_,odd", [layout for layout in LAYOUTS if layout.values[0] >= 3])
def test_vanished_peer_abort_waits_for_the_other_survivors(np_, odd):
    """The first survivor to notice a vanished peer exits and aborts the job (MPI_Finalize would
    wait for the peer for ever), but only after a grace period: a survivor that started waiting
    later still notices on its own and reports its error instead of being killed silently."""
    job, wall = launch("vanished_late_waiter", np_, odd)
    assert_survivors_failed_fast(job, wall, np_, odd)
    assert "aborting the job in" in job.stderr, job.output


@pytest.mark.parametrize("np_,odd", LAYOUTS)
def test_stall_warning_then_correct_result(np_, odd):
    job, _ = launch("stall_warn", np_, odd)
    assert_every_rank_passed(job, np_, ("warmup", "late_result_correct", "after"))
    assert "Stall detected" in job.stderr, job.output
    submitted = str([k for k in range(np_) if k != odd])
    pattern = (rf"'late': submitted on ranks {re.escape(submitted)}.*missing on ranks "
               rf"{re.escape(str([odd]))} \(rank {odd} has no operation pending\)")
    assert re.search(pattern, job.stderr), job.output
    # only rank 0 logs the stall report
    assert not re.search(r"\[hvdlite rank [1-9]\d*\] WARNING: Stall detected", job.stderr)


# The stall shutdown time shorter than the stall check time is honoured as set (it once waited
# for the check time: shutdown 2 s with the default 60 s check gave up after 60 s).
SHORT_SHUTDOWN = (("HVDLITE_STALL_CHECK_TIME_SECONDS", "60"),
                  ("HVDLITE_STALL_SHUTDOWN_TIME_SECONDS", "2"))
CHECK_TIMES = {"check1s": (), "check60s": SHORT_SHUTDOWN}


@pytest.mark.parametrize("check", sorted(CHECK_TIMES))
@pytest.mark.parametrize("np_,odd", LAYOUTS)
def test_stall_shutdown_errors_then_job_continues(np_, odd, check):
    job, wall = launch("stall_shutdown", np_, odd, CHECK_TIMES[check])
    assert_every_rank_passed(job, np_, ("warmup", "stalled_tensor_errors", "job_keeps_working"))
    assert "Stall detected" in job.stderr, job.output
    caught = re.findall(r"\[fault-worker rank (\d+)\] caught StallError", job.stderr)
    assert sorted(int(c) for c in caught) == [k for k in range(np_) if k != odd], job.output


@pytest.mark.parametrize("np_,odd", LAYOUTS)
def test_stall_shutdown_explains_a_late_rank(np_, odd):
    """A rank that submits a tensor only after the others' stall shutdown failed it: its own
    StallError says that the others already gave up (ranks running far apart), instead of
    suggesting that they skipped the tensor; the others' error keeps the usual advice."""
    job, _ = launch("stall_late", np_, odd)
    assert_every_rank_passed(job, np_, ("warmup", "late_submission_explained",
                                        "job_keeps_working"))
    assert re.search(rf"\[fault-worker rank {odd}\] caught StallError \(late\)", job.stderr), \
        job.output


@pytest.mark.parametrize("np_,odd", LAYOUTS)
def test_stall_report_says_what_missing_ranks_wait_on(np_, odd):
    """Ranks that submitted differently named tensors (diverged code): each StallError names
    the tensor the missing ranks wait on instead, which points at the divergence."""
    job, _ = launch("stall_mismatch", np_, odd)
    assert_every_rank_passed(job, np_, ("warmup", "missing_ranks_named_with_their_tensors",
                                        "job_keeps_working"))
    assert f"rank {odd} is waiting on 'step.odd'" in job.stderr, job.output


# The data path of a single 2 MiB allreduce: direct copies between the ranks, or the window.
DATA_PATHS = {"direct": (), "window": (("HVDLITE_DIRECT_COPIES", "0"),)}


@pytest.mark.parametrize("path", sorted(DATA_PATHS))
@pytest.mark.parametrize("np_,odd", LAYOUTS)
def test_stall_inside_data_exchange_warns_then_finishes(np_, odd, path):
    """A rank whose background thread stops inside an agreed allreduce's data exchange: the
    others say so every stall-check period while they wait, and the result is still right."""
    job, _ = launch("data_stall_warn", np_, odd, DATA_PATHS[path])
    assert_every_rank_passed(job, np_, ("warmup", "slow_data_correct", "after"))
    warned = set(re.findall(r"rank (\d+) has waited \d+ s for the other ranks to join an "
                            r"allreduce's data exchange", job.stderr))
    assert warned == {str(k) for k in range(np_) if k != odd}, job.output


@pytest.mark.parametrize("check", sorted(CHECK_TIMES))
@pytest.mark.parametrize("path", sorted(DATA_PATHS))
@pytest.mark.parametrize("np_,odd", LAYOUTS)
def test_stall_inside_data_exchange_shutdown_raises(np_, odd, path, check):
    """With HVDLITE_STALL_SHUTDOWN_TIME_SECONDS a data exchange that does not complete raises
    StallError on every rank (the stopped one too, once it finds its peers gone) instead of
    waiting for ever."""
    job, wall = launch("data_stall_shutdown", np_, odd, DATA_PATHS[path] + CHECK_TIMES[check])
    assert not job.timed_out, f"hung instead of raising\n{job.output}"
    # By direct copies the stopped rank may instead find, when it resumes, that its peers
    # have given up and ended: it says it could not reach their memory (checked by the worker).
    late = "|DirectCopyError" if path == "direct" else ""
    caught = re.findall(rf"\[fault-worker rank (\d+)\] caught (?:StallError{late})", job.stderr)
    assert sorted(int(c) for c in caught) == list(range(np_)), job.output
    for rep in job.results:
        assert rep.get("stalled_data_errors", "not reported") is None, job.output
    assert wall < 40, f"job took {wall:.1f} s"
