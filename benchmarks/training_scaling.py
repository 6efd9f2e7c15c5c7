"""Training-throughput scaling of hvdlite.torch or hvdlite.tensorflow on this machine.

Runs examples/pytorch_synthetic_benchmark.py (or, with ``--framework tf``,
examples/tensorflow2_synthetic_benchmark.py) in three configurations, interleaved over several
rounds so that machine noise hits all of them alike, and reports medians:

  bare-1     1 rank, plain optimizer / plain GradientTape (the reference)
  hvd-1      1 rank, hvd.DistributedOptimizer / DistributedGradientTape
                                                     -> overhead = 1 - hvd-1 / bare-1
  hvd-N      N ranks, the same                       -> efficiency = total(hvd-N) / (N * hvd-1)
  bare-N     N ranks, each training alone (no gradient exchange at all)
                                          -> machine ceiling = total(bare-N) / (N * bare-1)
  lockstep-N N ranks, bare, plus one scalar allreduce per step (ranks wait for each other,
             no gradients move)           -> lockstep ceiling = total(lockstep-N) / (N * bare-1)

The machine ceiling is what N processes training side by side get on this machine without any
communication (shared memory bandwidth, caches, turbo, a noisy neighbour): no data-parallel
library can scale better than it.  The lockstep ceiling adds what synchronous steps cost by
themselves: every step lasts as long as the slowest rank's, so step-time jitter turns into
waiting.  What separates hvd-N from lockstep-N is then the gradients' movement.

Each rank uses one intra-op thread (OMP_NUM_THREADS=1), so N ranks need N cores.

    python benchmarks/training_scaling.py --ranks 2 --rounds 3
    python benchmarks/training_scaling.py --framework tf --ranks 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = {"torch": (REPO / "examples" / "pytorch_synthetic_benchmark.py",
                     "--no-distributed-optimizer"),
            "tf": (REPO / "examples" / "tensorflow2_synthetic_benchmark.py",
                   "--no-distributed-tape")}


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def run_once(example: Path, ranks: int, extra: list[str], bench_args: list[str],
             timeout: float, env_extra: dict | None = None) -> float:
    """Total samples/sec of one benchmark run (``env_extra``: more environment variables)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env_extra or {}))
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(example), "--json", out.name,
               *bench_args, *extra]
        subprocess.run(cmd, check=True, env=env, timeout=timeout, stdout=subprocess.DEVNULL,
                       start_new_session=True)
        return json.loads(Path(out.name).read_text())["total"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=sorted(EXAMPLES), default="torch")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    bench = ["--model", args.model, "--batch-size", str(args.batch_size),
             "--num-iters", str(args.num_iters),
             "--num-batches-per-iter", str(args.num_batches_per_iter)]
    example, bare_flag = EXAMPLES[args.framework]
    configs = {"bare-1": (1, [bare_flag]), "hvd-1": (1, []),
               f"hvd-{args.ranks}": (args.ranks, []),
               f"bare-{args.ranks}": (args.ranks, [bare_flag]),
               f"lockstep-{args.ranks}": (args.ranks, [bare_flag, "--lockstep"])}
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (ranks, extra) in configs.items():
            samples[name].append(run_once(example, ranks, extra, bench, args.timeout))
            print(f"round {r}: {name:8s} {samples[name][-1]:9.1f} samples/sec total",
                  flush=True)
    med = {name: statistics.median(v) for name, v in samples.items()}
    n = args.ranks
    overhead = 1.0 - med["hvd-1"] / med["bare-1"]
    efficiency = med[f"hvd-{n}"] / (n * med["hvd-1"])
    efficiency_bare = med[f"hvd-{n}"] / (n * med["bare-1"])
    ceiling = med[f"bare-{n}"] / (n * med["bare-1"])
    lockstep = med[f"lockstep-{n}"] / (n * med["bare-1"])
    print(f"\n{args.framework}: model {args.model}, batch {args.batch_size} per rank, "
          f"1 thread per rank, medians of {args.rounds} rounds")
    print("| configuration | samples/sec (total) |")
    print("|---|---|")
    for name in configs:
        print(f"| {name} | {med[name]:.1f} |")
    wrapper = "DistributedOptimizer" if args.framework == "torch" else "DistributedGradientTape"
    print(f"\n{wrapper} overhead at 1 rank: {overhead * 100:.1f}%")
    print(f"scaling efficiency at {n} ranks: {efficiency:.3f} "
          f"(vs bare 1-rank optimizer: {efficiency_bare:.3f})")
    print(f"machine ceiling at {n} ranks (bare-{n} / {n} x bare-1): {ceiling:.3f}")
    print(f"lockstep ceiling at {n} ranks (lockstep-{n} / {n} x bare-1): {lockstep:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
