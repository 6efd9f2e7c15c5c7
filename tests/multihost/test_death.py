"""A rank that ends without ``hvd.shutdown()`` on another host, by any means: every rank that
still runs on the other hosts raises RankExitedError naming the rank and its host within 10 s
(unless mpiexec's own teardown kills it first), and the job exits non-zero
with nothing left running on any host (the bed checks), under
``mpiexec`` and under ``hvdlite run`` (tests/multihost/workers/multihost_death_worker.py)."""
from __future__ import annotations

import re
import sys

import pytest

from tests.mpi_harness import TESTS
from tests.multihost.hosts import host_list
from tests.multihost.layouts import LAYOUTS

LAYOUT = LAYOUTS["2+2"].layout   # ranks 0, 1 on hvdnode1; 2, 3 on hvdnode2
WORKER = "multihost/workers/multihost_death_worker.py"
HOSTS_OF = {0: "hvdnode1", 1: "hvdnode1", 2: "hvdnode2", 3: "hvdnode2"}
# What MPICH's mpiexec prints when it tears a job down itself: a rank dead of a signal ("BAD
# TERMINATION", "terminated badly"), or a host's proxy gone ("assert (!closed) failed", then
# "process manager error").
MPIEXEC_TEARDOWN = ("BAD TERMINATION", "terminated badly", "assert (!closed) failed",
                    "process manager error")
CASES = [("exit_code", 3), ("exit_code", 0), ("exit_zero", 2), ("signal", 3),
         ("exception", 2), ("host", 3), ("host", 0)]


def _survivors(victim: int) -> list[int]:
    """The ranks on the hosts the victim does not run on (ranks sharing its host may be killed
    with it)."""
    return [r for r, h in HOSTS_OF.items() if h != HOSTS_OF[victim]]


def _check(job, how: str, victim: int) -> None:
    assert not job.timed_out, f"hung after rank {victim} ended by {how}\n{job.output}"
    assert job.returncode not in (0, None), f"the job exited {job.returncode}\n{job.output}"
    assert not job.leftovers, f"left running: {job.leftovers}\n{job.output}"
    caught = {}
    for rank in _survivors(victim):
        found = re.search(rf"\[death-worker rank {rank} on {HOSTS_OF[rank]}\] caught (\w+)",
                          job.stderr)
        caught[rank] = found.group(1) if found else None
    # MPICH's mpiexec tears a job down itself when a rank dies of a signal or a host goes, and
    # also after an exit with a code when the victim's host holds other ranks (its proxy then
    # kills them with SIGKILL, which mpiexec reports as a "BAD TERMINATION" and acts on).  That
    # teardown races the watchdog: a survivor may be killed before it has printed what it
    # caught.  What holds every time: nothing hangs, nothing is left, the job ends non-zero,
    # every survivor that reported caught RankExitedError (and its own checks passed, below),
    # and the end was reported, by a survivor's RankExitedError or by mpiexec's teardown.
    for rank, what in caught.items():
        assert what in ("RankExitedError", None), f"rank {rank} caught {what}\n{job.output}"
    torn_down = any(sign in job.output for sign in MPIEXEC_TEARDOWN)
    assert "RankExitedError" in caught.values() or torn_down, \
        f"neither the watchdog nor mpiexec reported rank {victim}'s end\n{job.output}"
    if how in ("exit_code", "exit_zero", "exception") and not torn_down:
        # no teardown by mpiexec: nothing could stop a survivor from reporting
        assert all(what == "RankExitedError" for what in caught.values()), \
            f"a survivor did not report: {caught}\n{job.output}"
    for rep in job.results:
        if "victim_reported" in rep:
            assert rep["victim_reported"] is None, f"{rep['victim_reported']}\n{job.output}"


@pytest.mark.parametrize("how,victim", CASES, ids=[f"{h}-rank{v}" for h, v in CASES])
def test_rank_ending_without_shutdown_under_mpiexec(host_job, how, victim):
    _check(host_job(LAYOUT, [WORKER, how, str(victim)], timeout=90), how, victim)


@pytest.mark.parametrize("how,victim", [("exit_code", 3), ("host", 0)],
                         ids=["exit_code-rank3", "host-rank0"])
def test_rank_ending_without_shutdown_under_hvdlite_run(host_bed, how, victim):
    cmd = [sys.executable, "-m", "hvdlite.runner", "run", "-np", "4", "-H", host_list(LAYOUT),
           sys.executable, str(TESTS / WORKER), how, str(victim)]
    _check(host_bed.run(cmd, 4, timeout=90), how, victim)
