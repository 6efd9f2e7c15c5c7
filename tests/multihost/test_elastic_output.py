"""Elastic survivors keep their output (issue 54): a job across two hosts whose ranks write all
the time (tests/elastic/workers/chatty_worker.py: a tqdm bar, a logging thread, print in
`finally` a second after the failure, a DataLoader with worker processes) loses a rank to
SIGKILL on the second host, or that whole host; the world's launcher tears that world down, and the survivor on
the first host must go on writing, reset and finish, warm and cold."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.mpi_harness import TESTS

pytest.importorskip("tqdm")
HVDLITE_RUN = [sys.executable, "-m", "hvdlite.runner", "run"]
WORKER = [sys.executable, str(TESTS / "elastic/workers/chatty_worker.py")]


@pytest.mark.parametrize("warm, raises, lose_host", [("1", "", ""), ("0", "", ""),
                                                     ("1", "1", ""), ("1", "", "1"),
                                                     ("0", "", "1")])
def test_a_survivor_that_writes_outlives_its_worlds_launcher(host_bed, warm, raises, lose_host):
    """``raises``: the survivor also raises an error of its own after the failure, which
    counts as the world's failure (a peer had departed), not as the script's.  ``lose_host``:
    the second host loses every process (its proxy and warm process too), not one rank."""
    job = host_bed.run(HVDLITE_RUN + ["-np", "2", "--min-np", "1", "--max-np", "2",
                                      "-H", "hvdnode1:1,hvdnode2:1"] + WORKER, 0, timeout=240,
                       env={"HVDLITE_ELASTIC_WARM_START": warm, "CHATTY_RAISE": raises,
                            "CHATTY_LOSE_HOST": lose_host})
    assert not job.timed_out, job.output
    assert "BrokenPipeError" not in job.stdout + job.stderr, job.output
    assert job.returncode == 0, job.output
    assert f"finished world 1 rank 0 of 1 epoch 3 warm {warm == '1'}" in job.stdout, job.output
    # what the survivor wrote after its launcher was gone, in world 0, reached the job's
    # output (through the driver), and so did its logging thread's lines
    assert "world 0 rank 0 leaves epoch 1" in job.stdout, job.output
    assert "log rank 0: still here" in job.stderr, job.output


# A library whose process exit aborts in a forked child (as a C++ std::thread object copied
# without its thread does: "terminate called without an active exception", SIGABRT).
FORK_UNSAFE = """import atexit, os
_pid = os.getpid()
atexit.register(lambda: os.getpid() != _pid and os.abort())
"""


def test_warm_starts_fall_back_to_cold_where_a_fork_would_crash(host_bed):
    """The warm process preloads the library; before forking the next world's worker it forks
    a probe that exits as a worker would, sees it die of SIGABRT, and the worker starts cold
    (saying why) instead of aborting in the middle of the job."""
    import sysconfig
    name = "fork_unsafe_library_for_tests"
    path = Path(sysconfig.get_paths()["purelib"]) / f"{name}.py"
    path.write_text(FORK_UNSAFE)
    try:
        job = host_bed.run(HVDLITE_RUN + ["-np", "2", "--min-np", "1", "--max-np", "2",
                                          "-H", "hvdnode1:1,hvdnode2:1"] + WORKER, 0,
                           timeout=240, env={"HVDLITE_ELASTIC_WARM_START": "1",
                                             "CHATTY_IMPORT": name})
    finally:
        path.unlink()
    assert job.returncode == 0, job.output
    assert "finished world 1 rank 0 of 1 epoch 3 warm False" in job.stdout, job.output
    assert "starting this worker cold" in job.stderr and "SIGABRT" in job.stderr, job.output
