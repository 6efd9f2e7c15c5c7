#!/usr/bin/env python3
"""The cost of an hvdlite.jax collective inside ``jax.jit`` against the same collective called
eagerly, and against raw mpi4py, on the same buffers, in the same run.

Run it under MPI, for example::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/jax_collectives.py

For each size (``--sizes``, float32 elements) it times, per call:

* ``raw``: mpi4py's blocking ``Allreduce`` (Sum) of a numpy array on a communicator of its own
  (no negotiation, no engine thread, no JAX);
* ``eager``: ``hvd.allreduce(x, op=hvd.Sum, name=...)`` on a concrete ``jax.Array`` (zero-copy
  numpy view in, ``jnp.asarray`` out), named, so steps after the first come from the response
  cache;
* ``jit``: a ``jax.jit``-compiled function holding that one allreduce (unnamed: its name is
  drawn when it runs, see hvdlite/jax/bridge.py), called and waited for
  (``block_until_ready``): the dispatch of the compiled function, the ordered ``io_callback``
  into Python, and the collective;
* ``jit-named``: the same with ``name=`` given (response cache as for eager).

Blocks of the four alternate (``--blocks``), each between barriers, so that load from other
processes hits them alike; the reported time is each rank's median per call, maximised over
the ranks, in microseconds.  Every result is checked against the numpy reference.  Only rank 0
prints; ``--json PATH`` also writes the results.
"""
from __future__ import annotations

import argparse
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hvdlite.jax as hvd  # noqa: E402

MODES = ("raw", "eager", "jit", "jit-named")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,1024,262144",
                   help="comma-separated float32 element counts")
    p.add_argument("--iterations", type=int, default=200, help="calls per block")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks per mode")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", default="", help="also write the results here (rank 0)")
    return p.parse_args(argv)


def timed(fn, iterations: int) -> list[float]:
    out = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    hvd.init()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    rank, size = hvd.rank(), hvd.size()
    results = []
    for n in [int(s) for s in args.sizes.split(",")]:
        host = np.full(n, float(rank + 1), np.float32)
        x = jnp.asarray(host)
        want = np.full(n, float(sum(range(1, size + 1))), np.float32)
        raw_out = np.empty_like(host)
        jitted = jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum))
        named = jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum, name=f"bench.jit.{n}"))
        calls = {
            "raw": lambda: comm.Allreduce(host, raw_out, op=MPI.SUM),
            "eager": lambda: hvd.allreduce(x, op=hvd.Sum, name=f"bench.eager.{n}"),
            "jit": lambda: jitted(x).block_until_ready(),
            "jit-named": lambda: named(x).block_until_ready(),
        }
        for mode, call in calls.items():   # warm up (compile, cache) and check once
            for _ in range(args.warmup):
                got = call()
            got = raw_out if mode == "raw" else got
            assert np.array_equal(np.asarray(got), want), (mode, n)
        samples = {mode: [] for mode in MODES}
        for _ in range(args.blocks):
            for mode in MODES:
                comm.Barrier()
                samples[mode] += timed(calls[mode], args.iterations)
        medians = {mode: statistics.median(s) * 1e6 for mode, s in samples.items()}
        worst = {mode: max(comm.allgather(v)) for mode, v in medians.items()}
        results.append({"elements": n, "bytes": 4 * n, "us_per_call": worst})
    if rank == 0:
        print(f"hvdlite.jax allreduce (Sum, float32) at {size} ranks: median us per call, "
              f"worst rank")
        print(f"{'elements':>10} " + " ".join(f"{m:>10}" for m in MODES)
              + f" {'jit-eager':>10}")
        for r in results:
            us = r["us_per_call"]
            print(f"{r['elements']:>10} " + " ".join(f"{us[m]:>10.1f}" for m in MODES)
                  + f" {us['jit'] - us['eager']:>+10.1f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"ranks": size, "results": results},
                                                  indent=1))
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
