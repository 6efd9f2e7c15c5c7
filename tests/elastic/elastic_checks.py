"""What every elastic test checks in the logs of tests/elastic/workers/elastic_worker.py: each world
resumes from the newest commit of the world before it with the same state on every rank, the
committed history holds every sample of every epoch exactly once (but for the padding of an
epoch's last round), and how long each reset took."""
from __future__ import annotations

import collections
import json
from pathlib import Path

N, EPOCHS = 240, 3   # the worker's data set size and its number of epochs


def read_logs(directory: Path) -> dict[int, list[dict]]:
    """world -> its events, in time order."""
    worlds: dict[int, list[dict]] = collections.defaultdict(list)
    for path in directory.glob("w*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                worlds[event["world"]].append(event)
    return {w: sorted(events, key=lambda e: e["t"]) for w, events in sorted(worlds.items())}


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["ev"] == kind]


def check_history(job, worlds: dict[int, list[dict]], sizes: list[int],
                  hosts: list[set[str]]) -> dict:
    """The checks every job shares (module docstring); returns the final 'done' events."""
    assert not job.timed_out, f"the elastic job hung\n{job.output}"
    assert sorted(worlds) == list(range(len(sizes))), \
        f"worlds {sorted(worlds)}, expected {len(sizes)}\n{job.output}"
    for w, events in worlds.items():
        starts = of(events, "start")
        assert sorted(e["rank"] for e in starts) == list(range(sizes[w])), \
            f"world {w}: ranks {sorted(e['rank'] for e in starts)}\n{job.output}"
        assert {e["host"] for e in starts} == hosts[w], f"world {w} ran on " \
            f"{ {e['host'] for e in starts} }, expected {hosts[w]}\n{job.output}"
        synced = of(events, "synced")
        assert len(synced) == sizes[w], f"world {w}: not every rank synced\n{job.output}"
        assert len({(e["step"], e["checksum"]) for e in synced}) == 1, \
            f"world {w}: ranks differ after the sync: {synced}"
        if w == 0:
            assert synced[0]["step"] == 0
            continue
        before = [e for e in of(worlds[w - 1], "saved")]
        newest = max(before, key=lambda e: e["step"])
        assert (synced[0]["step"], synced[0]["checksum"]) == (newest["step"],
                                                              newest["checksum"]), \
            (f"world {w} resumed from step {synced[0]['step']} ({synced[0]['checksum']}), but "
             f"the newest commit of world {w - 1} is step {newest['step']} "
             f"({newest['checksum']})")
    done = of(worlds[len(sizes) - 1], "done")
    if done:
        assert len(done) == sizes[-1] and len({e["checksum"] for e in done}) == 1, done
        check_samples(done[0]["seen"], max(sizes))
    return {e["rank"]: e for e in done}


def check_samples(seen: list, largest_size: int) -> None:
    """Every sample of every epoch once, but for at most ``largest_size - 1`` repeats from the
    padding of the epoch's last round (Horovod's ElasticSampler pads as DistributedSampler)."""
    by_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for epoch, indices in seen:
        by_epoch[epoch].update(indices)
    assert sorted(by_epoch) == list(range(EPOCHS)), sorted(by_epoch)
    for epoch, counts in by_epoch.items():
        skipped = sorted(set(range(N)) - set(counts))
        assert not skipped, f"epoch {epoch}: samples never trained on: {skipped}"
        repeats = sum(c - 1 for c in counts.values())
        assert repeats <= largest_size - 1, \
            f"epoch {epoch}: {repeats} samples trained on twice: " \
            f"{sorted(i for i, c in counts.items() if c > 1)}"


def reset_seconds(worlds: dict[int, list[dict]], w: int) -> str:
    """From the first failure of world w - 1 (or its last save, where hosts changed without
    one) to world w's first step, and where the time went (the slowest rank of each phase)."""
    acts = of(worlds[w - 1], "act")
    acted = min(e["t"] for e in acts) if acts else max(e["t"] for e in of(worlds[w - 1],
                                                                         "saved"))
    starts = of(worlds[w], "start")
    phases = [("until the new processes start", min(e["t_process"] for e in starts)),
              ("imports", max(e["t_imported"] for e in starts)),
              ("hvd.init", max(e["t_init"] for e in starts)),
              ("the script's setup", max(e["t"] for e in starts)),
              ("restore and sync", max(e["t"] for e in of(worlds[w], "synced"))),
              ("first step", min(e["t"] for e in of(worlds[w], "first_step")))]
    parts, before = [], acted
    for name, at in phases:
        parts.append(f"{name} {at - before:.1f}")
        before = at
    return f"{before - acted:.1f} s ({', '.join(parts)})"


