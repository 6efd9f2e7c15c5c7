#!/usr/bin/env python3
"""Grouped operations: hvdlite's grouped allreduce, allgather and reducescatter against raw
mpi4py running the same members one by one, on the same buffers.

Run it under MPI, for example::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/grouped_benchmark.py

For each kind and each group size (``--counts``, members of ``--member-kib`` KiB of float32;
an allgather's ranks contribute different numbers of rows), it times:

* ``raw``: the members one after the other with mpi4py's blocking ``Allreduce``,
  ``Allgatherv`` or ``Reduce_scatter`` on a communicator of its own (the reference: no
  negotiation, no fusion, no threads);
* ``grouped``: ``hvd.grouped_<kind>(members, name=...)``, named, so every step after the first
  is served from the response cache (one bit for the whole group).

Blocks of raw and grouped iterations alternate (``--blocks``), each between barriers, so that
load from other processes hits both alike; every iteration is timed on its own and the reported
time is each rank's median, maximised over the ranks, in microseconds, with grouped/raw beside
it.  Every result is checked once against a numpy reference.  Only rank 0 prints; ``--json
PATH`` also writes the results.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))   # benchmark this checkout's hvdlite

import numpy as np  # noqa: E402

import hvdlite as hvd  # noqa: E402

if __name__ == "__main__":
    hvd.init()   # before mpi4py's MPI: under torchrun, hvd.init() forms the MPI world
from mpi4py import MPI  # noqa: E402

KINDS = ("allreduce", "allgather", "reducescatter")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="10,100", help="members per group (default 10,100)")
    p.add_argument("--member-kib", type=int, default=4, help="KiB per member (default 4)")
    p.add_argument("--iterations", type=int, default=100, help="timed iterations per block")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks (default 4)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    return p.parse_args(argv)


def members(kind: str, count: int, elements: int, rank: int, size: int) -> list[np.ndarray]:
    """This rank's inputs: small integers (float32 sums stay exact); an allgather's ranks
    contribute ``rank + 1`` rows each."""
    if kind == "allgather":
        rows, cols = rank + 1, max(1, elements // (size + 1))
        return [np.full((rows, cols), rank + i % 7, np.float32) for i in range(count)]
    rows = size * max(1, elements // (4 * size))
    return [np.full((rows, 4), rank + i % 7, np.float32) for i in range(count)]


def raw_step(comm, kind: str, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
    size = comm.Get_size()
    for x, out in zip(inputs, outputs):
        if kind == "allreduce":
            comm.Allreduce(x, out, op=MPI.SUM)
        elif kind == "reducescatter":
            comm.Reduce_scatter(x, out, [x.size // size] * size, op=MPI.SUM)
        else:
            counts = [(r + 1) * x.shape[1] for r in range(size)]
            comm.Allgatherv(x, [out, counts])


def raw_outputs(kind: str, inputs: list[np.ndarray], size: int) -> list[np.ndarray]:
    if kind == "allreduce":
        return [np.empty_like(x) for x in inputs]
    if kind == "reducescatter":
        return [np.empty((x.shape[0] // size, x.shape[1]), x.dtype) for x in inputs]
    rows = size * (size + 1) // 2
    return [np.empty((rows, x.shape[1]), x.dtype) for x in inputs]


def grouped_call(kind: str, name: str) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    fn = getattr(hvd, f"grouped_{kind}")
    if kind == "allgather":
        return lambda xs: fn(xs, name=name)
    return lambda xs: fn(xs, op=hvd.Sum, name=name)


def expected(kind: str, count: int, elements: int, size: int, rank: int) -> list[np.ndarray]:
    every = [members(kind, count, elements, r, size) for r in range(size)]
    out = []
    for i in range(count):
        parts = [every[r][i] for r in range(size)]
        if kind == "allgather":
            out.append(np.concatenate(parts))
        else:
            total = sum(parts)
            if kind == "reducescatter":
                total = np.array_split(total, size)[rank]
            out.append(total)
    return out


def timed(step: Callable[[], object], barrier: Callable[[], object], n: int) -> list[float]:
    barrier()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def measure(comm, kind: str, count: int, args) -> dict:
    rank, size = comm.Get_rank(), comm.Get_size()
    elements = args.member_kib * 1024 // 4
    inputs = members(kind, count, elements, rank, size)
    outputs = raw_outputs(kind, inputs, size)
    call = grouped_call(kind, f"bench.{kind}.{count}")
    want = expected(kind, count, elements, size, rank)
    for got in (call(inputs), None):
        if got is None:
            raw_step(comm, kind, inputs, outputs)
            got = outputs
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    for _ in range(5):   # warm up both
        call(inputs)
        raw_step(comm, kind, inputs, outputs)
    raw, grouped = [], []
    for _ in range(args.blocks):
        raw += timed(lambda: raw_step(comm, kind, inputs, outputs), comm.Barrier,
                     args.iterations)
        grouped += timed(lambda: call(inputs), hvd.barrier, args.iterations)
    medians = np.empty(2)
    comm.Allreduce(np.array([statistics.median(raw), statistics.median(grouped)]), medians,
                   op=MPI.MAX)
    return {"kind": kind, "count": count, "member_kib": args.member_kib,
            "raw_us": medians[0] * 1e6, "grouped_us": medians[1] * 1e6,
            "ratio": medians[1] / medians[0]}


def main(argv=None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD.Dup()
    results = []
    for kind in [k for k in args.kinds.split(",") if k]:
        for count in [int(c) for c in args.counts.split(",") if c]:
            results.append(measure(comm, kind, count, args))
    if comm.Get_rank() == 0:
        print(f"grouped operations, {comm.Get_size()} ranks, members of {args.member_kib} KiB "
              f"(median us per call, max over ranks; raw = mpi4py member by member)")
        print(f"{'kind':<14}{'members':>8}{'raw':>12}{'grouped':>12}{'grouped/raw':>13}")
        for r in results:
            print(f"{r['kind']:<14}{r['count']:>8}{r['raw_us']:>12.1f}{r['grouped_us']:>12.1f}"
                  f"{r['ratio']:>13.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    comm.Free()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
