#!/usr/bin/env python3
"""Autotune against an exhaustive grid, measured in the same MPI job.

Run it under MPI, for example::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/autotune_benchmark.py

For each workload it runs, in one job (re-initializing hvdlite for every setting, which takes
a few milliseconds):

1. the grid: every combination of fusion threshold (``--grid-fusion-mb``), cycle time
   (``--grid-cycle-ms``) and response cache on/off, ``--steps`` timed steps each;
2. autotune (``HVDLITE_AUTOTUNE=1``, starting from the workload's configured settings, with
   ``--warmup-samples``, ``--steps-per-sample`` and ``--max-samples``) until it has finished;
3. alternating blocks (``--blocks``) of the tuned setting, the grid's best and the workload's
   configured setting ("default"), ``--steps`` steps each, so that load from other processes
   hits all three alike; each one's throughput is its best block (the least disturbed by
   other load: on a shared machine blocks of one setting vary twofold), the median beside it.

It prints tuned/best and tuned/default (steps per second) per workload.  The workloads:

* ``large_cycle``: many small gradients (32 of 16 KiB) submitted as a stream (as the torch
  optimizer's hooks do) with a bounded number in flight, under a configured cycle time of
  50 ms: each round waits out the cycle before it negotiates;
* ``small_fusion``: 128 gradients of 32 KiB submitted together under a 32 KiB fusion
  threshold: one allreduce each instead of a few fused ones;
* ``defaults_good``: 64 named 1 KiB tensors with hvdlite's defaults (1 ms cycle, 128 MiB
  fusion, cache on), which the grid finds (about) best.

Every step's results are checked against the expected sums on the first timed step of each
setting.  Only rank 0 prints; ``--json PATH`` also writes the results.  The hierarchical
switches are tuned only where the job spans hosts; this benchmark runs on one host.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))   # benchmark this checkout's hvdlite

import numpy as np  # noqa: E402

import hvdlite as hvd  # noqa: E402
from hvdlite.common.runtime import state  # noqa: E402

KNOBS = ("FUSION_THRESHOLD", "CYCLE_TIME", "CACHE_CAPACITY", "AUTOTUNE",
         "AUTOTUNE_WARMUP_SAMPLES", "AUTOTUNE_STEPS_PER_SAMPLE",
         "AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "AUTOTUNE_LOG")
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="large_cycle,small_fusion,defaults_good")
    p.add_argument("--grid-fusion-mb", default="0.03125,1,8,64")
    p.add_argument("--grid-cycle-ms", default="1,5,25,50")
    p.add_argument("--steps", type=int, default=10, help="timed steps per grid point / block")
    p.add_argument("--blocks", type=int, default=7, help="alternating blocks at the end")
    p.add_argument("--warmup-samples", type=int, default=1)
    p.add_argument("--steps-per-sample", type=int, default=None,
                   help="autotune's steps_per_sample (default: the workload's, chosen so "
                        "that a sample lasts well over the machine's scheduling noise)")
    p.add_argument("--max-samples", type=int, default=10,
                   help="autotune's bayes_opt_max_samples")
    p.add_argument("--log-dir", default=None, help="keep each workload's autotune CSV here")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    return p.parse_args(argv)


# --- workloads: (the configured knobs, how one step runs) ----------------------------------------
def large_cycle_step(step: int, check: bool) -> None:
    engine = state.engine()
    grads = [np.full(4096, float(hvd.rank() + i + step), np.float32) for i in range(32)]
    handles = []
    engine.stream_open()
    try:
        for i, g in enumerate(grads):
            handles.append(hvd.allreduce_async(g, op=hvd.Sum, name=f"lc.{i}"))
            if (i + 1) % 8 == 0:   # a bounded number in flight: wait for the oldest bucket
                for h in handles[i - 7:i + 1]:
                    hvd.synchronize(h)
    finally:
        engine.stream_close()
    if check:
        _check([hvd.synchronize(h) for h in handles],
               [float(sum(r + i + step for r in range(hvd.size()))) for i in range(32)])


def small_fusion_step(step: int, check: bool) -> None:
    handles = [hvd.allreduce_async(np.full(8192, float(hvd.rank() + i + step), np.float32),
                                   op=hvd.Sum, name=f"sf.{i}") for i in range(128)]
    out = [hvd.synchronize(h) for h in handles]
    if check:
        _check(out, [float(sum(r + i + step for r in range(hvd.size()))) for i in range(128)])


def defaults_good_step(step: int, check: bool) -> None:
    handles = [hvd.allreduce_async(np.full(256, float(hvd.rank() + i + step), np.float32),
                                   op=hvd.Sum, name=f"dg.{i}") for i in range(64)]
    out = [hvd.synchronize(h) for h in handles]
    if check:
        _check(out, [float(sum(r + i + step for r in range(hvd.size()))) for i in range(64)])


def _check(results, wanted) -> None:
    for k, (got, want) in enumerate(zip(results, wanted)):
        if not np.all(got == want):
            raise AssertionError(f"tensor {k}: got {got[:3]}, want {want}")


# name -> (configured knobs, one step, autotune's steps_per_sample: a step of tens of ms needs
# fewer than one of a few ms for a sample to last a fraction of a second)
WORKLOADS = {
    "large_cycle": ({"CYCLE_TIME": "50"}, large_cycle_step, 2),
    "small_fusion": ({"FUSION_THRESHOLD": str(32 * 1024)}, small_fusion_step, 2),
    "defaults_good": ({}, defaults_good_step, 10),
}


# --- running a setting -------------------------------------------------------------------------
def start(knobs: dict[str, str]) -> None:
    for name in KNOBS:
        os.environ.pop("HVDLITE_" + name, None)
        os.environ.pop("HOROVOD_" + name, None)
    os.environ.update({"HVDLITE_" + k: v for k, v in knobs.items()})
    hvd.init()


def setting_knobs(fusion_mb: float, cycle_ms: float, cache: bool) -> dict[str, str]:
    return {"FUSION_THRESHOLD": str(int(fusion_mb * MIB)), "CYCLE_TIME": repr(float(cycle_ms)),
            "CACHE_CAPACITY": "1024" if cache else "0"}


def timed(step_fn, steps: int, first: int) -> float:
    """Steps per second over ``steps`` steps (after two untimed ones), the slowest rank's."""
    step_fn(first, True)
    step_fn(first + 1, False)
    hvd.barrier()
    t0 = time.perf_counter()
    for s in range(steps):
        step_fn(first + 2 + s, False)
    hvd.barrier()
    elapsed = hvd.allreduce(np.array([time.perf_counter() - t0]), op=hvd.Max, name="elapsed")
    return steps / float(elapsed[0])


def measure(knobs: dict[str, str], step_fn, steps: int) -> float:
    start(knobs)
    try:
        return timed(step_fn, steps, 0)
    finally:
        hvd.shutdown()


def autotune(configured: dict[str, str], step_fn, steps_per_sample: int, args,
             log: str | None):
    """Run the workload under autotune until it finishes: (tuned knobs, the setting, steps,
    seconds)."""
    start({**configured, "AUTOTUNE": "1", "AUTOTUNE_WARMUP_SAMPLES": str(args.warmup_samples),
           "AUTOTUNE_STEPS_PER_SAMPLE": str(steps_per_sample),
           "AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(args.max_samples),
           **({"AUTOTUNE_LOG": log} if log else {})})
    try:
        manager = state.engine().retuner.manager
        t0, step = time.perf_counter(), 0
        while True:
            step_fn(step, step == 0)
            step += 1
            done = hvd.allreduce(np.array([0 if manager.active else 1]), op=hvd.Min,
                                 name="tuning.done")
            if done[0]:
                break
        seconds = time.perf_counter() - t0
        config = state.engine().config
        tuned = {"FUSION_THRESHOLD": str(config.fusion_threshold),
                 "CYCLE_TIME": repr(config.cycle_time_ms),
                 "CACHE_CAPACITY": str(config.cache_capacity)}
        setting = (config.fusion_threshold / MIB, config.cycle_time_ms, config.cache_capacity > 0)
        return tuned, setting, step, seconds
    finally:
        hvd.shutdown()


def run_workload(name: str, args) -> dict:
    configured, step_fn, steps_per_sample = WORKLOADS[name]
    if args.steps_per_sample is not None:
        steps_per_sample = args.steps_per_sample
    grid = {}
    for fusion, cycle, cache in itertools.product(
            [float(v) for v in args.grid_fusion_mb.split(",")],
            [float(v) for v in args.grid_cycle_ms.split(",")], (False, True)):
        grid[(fusion, cycle, cache)] = measure(setting_knobs(fusion, cycle, cache), step_fn,
                                               args.steps)
    best = max(grid, key=grid.get)
    log = os.path.join(args.log_dir, f"autotune-{name}.csv") if args.log_dir else None
    tuned, setting, tune_steps, tune_seconds = autotune(configured, step_fn, steps_per_sample,
                                                        args, log)
    contenders = {"tuned": tuned, "grid best": setting_knobs(*best), "default": configured}
    blocks = {label: [] for label in contenders}
    for _ in range(args.blocks):
        for label, knobs in contenders.items():
            blocks[label].append(measure(knobs, step_fn, args.steps))
    rate = {label: max(v) for label, v in blocks.items()}
    median = {label: statistics.median(v) for label, v in blocks.items()}
    return {"workload": name, "configured": configured,
            "grid": [{"fusion_mb": f, "cycle_ms": c, "cache": k, "steps_per_s": v}
                     for (f, c, k), v in grid.items()],
            "grid_best": {"fusion_mb": best[0], "cycle_ms": best[1], "cache": best[2]},
            "tuned": {"fusion_mb": setting[0], "cycle_ms": setting[1], "cache": setting[2],
                      "tuning_steps": tune_steps, "tuning_seconds": tune_seconds},
            "steps_per_s": rate, "median_steps_per_s": median, "blocks": blocks,
            "steps_per_sample": steps_per_sample,
            "tuned_over_best": rate["tuned"] / rate["grid best"],
            "tuned_over_default": rate["tuned"] / rate["default"],
            "median_tuned_over_best": median["tuned"] / median["grid best"],
            "median_tuned_over_default": median["tuned"] / median["default"]}


def main() -> None:
    args = parse_args()
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    results = []
    for name in args.workloads.split(","):
        result = run_workload(name, args)
        results.append(result)
        if rank == 0:
            r, t, b = result["steps_per_s"], result["tuned"], result["grid_best"]
            print(f"{name}: default {r['default']:.1f} steps/s, grid best {r['grid best']:.1f} "
                  f"({b['fusion_mb']:g} MB, {b['cycle_ms']:g} ms, cache "
                  f"{'on' if b['cache'] else 'off'}), tuned {r['tuned']:.1f} "
                  f"({t['fusion_mb']:.3g} MB, {t['cycle_ms']:.3g} ms, cache "
                  f"{'on' if t['cache'] else 'off'}; {t['tuning_steps']} steps, "
                  f"{t['tuning_seconds']:.1f} s to tune): tuned/best "
                  f"{result['tuned_over_best']:.2f}, tuned/default "
                  f"{result['tuned_over_default']:.2f} (medians: "
                  f"{result['median_tuned_over_best']:.2f}, "
                  f"{result['median_tuned_over_default']:.2f})", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"size": MPI.COMM_WORLD.Get_size(), "workloads": results}, f, indent=1)


if __name__ == "__main__":
    main()
