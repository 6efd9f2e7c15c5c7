#!/usr/bin/env python3
"""Scaling efficiency of the same MLP under Keras 3 on JAX, torch and TensorFlow (through
``hvdlite.keras``) and under ``hvdlite.jax`` with optax, side by side with the torch adapter, in
one run (issue #52).

Every framework trains the MLP of examples/pytorch_synthetic_benchmark.py (512-2048-2048-10,
~5.3M parameters, batch 64 per rank, SGD with momentum) at 1 and N ranks, one thread per rank;
the configurations are interleaved over ``--rounds`` rounds so that machine noise hits them
alike, and medians are reported:

  keras-jax / keras-torch / keras-tf   benchmarks/keras_backends_ranks.py with
                                       KERAS_BACKEND=jax/torch/tensorflow (compiled step:
                                       jax.jit, torch's eager step, tf.function)
  jax                                  keras_backends_ranks.py --jax (hvdlite.jax's optax
                                       DistributedOptimizer in a jax.jit-ed step, no Keras)
  torch                                examples/pytorch_synthetic_benchmark.py --model mlp
  efficiency = total samples/sec at N ranks / (N x samples/sec at 1 rank)

Each round also times the allreduce of the MLP's gradients inside ``jax.jit`` against the same
allreduce eagerly (``keras_backends_ranks.py --in-jit``): what the ordered ``io_callback`` that
keeps the ranks' collectives paired in the jitted Keras-JAX step costs.

    python benchmarks/keras_backends.py --ranks 2 --rounds 3
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

from training_scaling import REPO, mpiexec, run_once   # the helpers of the other scalings

RANKS_SCRIPT = REPO / "benchmarks" / "keras_backends_ranks.py"
TORCH_EXAMPLE = REPO / "examples" / "pytorch_synthetic_benchmark.py"
# name -> (script, extra arguments, KERAS_BACKEND)
FRAMEWORKS = {"keras-jax": (RANKS_SCRIPT, [], "jax"),
              "keras-torch": (RANKS_SCRIPT, [], "torch"),
              "keras-tf": (RANKS_SCRIPT, [], "tensorflow"),
              "jax": (RANKS_SCRIPT, ["--jax"], None),
              "torch": (TORCH_EXAMPLE, ["--model", "mlp"], None)}


def in_jit_once(ranks: int, bench: list[str], timeout: float) -> dict:
    """The in-jit allreduce timings (ms per call, slowest rank) of one run."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND="jax")
        subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(RANKS_SCRIPT),
                        "--in-jit", "--json", out.name, *bench], check=True, env=env,
                       timeout=timeout, stdout=subprocess.DEVNULL, start_new_session=True)
        return json.loads(Path(out.name).read_text())["in_jit_ms"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                   help=f"comma-separated subset of {','.join(FRAMEWORKS)}")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--no-in-jit", action="store_true", help="skip the in-jit allreduce timing")
    args = p.parse_args(argv)
    bench = ["--batch-size", str(args.batch_size), "--num-iters", str(args.num_iters),
             "--num-batches-per-iter", str(args.num_batches_per_iter)]
    n = args.ranks
    chosen = [f for f in args.frameworks.split(",") if f]
    samples: dict[tuple[str, int], list[float]] = {(f, k): [] for f in chosen for k in (1, n)}
    in_jit: list[dict] = []
    for r in range(args.rounds):
        for (name, ranks), values in samples.items():
            script, extra, backend = FRAMEWORKS[name]
            values.append(run_once(script, ranks, extra, bench, args.timeout,
                                   {"KERAS_BACKEND": backend} if backend else None))
            print(f"round {r}: {name:12s} {ranks} rank(s) {values[-1]:9.1f} samples/sec total",
                  flush=True)
        if not args.no_in_jit:
            in_jit.append(in_jit_once(n, ["--num-iters", str(args.num_iters)], args.timeout))
            print(f"round {r}: allreduce ms {in_jit[-1]}", flush=True)
    med = {key: statistics.median(v) for key, v in samples.items()}
    print(f"\nMLP (~5.3M parameters), batch {args.batch_size} per rank, 1 thread per rank, "
          f"medians of {args.rounds} rounds")
    print(f"| framework | samples/sec at 1 rank | at {n} ranks (total) | "
          f"scaling efficiency at {n} ranks |")
    print("|---|---|---|---|")
    for name in chosen:
        one, many = med[(name, 1)], med[(name, n)]
        print(f"| {name} | {one:.1f} | {many:.1f} | {many / (n * one):.3f} |")
    if in_jit:
        ways = in_jit[0].keys()
        print(f"\nallreduce of the MLP's 6 gradients (21 MB) at {n} ranks, ms per call "
              f"(median of rounds, slowest rank):")
        for way in ways:
            print(f"  {way:10s} {statistics.median(x[way] for x in in_jit):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
