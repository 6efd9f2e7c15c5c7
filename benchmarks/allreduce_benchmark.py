#!/usr/bin/env python3
"""Allreduce benchmark: hvdlite against raw mpi4py on the same float32 buffers.

Run it under MPI, for example::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/allreduce_benchmark.py

For every buffer size it times, on the same buffers:

* ``raw``: ``comm.Allreduce(send, recv, op=MPI.SUM)`` on a communicator of its own (the reference);
* ``allreduce``: hvdlite's out-of-place ``hvd.allreduce(send, op=hvd.Sum, name=...)``;
* ``allreduce_``: hvdlite's in-place ``hvd.allreduce_(work, op=hvd.Sum, name=...)``.

A third case times a synchronous allreduce of one float right after each rank "computed"
(slept, untimed) for ``--after-compute-ms`` plus up to a fifth of that again, drawn per rank, as
a training step ends with a metric average or a barrier: a rank's engine then starts from idle
and the first rank to arrive waits for its peer, raw MPI's blocking call and hvdlite alike.

It also times a "many small tensors" round (``--small-count`` tensors of ``--small-kib`` KiB
submitted with ``hvd.allreduce_async_`` and then all waited for) against one raw ``Allreduce`` of
the same total number of bytes.

Each case is warmed up first (which also fills hvdlite's response cache, since every tensor has a
fixed name).  The cases of one size are then timed in interleaved blocks (raw, allreduce,
allreduce_, raw, ...; ``--blocks``), each block between two barriers (the raw communicator's
``Barrier`` for raw blocks, ``hvd.barrier()`` for hvdlite blocks), so that load from other
processes on a shared machine hits all of them alike.  Every iteration is timed on its own; the
reported time is each rank's median iteration time, maximised over the ranks, in milliseconds.
In-place inputs are refilled (untimed) before every iteration, since summing in place would
otherwise grow them every time.  Every variant is checked once per size against a numpy
reference, so a fast but wrong path cannot look good.  Only rank 0 prints; ``--json PATH`` also
writes the results as JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))   # benchmark this checkout's hvdlite

import numpy as np  # noqa: E402

import hvdlite as hvd  # noqa: E402

if __name__ == "__main__":
    hvd.init()   # before mpi4py's MPI: under torchrun, hvd.init() forms the MPI world
from mpi4py import MPI  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
DTYPE = np.float32
DEFAULT_SIZES = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"
BYTES_PER_CASE = 1024 * MIB        # auto-scaling: about this many bytes reduced per timed case
DEFAULT_MAX_ITERATIONS = 2000
DEFAULT_MIN_ITERATIONS = 10
DEFAULT_TIME_BUDGET = 4.0          # seconds of timed iterations per size, all variants together
DEFAULT_BLOCKS = 5
MAX_WARMUP = 50
TARGET_RANKS = 2                   # hvdlite's performance targets are stated for 2 ranks
PATTERN_PERIOD = 251               # small integers: float32 sums stay exact

_UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
          "g": 1024 * MIB, "gb": 1024 * MIB, "gib": 1024 * MIB}


# --- command line ------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes in a size such as ``4KiB``, ``16k``, ``1MiB``, ``64M`` or ``4096``."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read buffer size {text!r} (try 4KiB or 1MiB)")
    nbytes = int(match.group(1)) * _UNITS[unit]
    itemsize = np.dtype(DTYPE).itemsize
    if nbytes <= 0 or nbytes % itemsize:
        raise argparse.ArgumentTypeError(f"buffer size {text!r} must be a positive multiple of "
                                         f"{itemsize} bytes (float32)")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    """Comma-separated list of sizes, see :func:`parse_size`."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (identical on every rank, so every rank runs the same cases)."""
    parser = argparse.ArgumentParser(
        description="Time hvdlite's allreduce against raw mpi4py Allreduce (run under mpiexec).")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        help=f"comma-separated float32 buffer sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--iterations", type=int, default=DEFAULT_MAX_ITERATIONS,
                        help="timed iterations per case for small buffers; larger buffers are "
                             f"scaled down to about {BYTES_PER_CASE // MIB} MiB reduced per case "
                             f"(default {DEFAULT_MAX_ITERATIONS})")
    parser.add_argument("--min-iterations", type=int, default=DEFAULT_MIN_ITERATIONS,
                        help="never fewer timed iterations than this; set it equal to "
                             f"--iterations for a fixed count (default {DEFAULT_MIN_ITERATIONS})")
    parser.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET, metavar="S",
                        help="at most about this many seconds of timed iterations per size, "
                             "estimated from the warm-up; keeps slow or oversubscribed runs "
                             f"short (default {DEFAULT_TIME_BUDGET:g})")
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS,
                        help="interleave the cases of one size in this many blocks of timed "
                             f"iterations (default {DEFAULT_BLOCKS})")
    parser.add_argument("--small-count", type=int, default=200,
                        help="tensors in the many-small-tensors round (0 skips it; default 200)")
    parser.add_argument("--small-kib", type=int, default=16,
                        help="size of each small tensor in KiB (default 16)")
    parser.add_argument("--after-compute-ms", type=float, default=20.0,
                        help="compute time (a sleep) before each allreduce of the after-compute "
                             "case (0 skips it; default 20)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if min(args.iterations, args.min_iterations, args.blocks) < 1 or args.time_budget <= 0:
        parser.error("--iterations, --min-iterations and --blocks must be at least 1 and "
                     "--time-budget positive")
    if args.small_count < 0 or args.small_kib < 1:
        parser.error("--small-count must be >= 0 and --small-kib >= 1")
    if args.after_compute_ms < 0:
        parser.error("--after-compute-ms must not be negative")
    return args


def iterations_for(nbytes: int, args: argparse.Namespace) -> int:
    """Planned timed iterations for a buffer of ``nbytes``: fewer for big buffers, within the
    limits (:func:`measure` may cut them further to respect ``--time-budget``)."""
    scaled = BYTES_PER_CASE // nbytes
    return max(args.min_iterations, min(args.iterations, scaled))


def warmup_for(iterations: int) -> int:
    """Untimed warm-up iterations before a case of ``iterations`` timed ones."""
    return max(2, min(MAX_WARMUP, iterations // 10))


# --- formatting --------------------------------------------------------------------------------
def format_size(nbytes: int) -> str:
    """``4 KiB``, ``1 MiB``, or bytes when not a whole number of KiB."""
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    if nbytes >= MIB:
        return f"{nbytes / MIB:.3g} MiB"
    return f"{nbytes} B"


def say(*lines: str) -> None:
    """Print on rank 0 only."""
    if hvd.rank() == 0:
        print("\n".join(lines), flush=True)


# --- data and correctness ----------------------------------------------------------------------
def rank_data(count: int, rank: int, offset: int = 0) -> np.ndarray:
    """This rank's input: small integers (exact in float32) that differ per element and rank."""
    pattern = (np.arange(count, dtype=np.int64) + offset) % PATTERN_PERIOD
    return (pattern * (rank + 1)).astype(DTYPE)


def expected_sum(count: int, size: int, offset: int = 0) -> np.ndarray:
    """numpy reference for the sum over ``size`` ranks of :func:`rank_data`."""
    pattern = (np.arange(count, dtype=np.int64) + offset) % PATTERN_PERIOD
    return (pattern * (size * (size + 1) // 2)).astype(DTYPE)


def agree(ok: bool, comm) -> bool:
    """True only if ``ok`` holds on every rank."""
    return bool(comm.allreduce(int(ok), op=MPI.MIN))


# --- timing ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    """Per-iteration times of one case, each statistic maximised over the ranks."""

    iterations: int
    median_ms: float
    p10_ms: float
    p90_ms: float


def summarize(samples: list[float], comm) -> Timing:
    """Median and spread of this rank's samples (seconds), maximised over all ranks, in ms."""
    ordered = sorted(samples)
    local = np.array([statistics.median(ordered), ordered[len(ordered) // 10],
                      ordered[(len(ordered) * 9) // 10]]) * 1e3
    worst = np.empty_like(local)
    comm.Allreduce(local, worst, op=MPI.MAX)
    return Timing(len(samples), *(float(v) for v in worst))


@dataclasses.dataclass
class Case:
    """One timed operation: ``step`` is timed, ``prepare`` (if any) runs untimed before it."""

    step: Callable[[], object]
    barrier: Callable[[], None]
    prepare: Callable[[], None] | None = None
    samples: list[float] = dataclasses.field(default_factory=list)

    def run(self, iterations: int, record: bool = True) -> float:
        """``iterations`` steps between two barriers, each timed if ``record``; returns the
        seconds the steps and their preparation took."""
        clock = time.perf_counter
        prepare, step = self.prepare, self.step
        self.barrier()
        began = clock()
        for _ in range(iterations):
            if prepare is not None:
                prepare()
            start = clock()
            step()
            if record:
                self.samples.append(clock() - start)
        elapsed = clock() - began
        self.barrier()
        return elapsed


def block_sizes(iterations: int, blocks: int) -> list[int]:
    """Split ``iterations`` into at most ``blocks`` nearly equal, non-empty parts."""
    blocks = max(1, min(blocks, iterations))
    return [iterations // blocks + (i < iterations % blocks) for i in range(blocks)]


def affordable_iterations(seconds_per_iteration: float, args: argparse.Namespace, comm) -> int:
    """Iterations that fit in ``--time-budget`` at the slowest rank's warm-up pace."""
    slowest = comm.allreduce(seconds_per_iteration, op=MPI.MAX)   # every rank must agree
    return int(args.time_budget / slowest) if slowest > 0 else args.iterations


def measure(cases: Sequence[Case], planned: int, args: argparse.Namespace, comm) -> None:
    """Warm every case up, then time them in interleaved blocks (A B C A B C ...), so that load
    changes on a shared machine hit every case alike instead of skewing their ratio.

    Runs ``planned`` timed iterations per case, or fewer (never below ``--min-iterations``) if
    the warm-up shows they would not fit in ``--time-budget``.
    """
    warmup = warmup_for(planned)
    per_iteration = sum(case.run(warmup, record=False) for case in cases) / warmup
    iterations = max(args.min_iterations,
                     min(planned, affordable_iterations(per_iteration, args, comm)))
    for count in block_sizes(iterations, args.blocks):
        for case in cases:
            gc.collect()
            case.run(count)


def ratio(reference: Timing, measured: Timing) -> float:
    """raw/hvdlite time: 1.0 is as fast as raw MPI, above 1 is faster."""
    return reference.median_ms / measured.median_ms if measured.median_ms > 0 else float("inf")


# --- cases -------------------------------------------------------------------------------------
@dataclasses.dataclass
class SizeResult:
    """All three variants for one buffer size."""

    nbytes: int
    raw: Timing
    allreduce: Timing
    allreduce_inplace: Timing
    correct: bool

    def as_dict(self) -> dict:
        return {"bytes": self.nbytes, "size": format_size(self.nbytes), "correct": self.correct,
                "raw": dataclasses.asdict(self.raw),
                "allreduce": dataclasses.asdict(self.allreduce),
                "allreduce_ratio": ratio(self.raw, self.allreduce),
                "allreduce_inplace": dataclasses.asdict(self.allreduce_inplace),
                "allreduce_inplace_ratio": ratio(self.raw, self.allreduce_inplace)}


def comparison(raw: Timing, hvdlite: Timing, correct: bool) -> dict:
    """The JSON fields of a case timed raw and through hvdlite."""
    return {"correct": correct, "raw": dataclasses.asdict(raw),
            "hvdlite": dataclasses.asdict(hvdlite), "ratio": ratio(raw, hvdlite)}


@dataclasses.dataclass
class SmallResult:
    """The many-small-tensors round against one raw Allreduce of the same bytes."""

    count: int
    tensor_bytes: int
    raw: Timing
    hvdlite: Timing
    correct: bool

    def as_dict(self) -> dict:
        return {"count": self.count, "tensor_bytes": self.tensor_bytes,
                "total_bytes": self.count * self.tensor_bytes,
                **comparison(self.raw, self.hvdlite, self.correct)}


@dataclasses.dataclass
class AfterComputeResult:
    """A one-float allreduce right after each rank computed, raw and hvdlite."""

    compute_ms: float
    raw: Timing
    hvdlite: Timing
    correct: bool

    def as_dict(self) -> dict:
        return {"compute_ms": self.compute_ms,
                **comparison(self.raw, self.hvdlite, self.correct)}


def check_size(send: np.ndarray, recv: np.ndarray, work: np.ndarray, names: tuple[str, str],
               comm) -> bool:
    """Run each variant once and compare with the numpy reference (on every rank)."""
    expected = expected_sum(send.size, comm.Get_size())
    comm.Allreduce(send, recv, op=MPI.SUM)
    ok = np.array_equal(recv, expected)
    ok &= np.array_equal(hvd.allreduce(send, op=hvd.Sum, name=names[0]), expected)
    np.copyto(work, send)
    ok &= hvd.allreduce_(work, op=hvd.Sum, name=names[1]) is work
    ok &= np.array_equal(work, expected)
    return agree(ok, comm)


def bench_size(nbytes: int, args: argparse.Namespace, comm) -> SizeResult:
    """Time raw, out-of-place and in-place allreduce of one float32 buffer size."""
    count = nbytes // np.dtype(DTYPE).itemsize
    send = rank_data(count, comm.Get_rank())
    recv = np.empty_like(send)
    work = np.empty_like(send)      # in-place target, refilled from ``send`` before each step
    names = (f"bench.allreduce.{nbytes}", f"bench.allreduce_.{nbytes}")
    correct = check_size(send, recv, work, names, comm)
    planned = iterations_for(nbytes, args)

    raw = Case(lambda: comm.Allreduce(send, recv, op=MPI.SUM), comm.Barrier)
    out_of_place = Case(lambda: hvd.allreduce(send, op=hvd.Sum, name=names[0]), hvd.barrier)
    in_place = Case(lambda: hvd.allreduce_(work, op=hvd.Sum, name=names[1]), hvd.barrier,
                    prepare=lambda: np.copyto(work, send))
    measure((raw, out_of_place, in_place), planned, args, comm)
    return SizeResult(nbytes, summarize(raw.samples, comm), summarize(out_of_place.samples, comm),
                      summarize(in_place.samples, comm), correct)


def small_round(tensors: list[np.ndarray]) -> None:
    """Submit every small tensor in place, then wait for all of them."""
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"small.{i}")
               for i, t in enumerate(tensors)]
    for handle in handles:
        handle.wait()


def refill(tensors: list[np.ndarray], sources: list[np.ndarray]) -> None:
    """Restore the small tensors' inputs (in-place sums would otherwise grow every round)."""
    for tensor, source in zip(tensors, sources):
        np.copyto(tensor, source)


def check_small(tensors: list[np.ndarray], sources: list[np.ndarray], comm) -> bool:
    """One small-tensor round compared with the numpy reference."""
    refill(tensors, sources)
    small_round(tensors)
    size = comm.Get_size()
    ok = all(np.array_equal(t, expected_sum(t.size, size, offset=i))
             for i, t in enumerate(tensors))
    return agree(ok, comm)


def bench_small(args: argparse.Namespace, comm) -> SmallResult:
    """Many small in-place async allreduces per round against one raw Allreduce of the total."""
    count = args.small_kib * KIB // np.dtype(DTYPE).itemsize
    rank = comm.Get_rank()
    sources = [rank_data(count, rank, offset=i) for i in range(args.small_count)]
    tensors = [s.copy() for s in sources]
    correct = check_small(tensors, sources, comm)
    total = np.concatenate(sources)
    total_out = np.empty_like(total)
    planned = iterations_for(total.nbytes, args)

    raw = Case(lambda: comm.Allreduce(total, total_out, op=MPI.SUM), comm.Barrier)
    rounds = Case(lambda: small_round(tensors), hvd.barrier,
                  prepare=lambda: refill(tensors, sources))
    measure((raw, rounds), planned, args, comm)
    return SmallResult(args.small_count, count * np.dtype(DTYPE).itemsize,
                       summarize(raw.samples, comm), summarize(rounds.samples, comm), correct)


def bench_after_compute(args: argparse.Namespace, comm) -> AfterComputeResult:
    """Blocking one-float allreduces, each after an untimed 'compute' (a sleep) whose length
    differs per rank and step, so the ranks arrive apart as in training."""
    rng = np.random.default_rng(1000 + comm.Get_rank())
    seconds = args.after_compute_ms / 1e3

    def compute() -> None:
        time.sleep(seconds * (1.0 + rng.uniform(0.0, 0.2)))
    one = np.ones(1, DTYPE)
    out = np.empty_like(one)
    size = comm.Get_size()
    comm.Allreduce(one, out, op=MPI.SUM)
    ok = out[0] == size   # both calls on every rank, whatever the first says: they are collective
    ok &= hvd.allreduce(one, op=hvd.Sum, name="after_compute")[0] == size
    correct = agree(ok, comm)
    raw = Case(lambda: comm.Allreduce(one, out, op=MPI.SUM), comm.Barrier, prepare=compute)
    hvdlite = Case(lambda: hvd.allreduce(one, op=hvd.Sum, name="after_compute"), hvd.barrier,
                   prepare=compute)
    measure((raw, hvdlite), args.iterations, args, comm)
    return AfterComputeResult(args.after_compute_ms, summarize(raw.samples, comm),
                              summarize(hvdlite.samples, comm), correct)


# --- environment and report --------------------------------------------------------------------
def hvdlite_settings() -> dict:
    """hvdlite's effective engine settings (rank 0's environment, broadcast by ``hvd.init()``)."""
    from hvdlite.common.runtime import state
    from hvdlite.common.config import Config
    try:
        config = state.engine().config
    except AttributeError:
        config = Config.from_env()
    return dataclasses.asdict(config)


def load_average() -> float | None:
    """This host's 1-minute load average (other work on a shared machine skews timings)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def environment(comm) -> dict:
    """What the numbers depend on: ranks, versions, MPI library, threads, hvdlite settings."""
    thread_levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                     MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    hosts = sorted(set(comm.allgather(MPI.Get_processor_name())))
    return {
        "ranks": comm.Get_size(),
        "hosts": hosts,
        "hvdlite_version": hvd.__version__,
        "hvdlite_path": str(Path(hvd.__file__).resolve().parent),
        "mpi_library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
        "mpi_thread_level": thread_levels.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "mpi4py_version": sys.modules["mpi4py"].__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "load_average_at_start": load_average(),
        "hvdlite_settings": hvdlite_settings(),
    }


def environment_lines(env: dict) -> list[str]:
    """Human-readable environment header."""
    settings = env["hvdlite_settings"]
    return [
        f"ranks: {env['ranks']} on {', '.join(env['hosts'])} ({env['cpus']} CPUs visible per "
        f"rank, load average {env['load_average_at_start']}, "
        f"OMP_NUM_THREADS={env['omp_num_threads']})",
        f"hvdlite {env['hvdlite_version']} ({env['hvdlite_path']})",
        f"MPI: {env['mpi_library']} (thread level {env['mpi_thread_level']}); mpi4py "
        f"{env['mpi4py_version']}, numpy {env['numpy_version']}, Python {env['python_version']}",
        f"fusion threshold: {format_size(settings['fusion_threshold'])}, cycle time "
        f"{settings['cycle_time_ms']:g} ms, response cache capacity "
        f"{settings['cache_capacity']}",
    ]


def table_header() -> list[str]:
    """Header of the per-size table."""
    header = (f"{'size':>8} {'iters':>6} {'raw ms':>9} {'allreduce ms':>13} {'raw/hvd':>8} "
              f"{'allreduce_ ms':>14} {'raw/hvd':>8}  check")
    return [header, "-" * len(header)]


def table_row(r: SizeResult) -> str:
    """One size: raw, out-of-place and in-place times with the raw/hvdlite ratios."""
    return (f"{format_size(r.nbytes):>8} {r.raw.iterations:>6} {r.raw.median_ms:>9.4f} "
            f"{r.allreduce.median_ms:>13.4f} {ratio(r.raw, r.allreduce):>7.2f}x "
            f"{r.allreduce_inplace.median_ms:>14.4f} {ratio(r.raw, r.allreduce_inplace):>7.2f}x"
            f"  {'ok' if r.correct else 'WRONG'}")


def small_lines(r: SmallResult) -> list[str]:
    """The many-small-tensors summary."""
    total = r.count * r.tensor_bytes
    return [
        f"many small tensors: {r.count} x {format_size(r.tensor_bytes)} allreduce_async_ + wait "
        f"per round ({r.hvdlite.iterations} rounds)",
        f"  raw Allreduce of {format_size(total)}: {r.raw.median_ms:.4f} ms",
        f"  hvdlite round:   {r.hvdlite.median_ms:.4f} ms  (p10 {r.hvdlite.p10_ms:.4f}, "
        f"p90 {r.hvdlite.p90_ms:.4f})  raw/hvd {ratio(r.raw, r.hvdlite):.2f}x  "
        f"{'ok' if r.correct else 'WRONG'}",
    ]


def after_compute_lines(r: AfterComputeResult) -> list[str]:
    """The after-compute summary."""
    return [
        f"one-float allreduce after {r.compute_ms:g}-{r.compute_ms * 1.2:g} ms of compute per "
        f"rank ({r.hvdlite.iterations} steps)",
        f"  raw Allreduce: {r.raw.median_ms:.4f} ms (p90 {r.raw.p90_ms:.4f})",
        f"  hvdlite:       {r.hvdlite.median_ms:.4f} ms (p90 {r.hvdlite.p90_ms:.4f})  raw/hvd "
        f"{ratio(r.raw, r.hvdlite):.2f}x  {'ok' if r.correct else 'WRONG'}",
    ]


def target_lines(sizes: list[SizeResult], small: SmallResult | None) -> list[str]:
    """hvdlite's stated performance targets (2 ranks on a 2-core machine), for the cases this run
    measured."""
    by_size = {r.nbytes: r for r in sizes}
    checks: list[tuple[str, float, bool]] = []
    if 64 * MIB in by_size:
        value = ratio(by_size[64 * MIB].raw, by_size[64 * MIB].allreduce_inplace)
        checks.append(("in-place 64 MiB >= 0.95x raw MPI", value, value >= 0.95))
    if 4 * KIB in by_size:
        value = by_size[4 * KIB].allreduce.median_ms
        checks.append(("lone 4 KiB allreduce <= 0.15 ms", value, value <= 0.15))
    if small is not None and small.count == 200 and small.tensor_bytes == 16 * KIB:
        value = small.hvdlite.median_ms
        checks.append(("200 x 16 KiB round <= 2.5 ms", value, value <= 2.5))
    return [f"  {'met    ' if ok else 'MISSED '} {what} (measured {value:.3f})"
            for what, value, ok in checks]


def write_json(path: str, env: dict, args: argparse.Namespace, sizes: list[SizeResult],
               small: SmallResult | None, after: AfterComputeResult | None,
               elapsed: float) -> None:
    """Results, settings and environment as one JSON document."""
    document = {
        "environment": env,
        "options": {"iterations": args.iterations, "min_iterations": args.min_iterations,
                    "blocks": args.blocks, "time_budget_s": args.time_budget,
                    "small_count": args.small_count, "small_kib": args.small_kib,
                    "after_compute_ms": args.after_compute_ms},
        "time_unit": "ms (median per iteration on each rank, max over ranks)",
        "elapsed_s": elapsed,
        "sizes": [r.as_dict() for r in sizes],
        "small": small.as_dict() if small is not None else None,
        "after_compute": after.as_dict() if after is not None else None,
    }
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


# --- main --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run every case and report on rank 0; exit status 1 if any result was wrong."""
    args = parse_args(argv)
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()       # the raw reference's own communicator
    env = environment(comm)
    say("hvdlite allreduce benchmark (float32, op=Sum)", *environment_lines(env), "")

    started = time.perf_counter()
    say(*table_header())
    sizes = []
    for nbytes in args.sizes:
        sizes.append(bench_size(nbytes, args, comm))
        say(table_row(sizes[-1]))
    say("")
    small = bench_small(args, comm) if args.small_count > 0 else None
    if small is not None:
        say(*small_lines(small), "")
    after = bench_after_compute(args, comm) if args.after_compute_ms > 0 else None
    if after is not None:
        say(*after_compute_lines(after), "")
    if comm.Get_size() == TARGET_RANKS:
        targets = target_lines(sizes, small)
        if targets:
            say("targets:", *targets)
    elapsed = time.perf_counter() - started
    env["load_average_at_end"] = load_average()
    say(f"times: median per iteration (each rank's median, max over ranks); ratio raw/hvd: "
        f"1.00x = as fast as raw MPI. Total {elapsed:.1f} s, load average at the end "
        f"{env['load_average_at_end']}.")

    if args.json and comm.Get_rank() == 0:
        write_json(args.json, env, args, sizes, small, after, elapsed)
    correct = (all(r.correct for r in sizes) and (small is None or small.correct)
               and (after is None or after.correct))
    if not correct:
        say("ERROR: some hvdlite or MPI results differ from the numpy reference (see 'check').")
    hvd.barrier()
    hvd.shutdown()
    comm.Free()
    return 0 if correct else 1


def run() -> int:
    """:func:`main`, but an exception on any rank aborts the whole job instead of leaving the
    other ranks waiting forever in a collective."""
    try:
        return main()
    except Exception:  # noqa: BLE001 - report, then take every rank down
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(run())
