"""What the compression benchmark's torch and Keras ranks share (no framework imported here):
the compressions and command-line arguments both take, the bytes one training step's allreduces
carry under each compression (``none``, ``fp16``,
``powersgd<rank>``), a configuration's result from its timed steps, the job's document, and the
entry point that takes every rank down when one fails."""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvdlite.common.api import powersgd as policy  # noqa: E402

COMPRESSIONS = ("none", "fp16", "powersgd1", "powersgd2", "powersgd4")


def common_arguments(description: str) -> argparse.ArgumentParser:
    """The parser with the arguments the torch and Keras ranks both take."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--widths", default="1024,4096,4096,1024",
                   help="the MLP's layer widths, input first (default 1024,4096,4096,1024: "
                        "25 M parameters)")
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--compressions", default=",".join(COMPRESSIONS))
    p.add_argument("--start-iter", type=int, default=2, help="PowerSGD's plain steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (>= start_iter + 1)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per compression")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    return p


def step_bytes(shapes: list[tuple[int, ...]], name: str) -> dict:
    """The bytes one step's allreduces carry for compression ``name`` (float32 gradients), with
    PowerSGD's compression-rate rule (hvdlite/common/api/powersgd.py): every compressed n x m
    gradient sends P (n x r) and Q (m x r), the others travel whole."""
    whole = sum(4 * math.prod(s) for s in shapes)
    if name == "bare":   # (torch's optimizer alone: no allreduce at all)
        return {"total": 0, "uncompressed": 0, "P": 0, "Q": 0}
    if name == "none":
        return {"total": whole, "uncompressed": whole, "P": 0, "Q": 0}
    if name == "fp16":
        return {"total": whole // 2, "uncompressed": whole // 2, "P": 0, "Q": 0}
    config = policy.PowerSGDConfig(rank=int(name[len("powersgd"):]))
    compressed, rest = policy.split(shapes, config)
    p_bytes = q_bytes = 0
    for i in compressed:
        n, m = policy.matrix_shape(shapes[i])
        r = policy.factor_rank(n, m, config.rank)
        p_bytes += 4 * n * r
        q_bytes += 4 * m * r
    rest_bytes = sum(4 * math.prod(shapes[i]) for i in rest)
    return {"total": p_bytes + q_bytes + rest_bytes, "uncompressed": rest_bytes,
            "P": p_bytes, "Q": q_bytes}


def step_result(name: str, step_s: list[float], batch_size: int, ranks: int,
                shapes: list[tuple[int, ...]], phases_ms: dict) -> dict:
    """One compression's result from its timed steps (``step_s``: each the slowest rank's)."""
    median = statistics.median(step_s)
    return {"compression": name, "step_ms": 1e3 * median,
            "step_ms_all": [1e3 * s for s in step_s],
            "samples_per_s": batch_size * ranks / median,
            "bytes": step_bytes(shapes, name), "phases_ms": phases_ms}


def print_result(r: dict) -> None:
    print(f"{r['compression']:>10} {r['step_ms']:9.1f} ms/step {r['samples_per_s']:9.1f} "
          f"samples/s {r['bytes']['total'] / 2**20:9.2f} MiB/step", flush=True)


def job_document(args, ranks: int, hosts: int, params: int, model, results: list,
                 **extra) -> dict:
    """The JSON a job writes (compression_benchmark.py reads it)."""
    return {**extra, "ranks": ranks, "hosts": hosts, "params": params, "model": model,
            "batch_size": args.batch_size, "start_iter": args.start_iter,
            "warmup": max(args.warmup, args.start_iter + 1), "steps": args.steps,
            "results": results}


def run_ranks(main: Callable[[], int]) -> None:
    """Run a ranks script's ``main``; if it raises, take every rank down rather than leave
    them waiting."""
    try:
        sys.exit(main())
    except Exception:   # noqa: BLE001
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)
