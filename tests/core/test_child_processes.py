"""Processes that a rank starts (forked, spawned, forkserver children; PyTorch DataLoader
workers) under real MPI launches at 2 and 3 ranks (tests/core/workers/child_process_worker.py), and
the pure logic that recognises a spawned child of a rank."""
import sys
import textwrap

import pytest

from hvdlite.common.runtime.child_process import RANK_PROCESS_VARIABLE, spawned_child_of_rank
from tests.mpi_harness import assert_case_passed, assert_every_case_reported, check_job, run_job

NP_VALUES = (2, 3)
TIMEOUT = 300
CASES = ["fork.queries_work", "fork.collectives_refused", "fork.shutdown_then_init_refused",
         "fork.lock_held_at_fork", "spawn.init_refused", "forkserver.init_refused",
         "parent_keeps_working", "torch.dataloader_fork_workers",
         "torch.dataloader_spawn_workers"]


def _job(mpi_job, np_):
    return mpi_job(np_, ["core/workers/child_process_worker.py"], timeout=TIMEOUT)


@pytest.mark.parametrize("np_", NP_VALUES)
def test_every_case_reported(mpi_job, np_):
    assert_every_case_reported(_job(mpi_job, np_), np_, CASES)


@pytest.mark.parametrize("np_", NP_VALUES)
@pytest.mark.parametrize("case", CASES)
def test_child_processes(mpi_job, np_, case):
    assert_case_passed(_job(mpi_job, np_), np_, case)


UNGUARDED = textwrap.dedent("""
    import multiprocessing as mp
    import hvdlite as hvd

    hvd.init()   # no __main__ guard: a 'spawn' child runs this line again


    def work():
        pass


    child = mp.get_context("spawn").Process(target=work)
    child.start()
    child.join(60)
    print(f"rank {hvd.rank()}: child exit code {child.exitcode}", flush=True)
    hvd.shutdown()
""")


def test_unguarded_script_with_spawned_child_gets_a_clear_error(tmp_path):
    """The common mistake behind "DataLoader worker exited unexpectedly": the child's own
    traceback names the cause instead of MPICH's PMI abort, and the ranks carry on."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    job = run_job(2, [sys.executable, str(script)], timeout=120)
    check_job(job, 2, expect_success=False)
    assert job.returncode == 0, job.output
    for rank in range(2):
        assert f"rank {rank}: child exit code 1" in job.stdout, job.output
    assert job.stderr.count("RankChildProcessError: hvd.init() was called in process") == 2, \
        job.output
    assert "if __name__ == \"__main__\":" in job.stderr, job.output


# --- pure logic ----------------------------------------------------------------------------
RANK_ENV = {RANK_PROCESS_VARIABLE: "100:3", "PMI_RANK": "3"}


@pytest.mark.parametrize("launcher_var", ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"])
def test_spawned_child_of_a_launched_rank_is_recognised(launcher_var):
    env = {RANK_PROCESS_VARIABLE: "100:3", launcher_var: "3"}
    assert spawned_child_of_rank(env, pid=200, multiprocessing_child=True) == (100, 3)


@pytest.mark.parametrize("env, pid, child", [
    (RANK_ENV, 100, True),                            # the rank itself
    (RANK_ENV, 200, False),                           # not started by multiprocessing
    ({RANK_PROCESS_VARIABLE: "100:3"}, 200, True),    # parent ran without a launcher
    ({"PMI_RANK": "3"}, 200, True),                   # parent never initialized hvdlite
    ({RANK_PROCESS_VARIABLE: "garbage", "PMI_RANK": "3"}, 200, True),
    ({RANK_PROCESS_VARIABLE: "100:3", "PMI_RANK": " "}, 200, True),
])
def test_other_processes_are_not_refused(env, pid, child):
    assert spawned_child_of_rank(env, pid=pid, multiprocessing_child=child) is None
