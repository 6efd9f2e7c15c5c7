"""An elastic job on this machine alone (no simulated hosts needed): ``hvdlite run --min-np 1
--max-np 2 -H localhost:1,127.0.0.1:1 --blacklist-cooldown-range 1 1`` (two names of this
host: two "hosts" to the launcher).  A worker is SIGKILLed; its host is blacklisted, the job
goes on with one rank from the last commit, and when the host's cooldown ends the job grows
back to two ranks at a commit, rolling nothing back (tests/elastic/workers/elastic_worker.py,
checked as in tests/multihost/test_elastic.py).  The simulated-host tests cover the other
failures."""
from __future__ import annotations

import json
import socket
import sys

import pytest

from tests.elastic.elastic_checks import check_history, of, read_logs, reset_seconds
from tests.mpi_harness import TESTS, run_command

WORKER = TESTS / "elastic/workers/elastic_worker.py"

HVDLITE_RUN = [sys.executable, "-m", "hvdlite.runner", "run"]


def shrink_and_grow_back(tmp_path, env: dict):
    """The job of two "hosts": rank 1 is SIGKILLed after 6 steps (its host blacklisted for 1 s),
    world 1 goes on alone and pauses long enough for the cooldown (1-2 s) and discovery (1 s)
    to bring the host back (with warm starts it would otherwise finish training in well under
    a second), world 2 has both again.  (job, the worlds' logs, the ranks' "done" events),
    its history checked."""
    log = tmp_path / "log"
    log.mkdir()
    plan = [{"world": 0, "step": 6, "rank": 1, "action": "sigkill"},
            {"world": 1, "step": 2, "rank": "all", "action": "pause", "pause": 4}]
    job = run_command(HVDLITE_RUN + ["-np", "2", "--min-np", "1", "--max-np", "2",
                                     "-H", "localhost:1,127.0.0.1:1",
                                     "--blacklist-cooldown-range", "1", "1",
                                     sys.executable, str(WORKER)],
                      0, timeout=300, env={"ELASTIC_LOG": str(log),
                                           "ELASTIC_PLAN": json.dumps(plan), **env})
    assert job.returncode == 0, job.output
    here = {socket.gethostname()}
    worlds = read_logs(log)
    return job, worlds, check_history(job, worlds, [2, 1, 2], [here, here, here])


@pytest.mark.parametrize("warm", ["warm", "cold"])
def test_job_survives_a_killed_worker_and_grows_back_after_the_cooldown(tmp_path, warm):
    """With warm starts (the default) the later worlds' workers are forked from the host's
    warm process; with ``HVDLITE_ELASTIC_WARM_START=0`` every worker starts anew."""
    job, worlds, done = shrink_and_grow_back(
        tmp_path, {"HVDLITE_ELASTIC_WARM_START": "0" if warm == "cold" else "1"})
    assert "blacklisted 127.0.0.1" in job.stderr, job.stderr[-3000:]
    assert "hosts changed" in job.stderr, job.stderr[-3000:]
    # the host change is an interrupt at a commit: world 2 starts where world 1 stopped
    assert of(worlds[2], "synced")[0]["step"] == max(e["step"] for e in of(worlds[1], "saved"))
    assert done[0]["loss"] < 1e-3, done[0]["loss"]
    # world 0 starts cold everywhere; later worlds are forked warm (after the first commit the
    # warm process holds torch), or all cold when warm starts are off
    started = {w: [e["warm"] for e in of(worlds[w], "start")] for w in worlds}
    assert started[0] == [False, False], started
    assert all(started[w] == [warm == "warm"] * len(started[w]) for w in (1, 2)), started
    print(f"\nkilled worker: reset took {reset_seconds(worlds, 1)}; grown back: "
          f"{reset_seconds(worlds, 2)}", file=sys.stderr)


def test_powersgd_starts_over_in_every_world(tmp_path):
    """The same job with PowerSGD: a world resumes from the commit with every rank's Q and error
    feedback started over alike (plain steps first again), the ranks stay bitwise identical,
    and training converges."""
    _, worlds, done = shrink_and_grow_back(tmp_path, {"ELASTIC_POWERSGD": "1"})
    assert done[0]["loss"] < 1e-3, done[0]["loss"]
    # the last world counted its own steps from 0 (so it began with plain steps again)
    resumed_at = of(worlds[2], "synced")[0]["step"]
    assert [e["powersgd_steps"] for e in done.values()] == [done[0]["step"] - resumed_at] * 2, done
