#!/usr/bin/env python3
"""The paths users call: collectives through the PyTorch or TensorFlow adapter against raw mpi4py
on the same bytes, in the same run.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/framework_benchmark.py --framework torch
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/framework_benchmark.py --framework tf

Three groups of cases, each timed in interleaved blocks with the machinery of
``allreduce_benchmark.py`` (warm-up, barriers around every block, each rank's median iteration,
maximised over the ranks):

* ``lone``: one ``--lone-kib`` KiB allreduce (default 4) against ``comm.Allreduce`` of it;
* ``round``: ``--small-count`` tensors of ``--small-kib`` KiB (200 x 16) submitted, then all
  waited for, against one ``comm.Allreduce`` of the bytes they make together;
* ``large``: one ``--large-mib`` MiB allreduce (64) against ``comm.Allreduce`` of it.

Every group also times the framework-neutral numpy API (``hvdlite.allreduce_async_``, in place),
the figure ``allreduce_benchmark.py`` reports, so the adapter's own cost shows. PyTorch variants:
out of place and in place, sync and async, ``grouped_allreduce_async`` (and ``_``). TensorFlow
variants: eager, and inside one ``tf.function`` (all of a round's allreduces in one function),
and ``grouped_allreduce``; and, as a reference, the same calls with ``t + 0`` in place of the
collective (TensorFlow's own cost of the calls, marked ``reference``). Each variant's result is
checked once against numpy first. The
report gives each variant's time and its ratio to raw MPI (``x raw``: 2.0 = twice raw's time).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the shared timing machinery

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import allreduce_benchmark as ab  # noqa: E402  (puts this checkout's hvdlite first)
import hvdlite as core_hvd  # noqa: E402

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("torch", "tf"), default="torch")
    parser.add_argument("--lone-kib", type=int, default=4)
    parser.add_argument("--small-count", type=int, default=200)
    parser.add_argument("--small-kib", type=int, default=16)
    parser.add_argument("--large-mib", type=int, default=64, help="0 skips the large case")
    parser.add_argument("--iterations", type=int, default=ab.DEFAULT_MAX_ITERATIONS)
    parser.add_argument("--min-iterations", type=int, default=ab.DEFAULT_MIN_ITERATIONS)
    parser.add_argument("--time-budget", type=float, default=ab.DEFAULT_TIME_BUDGET, metavar="S")
    parser.add_argument("--blocks", type=int, default=ab.DEFAULT_BLOCKS)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    return parser.parse_args(argv)


# --- the adapters' variants ---------------------------------------------------------------------
class TorchPaths:
    """The PyTorch adapter's ways of reducing a list of float32 tensors (in order, by name)."""

    def __init__(self) -> None:
        import torch
        import hvdlite.torch as hvd
        torch.set_num_threads(1)
        self.torch, self.hvd = torch, hvd
        hvd.init()

    def tensors(self, arrays: list[np.ndarray]) -> list:
        return [self.torch.from_numpy(a.copy()) for a in arrays]

    def variants(self, tag: str, sources: list[np.ndarray]) -> list[tuple[str, Callable, list]]:
        """(name, step returning the results, the tensors an in-place step overwrites)."""
        hvd, ins, work = self.hvd, self.tensors(sources), self.tensors(sources)
        names = [f"{tag}.{i}" for i in range(len(ins))]

        def sync_out():
            return [hvd.allreduce(t, op=hvd.Sum, name=n + ".so") for t, n in zip(ins, names)]

        def sync_in():
            return [hvd.allreduce_(t, op=hvd.Sum, name=n + ".si") for t, n in zip(work, names)]

        def async_out():
            handles = [hvd.allreduce_async(t, op=hvd.Sum, name=n + ".ao")
                       for t, n in zip(ins, names)]
            return [hvd.synchronize(h) for h in handles]

        def async_in():
            handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=n + ".ai")
                       for t, n in zip(work, names)]
            return [hvd.synchronize(h) for h in handles]

        def grouped_out():
            return hvd.synchronize(hvd.grouped_allreduce_async(ins, op=hvd.Sum, name=tag + ".go"))

        def grouped_in():
            return hvd.synchronize(hvd.grouped_allreduce_async_(work, op=hvd.Sum,
                                                                name=tag + ".gi"))
        sync = [("torch allreduce (sync)", sync_out, []),
                ("torch allreduce_ (sync)", sync_in, work)]
        many = [("torch allreduce_async", async_out, []),
                ("torch allreduce_async_", async_in, work),
                ("torch grouped_allreduce_async", grouped_out, []),
                ("torch grouped_allreduce_async_", grouped_in, work)]
        return sync + (many if len(ins) > 1 else many[:2])

    def as_numpy(self, result) -> np.ndarray:
        return result.numpy()


class TensorFlowPaths:
    """The TensorFlow adapter's ways of reducing a list of float32 tensors."""

    def __init__(self) -> None:
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        import hvdlite.tensorflow as hvd
        self.tf, self.hvd = tf, hvd
        hvd.init()

    def variants(self, tag: str, sources: list[np.ndarray]) -> list[tuple[str, Callable, list]]:
        tf, hvd = self.tf, self.hvd
        ins = [tf.constant(a) for a in sources]
        names = [f"{tag}.{i}" for i in range(len(ins))]

        def eager():
            return [hvd.allreduce(t, op=hvd.Sum, name=n + ".e") for t, n in zip(ins, names)]

        @tf.function
        def in_function(tensors):
            return [hvd.allreduce(t, op=hvd.Sum, name=n + ".f") for t, n in zip(tensors, names)]

        def grouped_eager():
            return hvd.grouped_allreduce(ins, op=hvd.Sum, name=tag + ".ge")

        @tf.function
        def grouped_function(tensors):
            return hvd.grouped_allreduce(tensors, op=hvd.Sum, name=tag + ".gf")
        return [("tf allreduce (eager)", eager, []),
                ("tf allreduce in tf.function", lambda: in_function(ins), []),
                ("tf grouped_allreduce (eager)", grouped_eager, []),
                ("tf grouped_allreduce in tf.function", lambda: grouped_function(ins), [])]

    def references(self, tag: str, sources: list[np.ndarray]) -> list[tuple[str, Callable]]:
        """TensorFlow's own cost of the same calls without a collective (``t + 0`` in its
        place): what no adapter of a Python collective can go below."""
        tf = self.tf
        ins = [tf.constant(a) for a in sources]

        @tf.function
        def in_function(tensors):
            return [t + 0 for t in tensors]
        return [("TensorFlow alone: t + 0 (eager)", lambda: [t + 0 for t in ins]),
                ("TensorFlow alone: t + 0 in tf.function", lambda: in_function(ins))]

    def as_numpy(self, result) -> np.ndarray:
        return result.numpy()


# --- one group of cases --------------------------------------------------------------------------
def numpy_in_place(tag: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    handles = [core_hvd.allreduce_async_(a, op=core_hvd.Sum, name=f"{tag}.np.{i}")
               for i, a in enumerate(arrays)]
    return [h.wait() for h in handles]


def bench_group(tag: str, count: int, nbytes: int, paths, args: argparse.Namespace,
                comm) -> dict:
    """Raw MPI on the fused bytes, the numpy API in place, and every adapter variant, for
    ``count`` tensors of ``nbytes`` each."""
    elements = nbytes // 4
    rank, size = comm.Get_rank(), comm.Get_size()
    sources = [ab.rank_data(elements, rank, offset=i) for i in range(count)]
    expected = [ab.expected_sum(elements, size, offset=i) for i in range(count)]
    fused, fused_out = np.concatenate(sources), np.empty(elements * count, np.float32)
    np_work = [s.copy() for s in sources]

    def refill(targets: list) -> Callable[[], None]:
        """Restore in-place targets' inputs (untimed; sums would otherwise grow)."""
        def run() -> None:
            for target, source in zip(targets, sources):
                if isinstance(target, np.ndarray):
                    np.copyto(target, source)
                else:
                    target.copy_(paths.torch.from_numpy(source))
        return run

    cases = [("raw MPI (one Allreduce of all the bytes)",
              ab.Case(lambda: comm.Allreduce(fused, fused_out, op=MPI.SUM), comm.Barrier)),
             ("numpy allreduce_async_ (in place)",
              ab.Case(lambda: numpy_in_place(tag, np_work), core_hvd.barrier,
                      prepare=refill(np_work)))]
    correct = {}
    comm.Allreduce(fused, fused_out, op=MPI.SUM)
    correct[cases[0][0]] = ab.agree(np.array_equal(fused_out, np.concatenate(expected)), comm)
    np_work_check = numpy_in_place(tag, [s.copy() for s in sources])
    correct[cases[1][0]] = ab.agree(all(np.array_equal(a, e)
                                        for a, e in zip(np_work_check, expected)), comm)
    for name, step, overwritten in paths.variants(tag, sources):
        prepare = refill(overwritten) if overwritten else None
        if prepare is not None:
            prepare()
        results = step()
        ok = len(results) == count and all(np.array_equal(paths.as_numpy(r), e)
                                           for r, e in zip(results, expected))
        correct[name] = ab.agree(ok, comm)
        cases.append((name, ab.Case(step, core_hvd.barrier, prepare=prepare)))
    for name, step in getattr(paths, "references", lambda *_: [])(tag, sources):
        step()
        correct[name] = None   # timed only: computes no collective
        cases.append((name, ab.Case(step, core_hvd.barrier)))
    ab.measure([case for _, case in cases], ab.iterations_for(fused.nbytes, args), args, comm)
    timings = {name: ab.summarize(case.samples, comm) for name, case in cases}
    raw = timings[cases[0][0]].median_ms
    return {"count": count, "tensor_bytes": nbytes,
            "variants": {name: {"median_ms": t.median_ms, "p10_ms": t.p10_ms,
                                "p90_ms": t.p90_ms, "iterations": t.iterations,
                                "times_raw": t.median_ms / raw if raw > 0 else float("inf"),
                                "correct": correct[name]}
                         for name, t in timings.items()}}


def group_lines(title: str, group: dict) -> list[str]:
    lines = [f"{title}", "| variant | ms | x raw | check |", "|---|---|---|---|"]
    for name, v in group["variants"].items():
        check = "reference" if v["correct"] is None else "ok" if v["correct"] else "WRONG"
        lines.append(f"| {name} | {v['median_ms']:.4f} | {v['times_raw']:.2f} | {check} |")
    return lines + [""]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Each variant reduces the tensors under names of its own, as a training loop's tensors
    # keep theirs: the response cache must hold every variant's names (about 1,500), or each
    # variant would evict the next one's and every round would be negotiated in full.
    os.environ.setdefault("HVDLITE_CACHE_CAPACITY", "4096")
    comm = MPI.COMM_WORLD.Dup()
    paths = TorchPaths() if args.framework == "torch" else TensorFlowPaths()
    env = ab.environment(comm)
    ab.say(f"hvdlite {args.framework} adapter benchmark (float32, op=Sum)",
           *ab.environment_lines(env), "")
    groups = {}
    plan = [("lone", 1, args.lone_kib * ab.KIB, f"lone {args.lone_kib} KiB allreduce"),
            ("round", args.small_count, args.small_kib * ab.KIB,
             f"{args.small_count} x {args.small_kib} KiB, submitted then waited for")]
    if args.large_mib > 0:
        plan.append(("large", 1, args.large_mib * ab.MIB, f"one {args.large_mib} MiB allreduce"))
    for tag, count, nbytes, title in plan:
        if count > 0:
            groups[tag] = bench_group(tag, count, nbytes, paths, args, comm)
            ab.say(*group_lines(title, groups[tag]))
    ab.say("times: median per iteration (each rank's median, max over ranks); x raw: the "
           "variant's time over raw MPI's on the same bytes (1.00 = as fast).")
    if args.json and comm.Get_rank() == 0:
        Path(args.json).write_text(json.dumps({"framework": args.framework, "environment": env,
                                               "groups": groups}, indent=2))
    correct = all(v["correct"] is not False for g in groups.values()
                  for v in g["variants"].values())
    if not correct:
        ab.say("ERROR: some results differ from the numpy reference (see 'check').")
    core_hvd.barrier()
    core_hvd.shutdown()
    comm.Free()
    return 0 if correct else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - report, then take every rank down
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
