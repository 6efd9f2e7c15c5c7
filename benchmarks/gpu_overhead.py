"""GPU overhead of hvdlite.torch.DistributedOptimizer at one rank, plus 2-rank host-staged scaling.

Runs examples/pytorch_synthetic_benchmark.py --cuda in these configurations, interleaved over
several rounds so that machine noise (clocks, other tenants) hits all of them alike, and reports
medians:

  bare-1      1 rank, plain torch optimizer on the GPU (the reference)
  hvd-1       1 rank, hvd.DistributedOptimizer, gradients through NCCL
              -> overhead = 1 - hvd-1 / bare-1, per batch size (target: <= 2 %)
  hvd-sync-1  the same with HVDLITE_ENABLE_ASYNC_COMPLETION=0 (handles complete after the host
              saw the GPU finish), for information: what asynchronous completion saves
  hvd-per-gradient-1  the same with HVDLITE_GRADIENT_BUCKET_MB=0 (every gradient reduced on its
              own), for information: what gradient buckets save (``--model deep``: 130 tensors)
  staged-2    2 ranks sharing the GPU with HVDLITE_GPU_OPERATIONS=mpi (host staging), for
              information only: two ranks on one GPU split its compute, so this shows what host
              staging costs, not multi-GPU scaling (NCCL refuses two ranks on one GPU)

The overhead of DistributedOptimizer is mostly a fixed cost per step (the gradients' hand-off, and
the GPU waiting while step() and the next forward are launched once the reductions are done), so
it is reported both as a percentage for each batch size and as milliseconds per step.

    python benchmarks/gpu_overhead.py                       # defaults: mlp, batch 1024 and 16384
    python benchmarks/gpu_overhead.py --batch-size 4096 --rounds 5 --json out.json

Exits with status 2 and a message when no usable GPU is present.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "pytorch_synthetic_benchmark.py"
TARGET_PERCENT = 2.0
# (configuration, summary key, what it changes): overheads reported for information only
INFORMATION_ROWS = [("hvd-sync-1", "sync_percent", "HVDLITE_ENABLE_ASYNC_COMPLETION=0"),
                    ("hvd-per-gradient-1", "per_gradient_percent",
                     "HVDLITE_GRADIENT_BUCKET_MB=0 (no buckets)")]


def gpu_unavailable_reason() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"PyTorch cannot be imported ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return ("no CUDA GPU is usable here: torch.cuda.is_available() is False (no GPU or "
                "driver, or a CPU-only PyTorch build)")
    sys.path.insert(0, str(REPO))
    from hvdlite.common.gpu import cuda
    if cuda.cuda_device_count() == 0:
        why = cuda._import_cupy()[1]
        return ("hvdlite's GPU runtime sees no CUDA device ("
                + (f"CuPy cannot be imported: {why}" if why else "CuPy sees no device")
                + f"); {cuda.INSTALL_HINT}")
    return None


def mpiexec(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def run_once(launcher: str, ranks: int, extra: list[str], env_extra: dict, bench: list[str],
             timeout: float) -> dict:
    """One benchmark run; returns its JSON result (raises with the output's tail on failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("HVDLITE_GPU_OPERATIONS", None)
        env.pop("HOROVOD_GPU_OPERATIONS", None)
        for knob in ("HVDLITE_ENABLE_ASYNC_COMPLETION", "HOROVOD_ENABLE_ASYNC_COMPLETION"):
            env.pop(knob, None)
        env.update(env_extra)
        cmd = [launcher, "-n", str(ranks), sys.executable, str(EXAMPLE), "--cuda",
               "--json", str(out), *bench, *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=REPO, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n"
                               f"{output[-3000:]}") from None
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"exit status {proc.returncode}: {' '.join(cmd)}\n"
                               f"{output[-3000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="mlp", choices=["mlp", "convnet", "deep"])
    p.add_argument("--batch-size", default="1024,16384",
                   help="per-rank batch size(s), comma-separated (default: 1024,16384)")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=20)
    p.add_argument("--staged-ranks", type=int, default=2,
                   help="ranks for the host-staged information run (0: skip it)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per benchmark run")
    p.add_argument("--target", type=float, default=TARGET_PERCENT,
                   help="overhead target in percent (default: 2)")
    p.add_argument("--mpiexec", help="launcher to use (default: next to python, then PATH)")
    p.add_argument("--json", help="also write every sample and the summary to this file")
    args = p.parse_args(argv)
    batches = [int(b) for b in str(args.batch_size).split(",") if b.strip()]

    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"gpu_overhead: cannot run: {reason}.\nThis benchmark needs a machine with an "
              f"NVIDIA GPU, PyTorch with CUDA and CuPy (pip install 'hvdlite[nccl]'); on a "
              f"GPU machine run `bash scripts/gpu_check.sh`.", file=sys.stderr)
        return 2
    launcher = mpiexec(args.mpiexec)
    if launcher is None:
        print("gpu_overhead: cannot run: no mpiexec found (pip install mpich, or carry the "
              "mpich wheel to this machine; see scripts/gpu_check.sh).", file=sys.stderr)
        return 2
    import torch
    from hvdlite.common.gpu import cuda
    nccl = cuda.nccl_version()
    hvd_env = {"HVDLITE_GPU_OPERATIONS": "nccl" if nccl else "mpi"}
    print(f"GPU: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible), "
          f"torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL "
          + (f"code {nccl}" if nccl else "NOT usable: hvd-1 runs host-staged instead"),
          flush=True)

    configs = {}
    for b in batches:
        configs[f"bare-1@{b}"] = (1, ["--no-distributed-optimizer"], {}, b)
        configs[f"hvd-1@{b}"] = (1, [], hvd_env, b)
        configs[f"hvd-sync-1@{b}"] = (1, [], {**hvd_env, "HVDLITE_ENABLE_ASYNC_COMPLETION": "0"},
                                      b)
        configs[f"hvd-per-gradient-1@{b}"] = (1, [], {**hvd_env,
                                                      "HVDLITE_GRADIENT_BUCKET_MB": "0"}, b)
    if args.staged_ranks > 1:
        b = max(batches)
        configs[f"staged-{args.staged_ranks}@{b}"] = (
            args.staged_ranks, [], {"HVDLITE_GPU_OPERATIONS": "mpi"}, b)
    samples: dict[str, list[float]] = {name: [] for name in configs}
    failures: list[str] = []
    for rnd in range(args.rounds):
        for name, (ranks, extra, env_extra, b) in configs.items():
            bench = ["--model", args.model, "--batch-size", str(b),
                     "--num-warmup-batches", str(args.num_warmup_batches),
                     "--num-iters", str(args.num_iters),
                     "--num-batches-per-iter", str(args.num_batches_per_iter)]
            try:
                total = run_once(launcher, ranks, extra, env_extra, bench, args.timeout)["total"]
            except RuntimeError as exc:
                failures.append(f"{name}: {exc}")
                print(f"round {rnd}: {name:18s} FAILED\n{exc}", flush=True)
                continue
            samples[name].append(total)
            print(f"round {rnd}: {name:18s} {total:12.1f} samples/sec total", flush=True)

    med = {name: statistics.median(v) for name, v in samples.items() if v}
    print(f"\nmodel {args.model}, medians of {args.rounds} rounds "
          f"({args.num_iters} x {args.num_batches_per_iter} timed steps per run)")
    print("| configuration | batch per rank | samples/sec (total) | ms per step |")
    print("|---|---|---|---|")
    for name, (ranks, _, _, b) in configs.items():
        if name in med:
            print(f"| {name.split('@')[0]} | {b} | {med[name]:.1f} | "
                  f"{1000.0 * b * ranks / med[name]:.2f} |")
        else:
            print(f"| {name.split('@')[0]} | {b} | failed | |")

    summary: dict = {"model": args.model, "rounds": args.rounds, "target_percent": args.target,
                     "nccl_version": nccl, "gpu": torch.cuda.get_device_name(0),
                     "samples": samples, "medians": med, "overhead": {}}
    verdicts = []
    print()
    for b in batches:
        bare, hvd1 = med.get(f"bare-1@{b}"), med.get(f"hvd-1@{b}")
        if not bare or not hvd1:
            print(f"batch {b}: overhead unknown (a configuration failed)")
            verdicts.append(False)
            continue
        overhead = 100.0 * (1.0 - hvd1 / bare)
        per_step_ms = 1000.0 * (b / hvd1 - b / bare)
        ok = overhead <= args.target
        verdicts.append(ok)
        summary["overhead"][str(b)] = {"percent": overhead, "ms_per_step": per_step_ms,
                                       "meets_target": ok}
        print(f"DistributedOptimizer overhead at 1 rank, batch {b}: {overhead:.2f}% "
              f"({per_step_ms:+.3f} ms per step; target <= {args.target:g}%: "
              f"{'MET' if ok else 'NOT MET'})")
        for config, key, setting in INFORMATION_ROWS:
            other = med.get(f"{config}@{b}")
            if other:
                summary["overhead"][str(b)][key] = 100.0 * (1.0 - other / bare)
                print(f"  with {setting} (information): {100.0 * (1.0 - other / bare):.2f}% "
                      f"({1000.0 * (b / other - b / bare):+.3f} ms per step)")
    staged = [n for n in configs if n.startswith("staged-")]
    for name in staged:
        b = configs[name][3]
        ref = med.get(f"hvd-1@{b}")
        if name in med and ref:
            ratio = med[name] / ref
            summary["staged"] = {"ranks": configs[name][0], "batch": b,
                                 "total_vs_hvd_1": ratio}
            print(f"{name.split('@')[0]} (ranks sharing one GPU, host-staged) at batch {b}: "
                  f"{med[name]:.1f} samples/sec total = {ratio:.3f} x hvd-1 (information only)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if failures:
        print(f"\n{len(failures)} run(s) failed; first:\n{failures[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
