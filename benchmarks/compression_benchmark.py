#!/usr/bin/env python3
"""Gradient compression across hosts: none, fp16 and PowerSGD (rank 1, 2, 4) on a modeled link.

Trains a bandwidth-bound MLP (default 1024-4096-4096-1024-16, 25.2 M parameters, batch 8 per
rank, synthetic data, fixed seed) with ``hvd.DistributedOptimizer(..., compression=X)`` for each
compression X (``compression_ranks.py`` does the steps; with ``--framework keras`` the same MLP
in Keras through ``hvdlite.tensorflow.keras``, ``compression_keras_ranks.py``), in these jobs:

* 1 rank, no network: each compression's compute overhead (its step time against none's);
* the same at 1 rank for the digits example's model (examples/pytorch_digits.py), PowerSGD
  rank 2 against none (``--no-digits`` skips it);
* ranks on simulated hosts (the multi-host bed, ``tests/multihost/hosts.py``: needs root),
  default 2 hosts x 2 ranks: first unshaped (loopback at memory speed: compute plus a cheap
  exchange), then once per ``--link RATE`` with ``lo`` capped at that rate
  (``tests/multihost/link.py``) for as long as that job runs.

For each compression: the median step time (slowest rank), samples/s, the bytes each step's
allreduces carry (none: the gradients; fp16: half; PowerSGD: P and Q plus the gradients that do
not compress, by hvdlite's compression-rate rule), the step's *link floor* (the fewest bytes
that must cross the shared link for those allreduces, 2(H-1) x S, over the rate), step/floor,
and the speedup of samples/s over none's in the same job; and where the step's time went
(compute, PowerSGD's allreduce waits and orthogonalization).  Nothing is asserted on timings.

    sudo .venv/bin/python benchmarks/compression_benchmark.py --link 1gbit
    sudo .venv/bin/python benchmarks/compression_benchmark.py --link 1gbit,10gbit --json r.json
    .venv/bin/python benchmarks/compression_benchmark.py --layout none   # 1 rank only
    sudo .venv/bin/python benchmarks/compression_benchmark.py --link 1gbit --keep-freed-memory

``--keep-freed-memory`` runs the ranks with glibc's malloc keeping freed memory: PowerSGD's
gradient-size temporaries then cost no page faults (docs/benchmarks.md, "Gradient compression
across hosts": before hvdlite's PowerSGD did its arithmetic in place, that was most of its
time here).

While a capped job runs every loopback connection on the machine is capped: keep them short.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.mpi_harness import mpiexec_path  # noqa: E402
from tests.multihost import link  # noqa: E402
from tests.multihost.hosts import BedUnavailable, HostBed, host_list  # noqa: E402

RANKS_SCRIPTS = {"torch": REPO / "benchmarks" / "compression_ranks.py",
                 "keras": REPO / "benchmarks" / "compression_keras_ranks.py"}
# glibc: serve large blocks from the heap and keep it, so that freed gradient-size temporaries
# are reused instead of being unmapped and faulted in again (zeroed) at the next step.
KEEP_FREED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
DIGITS_STEPS = 300   # digits steps take ~1 ms: many, for a stable median


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="2+2",
                   help="ranks per simulated host (default 2+2; 'none': 1-rank runs only)")
    p.add_argument("--link", default="",
                   help="comma-separated rates to cap lo at, one job each (tc's notation: "
                        "1gbit,10gbit); default: only the unshaped job")
    p.add_argument("--no-unshaped", action="store_true",
                   help="skip the unshaped job across hosts")
    p.add_argument("--no-single", action="store_true", help="skip the 1-rank jobs")
    p.add_argument("--no-digits", action="store_true", help="skip the digits model's 1-rank job")
    p.add_argument("--framework", choices=sorted(RANKS_SCRIPTS), default="torch",
                   help="the ranks' framework (default torch; keras: no digits job and no "
                        "split of where the time went)")
    p.add_argument("--widths", default="1024,4096,4096,1024")
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--compressions", default="none,fp16,powersgd1,powersgd2,powersgd4")
    p.add_argument("--start-iter", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per compression")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="run the ranks with glibc's malloc keeping freed memory (KEEP_FREED_ENV) "
                        "instead of returning it to the kernel: PowerSGD's temporaries of "
                        "gradient size then cost no page faults (what an allocator fix would do)")
    p.add_argument("--timeout", type=float, default=420, help="seconds per job")
    p.add_argument("--json", metavar="PATH", help="write every job's results here")
    args = p.parse_args(argv)
    args.slots = None
    if args.layout != "none":
        try:
            args.slots = [int(n) for n in args.layout.split("+")]
        except ValueError:
            p.error(f"--layout {args.layout!r}: write ranks per host as 2+2")
        if len(args.slots) < 2 or min(args.slots) < 1:
            p.error("--layout needs two hosts or more, each with a rank")
    try:
        args.rates = [(r, link.parse_rate(r)) for r in args.link.split(",") if r]
    except ValueError as exc:
        p.error(f"--link: {exc}")
    if args.rates and args.slots is None:
        p.error("--link needs hosts (--layout)")
    return args


def ranks_argv(args, json_path: Path, digits: bool = False) -> list[str]:
    """compression_ranks.py's command line for one job."""
    argv = [sys.executable, str(RANKS_SCRIPTS[args.framework]), "--json", str(json_path),
            "--start-iter", str(args.start_iter), "--warmup", str(args.warmup)]
    if digits:
        return argv + ["--digits", "--compressions", "bare,none,powersgd1,powersgd2",
                       "--steps", str(DIGITS_STEPS), "--warmup", "20"]
    return argv + ["--widths", args.widths, "--classes", str(args.classes),
                   "--batch-size", str(args.batch_size), "--compressions", args.compressions,
                   "--steps", str(args.steps)]


def rank_env(args) -> dict[str, str]:
    """The ranks' environment: one intra-op thread, and glibc's knobs if asked."""
    return {"OMP_NUM_THREADS": "1", **(KEEP_FREED_ENV if args.keep_freed_memory else {})}


def run_single(args, json_path: Path, digits: bool = False) -> dict | None:
    """One rank, no launcher and no network; the job's results or None (said why)."""
    env = {**os.environ, **rank_env(args)}
    try:
        job = subprocess.run(ranks_argv(args, json_path, digits), cwd=str(REPO), env=env,
                             capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"the 1-rank job timed out after {args.timeout:g} s", file=sys.stderr)
        return None
    if job.returncode != 0 or not json_path.exists():
        print(f"the 1-rank job failed:\n{job.stdout}{job.stderr}", file=sys.stderr)
        return None
    return json.loads(json_path.read_text())


def floors(document: dict, bytes_per_s: float | None) -> None:
    """Add each result's link bytes (and, with a rate, its floor in ms) in place."""
    for r in document["results"]:
        r["link_bytes"] = link.allreduce_floor_bytes(r["bytes"]["total"], document["hosts"])
        if bytes_per_s is not None:
            r["floor_ms"] = link.floor_ms(r["link_bytes"], bytes_per_s)


def table(document: dict, title: str) -> list[str]:
    """One job's results as a table: times, rates, bytes, floor, speedup, where time went."""
    results = document["results"]
    base = next((r for r in results if r["compression"] == "none"), None)
    shaped = "floor_ms" in results[0] if results else False
    lines = [title,
             f"{'compression':>11} {'step ms':>9} {'(min-max)':>17} {'samples/s':>9} "
             f"{'MiB/step':>9} {'link MiB':>9}" + (f" {'floor ms':>9} {'step/floor':>10}"
                                                   if shaped else "")
             + f" {'speedup':>8} {'overhead':>8}   where the time went "
             f"(ms; parts: the ranks' mean)"]
    for r in results:
        times = r["step_ms_all"]
        speed = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        over = r["step_ms"] / base["step_ms"] - 1 if base else float("nan")
        cells = (f"{r['compression']:>11} {r['step_ms']:>9.1f} "
                 f"{f'({min(times):.1f}-{max(times):.1f})':>17} {r['samples_per_s']:>9.1f} "
                 f"{r['bytes']['total'] / 2**20:>9.2f} {r['link_bytes'] / 2**20:>9.2f}")
        if shaped:
            cells += f" {r['floor_ms']:>9.1f} {link.over_floor(r['step_ms'], r['floor_ms']):>10}"
        lines.append(cells + f" {speed:>7.2f}x {over:>+8.0%}   {where(r)}")
    return lines


def where(r: dict) -> str:
    """Where a step's time went: PowerSGD's reduction split into its parts, or the time
    ``optimizer.step()`` still waited for the plain path's allreduces."""
    ph = r["phases_ms"]
    if not ph:   # (the Keras ranks time whole steps only)
        return ""
    if r["compression"].startswith("powersgd"):
        return (f"compute {r['step_ms'] - ph['reduce']:.1f}, reduce {ph['reduce']:.1f} = wait "
                f"P {ph['wait_P']:.1f} + Q {ph['wait_Q']:.1f} + uncompressed "
                f"{ph['wait_uncompressed']:.1f} + orthogonalize {ph['orthogonalize']:.1f} + "
                f"factors/error {ph['factors']:.1f}")
    return (f"forward+backward {r['step_ms'] - ph['step_call']:.1f}, step() "
            f"{ph['step_call']:.1f} (waiting for allreduces)")


def digits_lines(document: dict) -> list[str]:
    """The digits job: PowerSGD's overhead against the uncompressed wrapper (the goal's
    measure), and each wrapper's against torch's optimizer alone."""
    by = {r["compression"]: r for r in document["results"]}
    bare, none = by["bare"]["step_ms"], by["none"]["step_ms"]
    lines = [f"digits model (examples/pytorch_digits.py), 1 rank, batch {document['batch_size']}, "
             f"median of {document['steps']} steps: torch alone {bare:.3f} ms, "
             f"DistributedOptimizer without compression {none:.3f} ms ({none / bare - 1:+.0%})"]
    for rank in (1, 2):
        psgd = by[f"powersgd{rank}"]
        lines.append(f"  PowerSGD rank {rank} {psgd['step_ms']:.3f} ms: "
                     f"{psgd['step_ms'] / none - 1:+.0%} of the uncompressed wrapper's step "
                     f"(goal: under 10%), {psgd['step_ms'] / bare - 1:+.0%} of torch alone's; "
                     f"{where(psgd)}")
    return lines


def run_bed(args, jobs: list[tuple[str, str | None, float | None]], out_dir: Path,
            documents: dict) -> bool:
    """The jobs across simulated hosts (label, rate, bytes/s), each capped only while it runs;
    whether all went well."""
    names = [f"hvdnode{i}" for i in range(1, len(args.slots) + 1)]
    layout = list(zip(names, args.slots))
    np_ = sum(args.slots)
    try:
        bed = HostBed(names)
        bed.start()
    except BedUnavailable as exc:
        print(f"cannot simulate hosts here: {exc}", file=sys.stderr)
        return False
    ok = True
    try:
        for label, rate, bytes_per_s in jobs:
            out = bed.root / "jobs" / f"compression-{label}.json"
            cmd = [mpiexec_path(), "-n", str(np_), "-hosts", host_list(layout),
                   *ranks_argv(args, out)]
            try:
                # the cap is on only while the job runs (every loopback connection pays for it)
                with link.maybe_capped(rate, limit_s=args.timeout + 60):
                    job = bed.run(cmd, np_, timeout=args.timeout,
                                  env=rank_env(args), cwd=str(REPO))
            except link.LinkUnavailable as exc:
                print(f"cannot cap the link: {exc}", file=sys.stderr)
                ok = False
                break
            if job.returncode != 0 or not out.exists():
                print(f"the {label} job failed:\n{job.output}", file=sys.stderr)
                ok = False
                break
            document = json.loads(out.read_text())
            document["link"] = rate
            floors(document, bytes_per_s)
            documents[label] = document
            print("\n".join(["", *table(document, title_of(document, rate))]), flush=True)
    finally:
        problems = bed.close()
    if problems:
        print("tearing the simulated hosts down: " + "; ".join(problems), file=sys.stderr)
    return ok and not problems


def title_of(document: dict, rate: str | None) -> str:
    where_ = f"{document.get('framework', 'torch')}, " + (
        f"{document['ranks']} rank" if document["ranks"] == 1 else
        f"{document['hosts']} hosts, {document['ranks']} ranks")
    shaping = ("" if document["ranks"] == 1 else "; link unshaped (loopback)" if rate is None
               else f"; lo capped at {link.format_rate(link.parse_rate(rate))}, one link "
                    f"shared by every host both ways; floor = 2(H-1) x bytes / rate")
    return (f"{where_}: {document['params'] / 1e6:.2f} M parameters, batch "
            f"{document['batch_size']}/rank, median of {document['steps']} steps after "
            f"{document['warmup']} (PowerSGD start_iter {document['start_iter']}){shaping}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rates:
        reason = link.unavailable_reason()
        kind, handle, line = link.root_qdisc() if reason is None else ("", "0:", "")
        if reason or handle != "0:":
            print(f"cannot cap the link: {reason or f'lo already has a root qdisc ({line})'}",
                  file=sys.stderr)
            return 2
    out_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    documents: dict = {}
    ok = True
    tag = f"{os.getpid()}"
    if not args.no_single:
        single = run_single(args, out_dir / f"compression-{tag}-single.json")
        ok &= single is not None
        if single:
            floors(single, None)
            documents["single"] = single
            print("\n".join(table(single, title_of(single, None))), flush=True)
    if not args.no_digits and args.framework == "torch":
        digits = run_single(args, out_dir / f"compression-{tag}-digits.json", digits=True)
        ok &= digits is not None
        if digits:
            documents["digits"] = digits
            print("\n" + "\n".join(digits_lines(digits)), flush=True)
    if args.slots is not None:
        jobs = ([] if args.no_unshaped else [("unshaped", None, None)]) + [
            (rate, rate, bytes_per_s) for rate, bytes_per_s in args.rates]
        if jobs:
            ok &= run_bed(args, jobs, out_dir, documents)
    if args.json:
        Path(args.json).write_text(json.dumps(documents, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
