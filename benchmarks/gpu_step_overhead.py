"""Per-step host cost of DistributedOptimizer against torch's DDP, on one GPU at one rank.

Short, launch-bound steps are where a data-parallel wrapper's host work shows: the GPU waits
while Python hands gradients over.  This benchmark measures, in one run, on the same GPU and the
same models:

  bare   the plain optimizer (the reference)
  hvd    hvd.DistributedOptimizer (gradient buckets, NCCL), at 1 rank
  ddp    torch.nn.parallel.DistributedDataParallel (world size 1, NCCL)

Each worker process trains two copies of a model: the bare one and the wrapped one (hvd or ddp),
alternating timed blocks of steps between them, so that clock and thermal drift hit both alike;
the overhead is ``wrapped - bare`` in milliseconds per step, medians over the blocks.  Worker
processes run interleaved over ``--rounds``.  For hvd, the CPU time of every thread per step
(training thread, autograd's device thread, hvdlite's threads) shows where its host time goes,
and ``--py-spy PATH`` adds a sampled profile (collapsed stacks, one file per thread group).

``--variant NAME=DIR`` runs hvd from another hvdlite tree as well (e.g. the code before a
change, copied to DIR), for before/after comparisons in the same run.

    python benchmarks/gpu_step_overhead.py                 # mlp@1024, mlp@16384, deep@256
    python benchmarks/gpu_step_overhead.py --variant before=/tmp/old --json out.json
    python benchmarks/gpu_step_overhead.py --device cpu --workloads mlp@64 --rounds 1  # dry run

Exits with status 2 and a message when no usable GPU is present (unless ``--device cpu``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOADS = "mlp@1024,mlp@16384,deep@256"
GOAL_MS = 0.1   # the goal: hvd's overhead within DDP's + 0.1 ms at batch 1024


# --- worker: one process, one wrapper, several workloads -------------------------------------
def _thread_cpu_ns() -> dict[int, int]:
    """CPU time (ns) of every thread of this process, by native thread id (Linux schedstat)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def _thread_names() -> dict[int, str]:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    names[threading.get_native_id()] = "training thread"
    return names


def _group(name: str | None) -> str:
    if name is None:
        return "other threads (autograd's device thread, CUDA, NCCL)"
    if name.startswith("hvdlite"):
        return name
    return "training thread" if name == "training thread" else f"python thread {name}"


def _worker(args) -> int:
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(REPO / "examples"))
    from pytorch_synthetic_benchmark import build_model

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.worker == "hvd":
        import hvdlite.torch as hvd
        hvd.init()
        wrapper_info = f"hvdlite from {Path(hvd.__file__).resolve().parent.parent}"
    else:
        import torch.distributed as dist
        dist.init_process_group("nccl" if cuda else "gloo",
                                init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
        wrapper_info = f"torch {torch.__version__}"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    results = {"wrapper": args.worker, "info": wrapper_info, "workloads": {}}
    for workload in args.workloads.split(","):
        model_name, batch = workload.split("@")
        batch = int(batch)
        torch.manual_seed(1234)
        bare_model, in_shape, classes = build_model(model_name)
        torch.manual_seed(1234)
        wrapped_model, _, _ = build_model(model_name)
        bare_model.to(device)
        wrapped_model.to(device)
        bare_opt = torch.optim.SGD(bare_model.parameters(), lr=0.01, momentum=0.9)
        if args.worker == "hvd":
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(wrapped_model.parameters(), lr=0.01, momentum=0.9),
                named_parameters=wrapped_model.named_parameters())
            forward = wrapped_model
        else:
            from torch.nn.parallel import DistributedDataParallel
            forward = DistributedDataParallel(wrapped_model,
                                              device_ids=[0] if cuda else None)
            opt = torch.optim.SGD(forward.parameters(), lr=0.01, momentum=0.9)
        data = torch.randn(batch, *in_shape, device=device)
        target = torch.randint(0, classes, (batch,), device=device)
        variants = {"bare": (bare_model, bare_opt), args.worker: (forward, opt)}

        def step(model, optimizer) -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()

        def block(name: str, steps: int) -> tuple[float, float, dict[str, int]]:
            """(ms per step with the device synchronized around the block, median host ms per
            step call, CPU ns per step by thread group)."""
            model, optimizer = variants[name]
            sync()
            cpu0 = _thread_cpu_ns()
            host = []
            t0 = time.perf_counter()
            for _ in range(steps):
                s = time.perf_counter()
                step(model, optimizer)
                host.append(time.perf_counter() - s)
            sync()
            elapsed = time.perf_counter() - t0
            cpu1, names = _thread_cpu_ns(), _thread_names()
            by_group: dict[str, int] = {}
            for tid, ns in cpu1.items():
                g = _group(names.get(tid))
                by_group[g] = by_group.get(g, 0) + (ns - cpu0.get(tid, 0)) // steps
            return 1e3 * elapsed / steps, 1e3 * statistics.median(host), by_group

        for name in variants:   # warm-up: caches, cuDNN/cuBLAS handles, buckets planned
            block(name, args.warmup)
        samples = {name: {"ms": [], "host_ms": [], "cpu_ns": []} for name in variants}
        order = list(variants)
        for b in range(args.blocks):
            for name in (order if b % 2 == 0 else order[::-1]):
                ms, host_ms, cpu = block(name, args.steps)
                samples[name]["ms"].append(ms)
                samples[name]["host_ms"].append(host_ms)
                samples[name]["cpu_ns"].append(cpu)
        if args.py_spy and args.worker == "hvd":
            samples["profile"] = _profile(args, workload, lambda: step(*variants["hvd"]), sync)
        results["workloads"][workload] = samples
        del variants, opt, bare_opt
    Path(args.out).write_text(json.dumps(results))
    if args.worker == "hvd":
        hvd.shutdown()
    else:
        dist.destroy_process_group()
    return 0


def _profile(args, workload: str, run_step, sync) -> str:
    """Sample this process with py-spy while it runs hvd steps; returns the output file."""
    out = Path(args.out).with_suffix(f".{workload.replace('@', '_')}.pyspy.txt")
    cmd = [args.py_spy, "record", "--pid", str(os.getpid()), "--rate", "2000", "--duration",
           str(args.profile_seconds), "--format", "raw", "--threads", "--idle", "--nonblocking",
           "--output", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + args.profile_seconds + 30
    while proc.poll() is None and time.monotonic() < deadline:
        for _ in range(20):
            run_step()
        sync()
    if proc.poll() is None:
        proc.kill()
    log = proc.communicate()[0]
    return str(out) if out.exists() else f"py-spy failed: {log[-500:]}"


# --- driver ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or shutil.which("mpirun"))


def _run_worker(args, wrapper: str, tree: Path, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    for key in [k for k in env if k.startswith(("HVDLITE_", "HOROVOD_"))]:
        del env[key]
    env["HVDLITE_GPU_OPERATIONS"] = "nccl" if args.device == "cuda" else "mpi"
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", wrapper,
              "--device", args.device, "--workloads", args.workloads, "--steps", str(args.steps),
              "--blocks", str(args.blocks), "--warmup", str(args.warmup), "--out", str(out),
              "--port", str(_free_port()), "--profile-seconds", str(args.profile_seconds)]
    if args.py_spy:
        worker += ["--py-spy", args.py_spy]
    cmd = ([_mpiexec(), "-n", "1"] if wrapper == "hvd" else []) + worker
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=tree, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RuntimeError(f"timed out after {args.timeout:.0f} s: {' '.join(cmd)}\n"
                           f"{output[-3000:]}") from None
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"exit status {proc.returncode}: {' '.join(cmd)}\n{output[-3000:]}")
    return json.loads(out.read_text())


def _summarize(runs: list[tuple[str, dict]], workloads: list[str]) -> dict:
    """Per workload and configuration: median ms per step, host ms per step call, overhead
    against the same process's bare copy, and hvd's CPU per step by thread group."""
    summary: dict = {}
    for workload in workloads:
        per_config: dict[str, dict] = {}
        for config, result in runs:
            s = result["workloads"][workload]
            wrapped = result["wrapper"]
            c = per_config.setdefault(config, {"ms": [], "bare_ms": [], "host_ms": [],
                                               "bare_host_ms": [], "cpu_ns": {}})
            c["ms"] += s[wrapped]["ms"]
            c["bare_ms"] += s["bare"]["ms"]
            c["host_ms"] += s[wrapped]["host_ms"]
            c["bare_host_ms"] += s["bare"]["host_ms"]
            for block in s[wrapped]["cpu_ns"]:
                for group, ns in block.items():
                    c["cpu_ns"].setdefault(group, []).append(ns)
            if "profile" in s:
                c["profile"] = s["profile"]
        summary[workload] = {}
        for config, c in per_config.items():
            pairs = [w - b for w, b in zip(c["ms"], c["bare_ms"])]
            summary[workload][config] = {
                "ms": statistics.median(c["ms"]), "bare_ms": statistics.median(c["bare_ms"]),
                "overhead_ms": statistics.median(pairs),
                "host_ms": statistics.median(c["host_ms"]),
                "bare_host_ms": statistics.median(c["bare_host_ms"]),
                "cpu_us_by_thread": {g: statistics.median(v) / 1e3
                                     for g, v in sorted(c["cpu_ns"].items())},
                "profile": c.get("profile")}
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                   help=f"model@batch, comma-separated (default {DEFAULT_WORKLOADS})")
    p.add_argument("--rounds", type=int, default=2, help="worker processes per configuration")
    p.add_argument("--blocks", type=int, default=6, help="timed blocks per copy and process")
    p.add_argument("--steps", type=int, default=50, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                   help="also run hvd from the hvdlite tree in DIR under NAME")
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--py-spy", help="path of a py-spy binary: profile hvd's steps with it")
    p.add_argument("--profile-seconds", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300, help="seconds per worker process")
    p.add_argument("--json", help="write every sample and the summary here")
    p.add_argument("--out-dir", help="keep the workers' files (profiles) here")
    p.add_argument("--worker", choices=["hvd", "ddp"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)

    if args.device == "cuda":
        try:
            import torch
            usable = torch.cuda.is_available()
        except Exception:  # noqa: BLE001
            usable = False
        if not usable:
            print("gpu_step_overhead: no usable CUDA GPU here (torch.cuda.is_available() is "
                  "False); use --device cpu for a dry run.", file=sys.stderr)
            return 2
    if _mpiexec() is None:
        print("gpu_step_overhead: no mpiexec found (pip install mpich, or carry the mpich "
              "wheel; see scripts/gpu_check.sh).", file=sys.stderr)
        return 2
    configs: list[tuple[str, str, Path]] = [("hvd", "hvd", REPO)]
    for spec in args.variant:
        name, _, tree = spec.partition("=")
        configs.append((f"hvd[{name}]", "hvd", Path(tree).resolve()))
    if not args.no_ddp:
        configs.append(("ddp", "ddp", REPO))
    workloads = args.workloads.split(",")
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="gpu-step-overhead-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, dict]] = []
    failures = []
    for rnd in range(args.rounds):
        for config, wrapper, tree in (configs if rnd % 2 == 0 else configs[::-1]):
            out = out_dir / f"{config.replace('[', '_').replace(']', '')}.{rnd}.json"
            try:
                runs.append((config, _run_worker(args, wrapper, tree, out)))
                print(f"round {rnd}: {config} done", flush=True)
            except RuntimeError as exc:
                failures.append(f"{config}: {exc}")
                print(f"round {rnd}: {config} FAILED\n{exc}", flush=True)
    summary = _summarize(runs, workloads) if runs else {}
    for workload, per_config in summary.items():
        print(f"\n{workload}: ms per step (medians; overhead = wrapped - bare in the same "
              f"process)")
        print("| configuration | bare | wrapped | overhead | host per step call (bare) |")
        print("|---|---|---|---|---|")
        for config, s in per_config.items():
            print(f"| {config} | {s['bare_ms']:.3f} | {s['ms']:.3f} | {s['overhead_ms']:+.3f} | "
                  f"{s['host_ms']:.3f} ({s['bare_host_ms']:.3f}) |")
        for config, s in per_config.items():
            if config.startswith("hvd"):
                shown = ", ".join(f"{g} {us:.0f}" for g, us in s["cpu_us_by_thread"].items())
                print(f"  {config} CPU us per step by thread: {shown}")
            if s.get("profile"):
                print(f"  {config} profile: {s['profile']}")
        ddp = per_config.get("ddp")
        hvd_s = per_config.get("hvd")
        if ddp and hvd_s:
            gap = hvd_s["overhead_ms"] - ddp["overhead_ms"]
            print(f"  hvd overhead - ddp overhead: {gap:+.3f} ms (goal <= +{GOAL_MS} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs,
                                               "failures": failures}, indent=1))
    if failures:
        print(f"\n{len(failures)} worker(s) failed; first:\n{failures[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
