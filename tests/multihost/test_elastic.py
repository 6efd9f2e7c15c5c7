"""Elastic jobs across simulated hosts: ``hvdlite run --min-np/--max-np`` keeps training through
failures and host changes, with nothing lost beyond the last commit
(tests/workers/elastic_worker.py; the job's plan says where it fails).

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

import collections
import json
import os
import sys
from pathlib import Path

import pytest

from tests.mpi_harness import WORKERS

HVDLITE_RUN = [sys.executable, "-m", "hvdlite.runner", "run"]
WORKER = [sys.executable, str(WORKERS / "elastic_worker.py")]
N, EPOCHS = 240, 3
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
    return job, _read_logs(workdir / "log")


def _read_logs(directory: Path) -> dict[int, list[dict]]:
    """world -> its events, in time order."""
    worlds: dict[int, list[dict]] = collections.defaultdict(list)
    for path in directory.glob("w*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                worlds[event["world"]].append(event)
    return {w: sorted(events, key=lambda e: e["t"]) for w, events in sorted(worlds.items())}


@pytest.fixture(scope="module")
def jobs(host_bed):
    """Each job once per module, when a test first needs it."""
    done: dict = {}

    def get(name: str):
        if name not in done:
            done[name] = _run_job(host_bed, name)
        return done[name]
    return get


def _of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["ev"] == kind]


def _check_history(job, worlds: dict[int, list[dict]], sizes: list[int],
                   hosts: list[set[str]]) -> dict:
    """The checks every job shares (module docstring); returns the final 'done' events."""
    assert not job.timed_out, f"the elastic job hung\n{job.output}"
    assert sorted(worlds) == list(range(len(sizes))), \
        f"worlds {sorted(worlds)}, expected {len(sizes)}\n{job.output}"
    for w, events in worlds.items():
        starts = _of(events, "start")
        assert sorted(e["rank"] for e in starts) == list(range(sizes[w])), \
            f"world {w}: ranks {sorted(e['rank'] for e in starts)}\n{job.output}"
        assert {e["host"] for e in starts} == hosts[w], f"world {w} ran on " \
            f"{ {e['host'] for e in starts} }, expected {hosts[w]}\n{job.output}"
        synced = _of(events, "synced")
        assert len(synced) == sizes[w], f"world {w}: not every rank synced\n{job.output}"
        assert len({(e["step"], e["checksum"]) for e in synced}) == 1, \
            f"world {w}: ranks differ after the sync: {synced}"
        if w == 0:
            assert synced[0]["step"] == 0
            continue
        before = [e for e in _of(worlds[w - 1], "saved")]
        newest = max(before, key=lambda e: e["step"])
        assert (synced[0]["step"], synced[0]["checksum"]) == (newest["step"],
                                                              newest["checksum"]), \
            (f"world {w} resumed from step {synced[0]['step']} ({synced[0]['checksum']}), but "
             f"the newest commit of world {w - 1} is step {newest['step']} "
             f"({newest['checksum']})")
    done = _of(worlds[len(sizes) - 1], "done")
    if done:
        assert len(done) == sizes[-1] and len({e["checksum"] for e in done}) == 1, done
        _check_samples(done[0]["seen"], sizes[-1])
    return {e["rank"]: e for e in done}


def _check_samples(seen: list, last_size: int) -> None:
    by_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for epoch, indices in seen:
        by_epoch[epoch].update(indices)
    assert sorted(by_epoch) == list(range(EPOCHS)), sorted(by_epoch)
    for epoch, counts in by_epoch.items():
        skipped = sorted(set(range(N)) - set(counts))
        assert not skipped, f"epoch {epoch}: samples never trained on: {skipped}"
        repeats = sum(c - 1 for c in counts.values())
        assert repeats <= last_size - 1, \
            f"epoch {epoch}: {repeats} samples trained on twice: " \
            f"{sorted(i for i, c in counts.items() if c > 1)}"


def _reset_seconds(worlds: dict[int, list[dict]], w: int) -> str:
    """From the first failure or interrupt of world w - 1 to world w's first step, and where
    the time went (the slowest rank of each phase)."""
    acted = min(e["t"] for e in _of(worlds[w - 1], "act"))
    starts = _of(worlds[w], "start")
    phases = [("until the new processes start", min(e["t_process"] for e in starts)),
              ("imports", max(e["t_imported"] for e in starts)),
              ("hvd.init", max(e["t_init"] for e in starts)),
              ("the script's setup", max(e["t"] for e in starts)),
              ("restore and sync", max(e["t"] for e in _of(worlds[w], "synced"))),
              ("first step", min(e["t"] for e in _of(worlds[w], "first_step")))]
    parts, before = [], acted
    for name, at in phases:
        parts.append(f"{name} {at - before:.1f}")
        before = at
    return f"{before - acted:.1f} s ({', '.join(parts)})"


def test_reference_run(jobs):
    job, worlds = jobs("reference")
    assert job.returncode == 0, job.output
    done = _check_history(job, worlds, [4], [{"hvdnode1", "hvdnode2"}])
    assert done[0]["loss"] < 1e-3, done[0]["loss"]


def test_sigkilled_worker_resumes_from_the_last_commit(jobs):
    job, worlds = jobs("sigkill")
    assert job.returncode == 0, job.output
    done = _check_history(job, worlds, [4, 4], [{"hvdnode1", "hvdnode2"},
                                                 {"hvdnode1", "hvdnode3"}])
    assert "blacklisted hvdnode2" in job.stderr, job.stderr[-3000:]
    ref_job, ref_worlds = jobs("reference")
    reference = _check_history(ref_job, ref_worlds, [4], [{"hvdnode1", "hvdnode2"}])
    # Same size in every world: the same samples in the same order, so the same weights.
    assert done[0]["checksum"] == reference[0]["checksum"], \
        (done[0]["weights"][:4], reference[0]["weights"][:4])
    print(f"\nsigkill: reset took {_reset_seconds(worlds, 1)}", file=sys.stderr)


def test_repeated_failures_stop_at_the_reset_limit(jobs):
    job, worlds = jobs("limit")
    assert job.returncode == 1, job.output
    assert "exceeded the limit: 1" in job.stderr, job.stderr[-3000:]
    _check_history(job, worlds, [4, 3], [{"hvdnode1", "hvdnode2", "hvdnode3"},
                                         {"hvdnode1", "hvdnode2"}])
    # world 1 died inside a commit: the commit it was making is the newest saved one
    acted = _of(worlds[1], "act")
    assert [e["action"] for e in acted] == ["commit_kill", "commit_kill"], acted
    print(f"\nexit status 3: reset took {_reset_seconds(worlds, 1)}", file=sys.stderr)


def test_hosts_added_by_discovery_and_a_host_removed(jobs):
    job, worlds = jobs("discovery")
    assert job.returncode == 0, job.output
    done = _check_history(job, worlds, [2, 4, 2], [{"hvdnode1"}, {"hvdnode1", "hvdnode2"},
                                                   {"hvdnode1"}])
    grown = _of(worlds[1], "synced")[0]
    assert 0 < grown["processed"] < N and grown["epoch"] == 0, \
        f"world 1 should start mid-epoch 0: {grown}"
    # A host update rolls nothing back: world 1 starts from world 0's live state.
    steps_before = max(e["step"] for e in _of(worlds[0], "saved"))
    assert grown["step"] == steps_before
    reference = jobs("reference")[1]
    ref_weights = _of(reference[0], "done")[0]["weights"]
    for got, want in zip(done[0]["weights"], ref_weights):
        assert abs(got - want) < 1e-2, (done[0]["weights"], ref_weights)
    print(f"\nhost added: reset took {_reset_seconds(worlds, 1)}; host removed: "
          f"{_reset_seconds(worlds, 2)}", file=sys.stderr)
