"""What DistributedOptimizer's gradient buckets save, on a model of many small tensors.

Runs examples/pytorch_synthetic_benchmark.py (default ``--model deep``: 130 parameter tensors,
~2.1M parameters) in these configurations, interleaved over several rounds so that machine noise
hits all of them alike, and reports medians:

  bare-1            1 rank, the plain optimizer (the reference)
  per-gradient-R    DistributedOptimizer with HVDLITE_GRADIENT_BUCKET_MB=0: every gradient
                    reduced on its own, as Horovod does
  buckets-R@M       DistributedOptimizer with HVDLITE_GRADIENT_BUCKET_MB=M (1 is the default)

for R in 1 and --ranks.  Printed per configuration: samples/sec, ms per step, the overhead over
bare-1 at 1 rank, and the scaling efficiency total(R ranks) / (R x bare-1).  Timing never fails
anything; each rank uses one intra-op thread.

    python benchmarks/gradient_buckets.py --ranks 2 --rounds 3
    python benchmarks/gradient_buckets.py --bucket-mb 0.25,1,4,25 --batch-size 32
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_scaling import EXAMPLES, run_once  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="deep")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--bucket-mb", default="1", help="bucket caps to compare, comma-separated")
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    example, bare_flag = EXAMPLES["torch"]
    bench = ["--model", args.model, "--batch-size", str(args.batch_size),
             "--num-iters", str(args.num_iters),
             "--num-batches-per-iter", str(args.num_batches_per_iter)]
    caps = [c.strip() for c in args.bucket_mb.split(",") if c.strip()]
    configs = {"bare-1": (1, [bare_flag], {})}
    for ranks in sorted({1, args.ranks}):
        configs[f"per-gradient-{ranks}"] = (ranks, [], {"HVDLITE_GRADIENT_BUCKET_MB": "0"})
        for cap in caps:
            configs[f"buckets-{ranks}@{cap}"] = (ranks, [], {"HVDLITE_GRADIENT_BUCKET_MB": cap})
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for rnd in range(args.rounds):
        for name, (ranks, extra, env) in configs.items():
            samples[name].append(run_once(example, ranks, extra, bench, args.timeout, env))
            print(f"round {rnd}: {name:20s} {samples[name][-1]:9.1f} samples/sec total",
                  flush=True)
    med = {name: statistics.median(v) for name, v in samples.items()}
    bare = med["bare-1"]
    print(f"\nmodel {args.model}, batch {args.batch_size} per rank, 1 thread per rank, "
          f"medians of {args.rounds} rounds")
    print("| configuration | samples/sec (total) | ms per step | vs bare-1 |")
    print("|---|---|---|---|")
    for name, (ranks, _, _) in configs.items():
        step_ms = 1000.0 * args.batch_size * ranks / med[name]
        if ranks == 1:
            versus = f"overhead {100.0 * (1.0 - med[name] / bare):+.1f}%"
        else:
            versus = f"efficiency {med[name] / (ranks * bare):.3f}"
        print(f"| {name} | {med[name]:.1f} | {step_ms:.2f} | {versus} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
