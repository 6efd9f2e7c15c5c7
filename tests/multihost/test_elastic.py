"""Elastic jobs across simulated hosts: ``hvdlite run --min-np/--max-np`` keeps training through
failures and host changes, with nothing lost beyond the last commit
(tests/elastic/workers/elastic_worker.py; the job's plan says where it fails).

Each job is one launch of the elastic driver; the worker logs every world's start, every save
of the state, what it did to itself, and the end.  For every job the checks are the same
(:func:`_check_history`):

* every world after the first resumes from the newest commit of the world before it (the
  largest step any rank of it saved), with the same parameters and optimizer state on every
  rank;
* the samples that made it into the final model (the committed ``seen`` history) cover every
  sample of every epoch exactly once, but for the padding of an epoch's last round (at most
  size - 1 repeats, as Horovod's ElasticSampler pads);
* the final weights are those of a run without failures: bitwise when every world had the same
  size (the same samples in the same order), close otherwise (the problem has one optimum).

Jobs (worlds):
  reference  2+2 ranks, no failure                                                  (1 world)
  sigkill    2+2 on hvdnode1,2 of a 3-host pool: a rank is SIGKILLed; the next world is 2+2
             on hvdnode1,3, the same size, so the weights must equal the reference's   (2)
  limit      4 ranks on hvdnode1:2,hvdnode2:1,hvdnode3:1 with --reset-limit 1: a rank exits
             with status 3, then in the next world a rank dies inside commit(): the second
             reset is one too many and the job fails saying so                          (2)
  discovery  --host-discovery-script: 2 ranks on hvdnode1; hvdnode2 is added mid-epoch
             (grow to 4 at a commit, nothing rolled back), then hvdnode2 is killed whole
             and leaves discovery (back to 2)                                           (3)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.elastic.elastic_checks import (EPOCHS, N, check_history, of, read_logs,
                                  reset_seconds)
from tests.mpi_harness import TESTS

HVDLITE_RUN = [sys.executable, "-m", "hvdlite.runner", "run"]
WORKER = [sys.executable, str(TESTS / "elastic/workers/elastic_worker.py")]
TIMEOUT = 300

JOBS = {
    "reference": dict(flags=["-np", "4", "--min-np", "2", "--max-np", "4",
                             "-H", "hvdnode1:2,hvdnode2:2"], plan=[]),
    "sigkill": dict(flags=["-np", "4", "--min-np", "2", "--max-np", "4",
                           "-H", "hvdnode1:2,hvdnode2:2,hvdnode3:2"],
                    plan=[{"world": 0, "step": 9, "rank": 3, "action": "sigkill"}]),
    "limit": dict(flags=["-np", "4", "--min-np", "2", "--reset-limit", "1",
                         "-H", "hvdnode1:2,hvdnode2:1,hvdnode3:1"],
                  plan=[{"world": 0, "step": 7, "rank": 3, "action": "exit"},
                        {"world": 1, "step": 5, "rank": 2, "action": "commit_kill"}]),
    "discovery": dict(flags=["-np", "2", "--min-np", "2", "--max-np", "4",
                             "--host-discovery-script", "DISCOVERY_SCRIPT"],
                      discovery="hvdnode1:2\n",
                      plan=[{"world": 0, "step": 5, "rank": "all", "action": "discover",
                             "hosts": "hvdnode1:2\nhvdnode2:2\n", "pause": 2.5},
                            {"world": 1, "step": 4, "rank": 2, "action": "remove_host",
                             "hosts": "hvdnode1:2\n"}]),
}


def _run_job(host_bed, name: str):
    spec = JOBS[name]
    workdir = Path(host_bed.root) / "jobs" / f"elastic-{name}"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "log").mkdir(exist_ok=True)
    env = {"ELASTIC_LOG": str(workdir / "log"), "ELASTIC_PLAN": json.dumps(spec["plan"]),
           "ELASTIC_EPOCHS": str(EPOCHS)}
    flags = list(spec["flags"])
    if "discovery" in spec:
        listing = workdir / "hosts.txt"
        listing.write_text(spec["discovery"])
        script = workdir / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {listing}\n")
        script.chmod(0o755)
        flags[flags.index("DISCOVERY_SCRIPT")] = str(script)
        env["ELASTIC_DISCOVERY"] = str(listing)
    job = host_bed.run(HVDLITE_RUN + flags + WORKER, 0, timeout=TIMEOUT, env=env)
    return job, read_logs(workdir / "log")


@pytest.fixture(scope="module")
def jobs(host_bed):
    """Each job once per module, when a test first needs it."""
    done: dict = {}

    def get(name: str):
        if name not in done:
            done[name] = _run_job(host_bed, name)
        return done[name]
    return get


def _warm_by_host(events: list[dict]) -> dict[str, set[bool]]:
    """Host -> whether its workers of this world were forked by its warm process."""
    found: dict[str, set[bool]] = {}
    for event in of(events, "start"):
        found.setdefault(event["host"], set()).add(event["warm"])
    return found


def test_reference_run(jobs):
    job, worlds = jobs("reference")
    assert job.returncode == 0, job.output
    done = check_history(job, worlds, [4], [{"hvdnode1", "hvdnode2"}])
    assert done[0]["loss"] < 1e-3, done[0]["loss"]


def test_sigkilled_worker_resumes_from_the_last_commit(jobs):
    job, worlds = jobs("sigkill")
    assert job.returncode == 0, job.output
    done = check_history(job, worlds, [4, 4], [{"hvdnode1", "hvdnode2"},
                                                 {"hvdnode1", "hvdnode3"}])
    assert "blacklisted hvdnode2" in job.stderr, job.stderr[-3000:]
    ref_job, ref_worlds = jobs("reference")
    reference = check_history(ref_job, ref_worlds, [4], [{"hvdnode1", "hvdnode2"}])
    # Same size in every world: the same samples in the same order, so the same weights.
    assert done[0]["checksum"] == reference[0]["checksum"], \
        (done[0]["weights"][:4], reference[0]["weights"][:4])
    # hvdnode1's workers of world 1 are forked by its warm process; hvdnode3 is new (cold)
    assert _warm_by_host(worlds[1]) == {"hvdnode1": {True}, "hvdnode3": {False}}, worlds[1]
    print(f"\nsigkill: reset took {reset_seconds(worlds, 1)}", file=sys.stderr)


def test_repeated_failures_stop_at_the_reset_limit(jobs):
    job, worlds = jobs("limit")
    assert job.returncode == 1, job.output
    assert "exceeded the limit: 1" in job.stderr, job.stderr[-3000:]
    check_history(job, worlds, [4, 3], [{"hvdnode1", "hvdnode2", "hvdnode3"},
                                         {"hvdnode1", "hvdnode2"}])
    # world 1 died inside a commit: the commit it was making is the newest saved one
    acted = of(worlds[1], "act")
    assert [e["action"] for e in acted] == ["commit_kill", "commit_kill"], acted
    assert _warm_by_host(worlds[1]) == {"hvdnode1": {True}, "hvdnode2": {True}}, worlds[1]
    print(f"\nexit status 3: reset took {reset_seconds(worlds, 1)}", file=sys.stderr)


def test_hosts_added_by_discovery_and_a_host_removed(jobs):
    job, worlds = jobs("discovery")
    assert job.returncode == 0, job.output
    done = check_history(job, worlds, [2, 4, 2], [{"hvdnode1"}, {"hvdnode1", "hvdnode2"},
                                                   {"hvdnode1"}])
    grown = of(worlds[1], "synced")[0]
    assert 0 < grown["processed"] < N and grown["epoch"] == 0, \
        f"world 1 should start mid-epoch 0: {grown}"
    # A host update rolls nothing back: world 1 starts from world 0's live state.
    steps_before = max(e["step"] for e in of(worlds[0], "saved"))
    assert grown["step"] == steps_before
    # warm where a host ran the world before; hvdnode2 joined in world 1 (cold)
    assert _warm_by_host(worlds[1]) == {"hvdnode1": {True}, "hvdnode2": {False}}, worlds[1]
    assert _warm_by_host(worlds[2]) == {"hvdnode1": {True}}, worlds[2]
    reference = jobs("reference")[1]
    ref_weights = of(reference[0], "done")[0]["weights"]
    for got, want in zip(done[0]["weights"], ref_weights):
        assert abs(got - want) < 1e-2, (done[0]["weights"], ref_weights)
    print(f"\nhost added: reset took {reset_seconds(worlds, 1)}; host removed: "
          f"{reset_seconds(worlds, 2)}", file=sys.stderr)
