"""Autotune under real MPI (2 and 3 ranks), switching aggressively (one step per sample part,
one warm-up sample, four samples per cache setting): a soak of allreduces (fused and single),
allgathers with rows differing per rank, grouped allreduces and a step counter, with random
per-rank delays, while the tuner switches fusion threshold, cycle time and the response cache
between rounds.

* ``autotune.soak``: every result exact, step after step (the counter allreduce proves no
  result came from another step: nothing dropped or reordered);
* ``autotune.same_switches``: every rank switched to the same settings at the same rounds, and
  the tuner switched many times and finished, keeping the best sample's setting;
* ``autotune.log``: rank 0's CSV has Horovod's columns, a row per scored sample and the best
  last.
"""
import os
import random
import time

import numpy as np

import hvdlite as hvd
from hvdlite.common.runtime import state
from tests.workers._report import Reporter
from tests.workers.core_refs import attempt, check_exact

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
ENGINE = state.engine()
MANAGER = ENGINE.retuner.manager
LOG = ENGINE.config.autotune_log   # (set by HOROVOD_AUTOTUNE_LOG)
MAX_STEPS = 400
r = Reporter(RANK)
rng = random.Random(RANK)


def one_step(step: int) -> list:
    """One step's collectives, checked after all are issued (a failed check must not leave
    the other ranks waiting)."""
    checks = []
    handles = []
    for i in range(12):   # small tensors: fused, sizes varying per name
        x = np.full(50 + 97 * i, step * 10 + RANK + i, dtype=np.int64)
        want = np.full(x.shape, SIZE * (step * 10 + i) + SIZE * (SIZE - 1) // 2, np.int64)
        handles.append((f"small{i}", hvd.allreduce_async(x, op=hvd.Sum, name=f"ar.small{i}"),
                        want))
    big = np.full(300_000, RANK + step, dtype=np.float64)   # 2.4 MB: runs alone
    handles.append(("big", hvd.allreduce_async(big, op=hvd.Sum, name="ar.big"),
                    np.full(big.shape, SIZE * step + SIZE * (SIZE - 1) / 2, np.float64)))
    rows = np.full((RANK + 1, 3), step * 100 + RANK, dtype=np.int32)
    gathered = np.concatenate([np.full((q + 1, 3), step * 100 + q, np.int32)
                               for q in range(SIZE)])
    handles.append(("gather", hvd.allgather_async(rows, name="ag.rows"), gathered))
    if rng.random() < 0.5:
        time.sleep(rng.random() * 0.002)   # ranks out of step
    counter = np.array([step], dtype=np.int64)
    handles.append(("counter", hvd.allreduce_async(counter, op=hvd.Sum, name="ar.counter"),
                    np.array([step * SIZE], np.int64)))
    group = [np.full(7, step + RANK + k, dtype=np.int64) for k in range(3)]
    got_group = attempt(lambda: hvd.grouped_allreduce(group, op=hvd.Sum, name="grp"))
    for label, handle, want in handles:
        checks.append((f"step {step} {label}", attempt(lambda h=handle: hvd.synchronize(h)),
                       want))
    for k in range(3):
        want = np.full(7, SIZE * (step + k) + SIZE * (SIZE - 1) // 2, np.int64)
        got = got_group if isinstance(got_group, BaseException) else got_group[k]
        checks.append((f"step {step} group {k}", got, want))
    return checks


STEPS = 0


def soak_case() -> None:
    global STEPS
    failures = []
    step = 0
    while step < MAX_STEPS:
        for label, got, want in one_step(step):
            try:
                check_exact(label, got, want)
            except AssertionError as exc:
                failures.append(str(exc))
        step += 1
        # every rank stops at the same step: rank 0's tuner has finished and said so
        done = hvd.allreduce(np.array([0 if MANAGER.active else 1], np.int64), op=hvd.Min,
                             name="done")
        if done[0] == 1 and step >= 10:
            break
    STEPS = step
    assert not failures, failures[:5]


def same_switches_case() -> None:
    mine = [(at, s.to_vector()) for at, s in ENGINE.retuner.history]
    every = hvd.allgather_object(mine)
    assert all(h == every[0] for h in every), f"switch histories differ: {every}"
    assert not MANAGER.active, f"tuning did not finish in {STEPS} steps"
    opts = MANAGER.options
    # the initial setting, then one switch per scored sample: per on/off combination (the
    # cache; across hosts also the two hierarchical switches) max_samples + 1
    combos = MANAGER.space.combinations()
    samples = len(combos) * (opts.bayes_opt_max_samples + 1)
    assert len(mine) == samples + 1, (len(mine), samples)
    assert len({tuple(v) for _, v in mine}) >= 4, mine   # settings really changed
    rounds = [at for at, _ in mine]
    assert rounds == sorted(rounds) and len(set(rounds)) == len(rounds), rounds
    final = ENGINE.config
    if RANK == 0:
        best = max(MANAGER.samples, key=lambda s: s[1])[0]
        assert mine[-1][1] == best.to_vector(), (mine[-1], best)
    last = mine[-1][1]
    assert final.fusion_threshold == int(last[0] * 2**20) and final.cycle_time_ms == last[1]
    assert (final.cache_capacity > 0) == (last[2] > 0.5)
    if os.environ.get("HVDLITE_TEST_SPANS_HOSTS") == "1":   # (tests/multihost/test_autotune.py)
        assert len(combos) == 8, combos
        # the engine's hierarchical path ran with each switch both ways, as the tuner said
        assert {(v[3], v[4]) for _, v in mine} == {(0.0, 0.0), (0.0, 1.0), (1.0, 0.0),
                                                   (1.0, 1.0)}, mine
        hier = ENGINE.path("hierarchical")
        assert hier.allreduces > 0, "no hierarchical allreduce ran"
        assert hier.allreduce_on == (last[3] > 0.5) and hier.allgather_on == (last[4] > 0.5)
    else:
        assert len(combos) == 2, combos


def log_case() -> None:
    if RANK != 0:
        return
    with open(LOG) as f:
        lines = f.read().splitlines()
    assert lines[0] == ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,"
                        "cache_enabled,cycle_time_ms,tensor_fusion_threshold,score"), lines[0]
    rows = [line.split(",") for line in lines[1:]]
    assert len(rows) == len(MANAGER.samples) + 1, (len(rows), len(MANAGER.samples))
    assert all(len(row) == 7 for row in rows), rows
    best = max(MANAGER.samples, key=lambda s: s[1])
    assert rows[-1] == best[0].log_row(best[1]), (rows[-1], best)
    assert float(rows[-1][-1]) == max(float(row[-1]) for row in rows[:-1])


r.case("autotune.soak", soak_case)
r.case("autotune.same_switches", same_switches_case)
r.case("autotune.log", log_case)
r.write()
hvd.shutdown()
