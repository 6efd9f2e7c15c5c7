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
  mpi-N      N ranks, the same step averaging its gradients with mpi4py's blocking Allreduce
             after backward (benchmarks/reference_training.py: what a hand-written MPI loop gets)
  ddp-N      PyTorch only: N ranks of torch's DistributedDataParallel over gloo
                                          -> hvd-N / mpi-N, hvd-N / ddp-N: hvdlite against them

The machine ceiling is what N processes training side by side get on this machine without any
communication (shared memory bandwidth, caches, turbo, a noisy neighbour): no data-parallel
library can scale better than it.  The lockstep ceiling adds what synchronous steps cost by
themselves: every step lasts as long as the slowest rank's, so step-time jitter turns into
waiting.  What separates hvd-N from lockstep-N is then the gradients' movement (hvd-N /
lockstep-N: the share of synchronous training's ceiling that hvdlite keeps).  The references
(``--no-references`` skips them) say what the other ways of training data parallel on this
machine get from the same step.

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
REFERENCE = REPO / "benchmarks" / "reference_training.py"
# Reference configurations of each framework: name prefix -> reference_training.py's --via.
REFERENCES = {"torch": {"mpi": "mpi", "ddp": "ddp"}, "tf": {"mpi": "mpi"}}


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def run_once(script: Path, ranks: int, extra: list[str], bench_args: list[str],
             timeout: float, env_extra: dict | None = None) -> float:
    """Total samples/sec of one benchmark run (``env_extra``: more environment variables)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env_extra or {}))
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(script), "--json", out.name,
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
    p.add_argument("--no-references", action="store_true",
                   help="skip the mpi-N / ddp-N reference configurations")
    args = p.parse_args(argv)
    bench = ["--model", args.model, "--batch-size", str(args.batch_size),
             "--num-iters", str(args.num_iters),
             "--num-batches-per-iter", str(args.num_batches_per_iter)]
    example, bare_flag = EXAMPLES[args.framework]
    n = args.ranks
    # name -> (script, ranks, extra arguments)
    configs = {"bare-1": (example, 1, [bare_flag]), "hvd-1": (example, 1, []),
               f"hvd-{n}": (example, n, []),
               f"bare-{n}": (example, n, [bare_flag]),
               f"lockstep-{n}": (example, n, [bare_flag, "--lockstep"])}
    if not args.no_references:
        for prefix, via in REFERENCES[args.framework].items():
            configs[f"{prefix}-{n}"] = (REFERENCE, n, ["--framework", args.framework,
                                                        "--via", via])
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (script, ranks, extra) in configs.items():
            samples[name].append(run_once(script, ranks, extra, bench, args.timeout))
            print(f"round {r}: {name:8s} {samples[name][-1]:9.1f} samples/sec total",
                  flush=True)
    med = {name: statistics.median(v) for name, v in samples.items()}
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
    print(f"share of the lockstep ceiling kept (hvd-{n} / lockstep-{n}): "
          f"{med[f'hvd-{n}'] / med[f'lockstep-{n}']:.3f}")
    references = {"mpi": "a blocking mpi4py Allreduce loop", "ddp": "DDP over gloo"}
    for prefix, what in references.items():
        if f"{prefix}-{n}" in med:
            print(f"hvdlite against {what} at {n} ranks (hvd-{n} / {prefix}-{n}): "
                  f"{med[f'hvd-{n}'] / med[f'{prefix}-{n}']:.2f}x "
                  f"(its efficiency vs bare-1: {med[f'{prefix}-{n}'] / (n * med['bare-1']):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
