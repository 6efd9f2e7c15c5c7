#!/usr/bin/env python3
"""Allreduce across hosts: flat against hierarchical, and small messages, against raw MPI.

Runs ``cross_host_ranks.py`` (see there for the cases) with its ranks spread over simulated
hosts on this machine (the multi-host test bed, ``tests/multihost/hosts.py``: Linux namespaces,
TCP over loopback between hosts, shared memory within one; needs root), ``--runs`` times, and
prints each run's table and then, per case and variant, the median over the runs with their
range.  Nothing is asserted on the timings; the exit status is 1 if a result was wrong.

    sudo .venv/bin/python benchmarks/cross_host_benchmark.py                # 2 hosts x 2 ranks
    .venv/bin/python benchmarks/cross_host_benchmark.py --layout 3+1 --runs 5
    .venv/bin/python benchmarks/cross_host_benchmark.py --sizes 16MiB --small-count 0

    sudo .venv/bin/python benchmarks/cross_host_benchmark.py --link 1gbit   # a modeled network

Options after ``--`` go to ``cross_host_ranks.py`` (``--time-budget``, ``--blocks``, ...).

``--link RATE`` caps ``lo`` with a token bucket at that rate while each job runs
(``tests/multihost/link.py``; removed between jobs and on any exit), which caps every byte
between the hosts, all hosts sharing the one bucket; every result then has its link floor
beside it (the bytes that must cross between hosts over the rate) and its time over the floor.
While a job runs, every loopback connection on the machine is capped: keep such runs short.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.mpi_harness import mpiexec_path  # noqa: E402
from tests.multihost import link  # noqa: E402
from tests.multihost.hosts import BedUnavailable, HostBed, host_list  # noqa: E402

VARIANTS = ("raw", "flat", "hierarchical")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="2+2", help="ranks per simulated host (default 2+2)")
    p.add_argument("--runs", type=int, default=3, help="separate jobs (default 3)")
    p.add_argument("--sizes", default="16MiB,32MiB,64MiB")
    p.add_argument("--small-count", type=int, default=200)
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--json", metavar="PATH", help="write every run's results here")
    p.add_argument("--link", metavar="RATE",
                   help="cap lo at RATE (tc's notation: 1gbit, 10gbit, 500mbit) while each job "
                        "runs and print the link floor beside every result (default: no cap)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- options for cross_host_ranks.py")
    args = p.parse_args(argv)
    try:
        args.slots = [int(n) for n in args.layout.split("+")]
    except ValueError:
        p.error(f"--layout {args.layout!r}: write ranks per host as 2+2 or 1+2+1")
    if len(args.slots) < 2 or min(args.slots) < 1 or args.runs < 1:
        p.error("--layout needs two hosts or more, each with a rank; --runs at least 1")
    args.rest = [a for a in args.rest if a != "--"]
    if args.link is not None:
        try:
            args.link_bytes_per_s = link.parse_rate(args.link)
        except ValueError as exc:
            p.error(f"--link: {exc}")
    return args


def cases(document: dict) -> dict[str, dict]:
    """A run's cases by label."""
    found = {}
    for result in document["large"]:
        found[f"{result['bytes'] >> 20} MiB"] = result
    if document["lone"] is not None:
        found["lone"] = document["lone"]
    if document["round"] is not None:
        found["round"] = document["round"]
    for result in document.get("gather", []):
        nbytes = result["bytes"]
        found[f"gather {nbytes >> 20} MiB" if nbytes >= 1 << 20 else
              f"gather {nbytes >> 10} KiB"] = result
    return found


def summary(runs: list[dict]) -> list[str]:
    """Per case and variant: the median over the runs (and min-max); the ratios of medians;
    with a capped link, the case's link floor and each variant's median over it."""
    labels = list(cases(runs[0]))
    shaped = "floor_ms" in cases(runs[0])[labels[0]] if labels else False
    lines = [f"{'case':>14} " + " ".join(f"{v + ' ms (min-max)':>26}" for v in VARIANTS)
             + f" {'flat/hier':>9} {'hier/raw':>9} {'flat/raw':>9}"
             + (f" {'floor ms':>9} {'hier/floor':>10} {'flat/floor':>10} {'raw/floor':>10}"
                if shaped else "")]
    for label in labels:
        med = {}
        cells = []
        for v in VARIANTS:
            values = [cases(run)[label][v]["median_ms"] for run in runs]
            med[v] = statistics.median(values)
            cells.append(f"{med[v]:>9.3f} ({min(values):.3f}-{max(values):.3f})")
        floor = cases(runs[0])[label].get("floor_ms")
        beside = "" if floor is None else f" {floor:>9.3f} " + " ".join(
            f"{link.over_floor(med[v], floor):>10}" for v in ("hierarchical", "flat", "raw"))
        lines.append(f"{label:>14} " + " ".join(f"{c:>26}" for c in cells)
                     + f" {med['flat'] / med['hierarchical']:>8.2f}x"
                     f" {med['hierarchical'] / med['raw']:>8.2f}x"
                     f" {med['flat'] / med['raw']:>8.2f}x{beside}")
        for variant, row, meaning in cases(runs[0])[label].get("extras", ()):
            values = [cases(run)[label][variant]["median_ms"] for run in runs]
            value = statistics.median(values)
            beside = "" if floor is None else f", {link.over_floor(value, floor)} the floor"
            lines.append(f"{row:>14} {'':>26} {value:>9.3f} ({min(values):.3f}-"
                         f"{max(values):.3f}) {meaning}: {value / med['raw']:.2f}x raw{beside}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [f"hvdnode{i}" for i in range(1, len(args.slots) + 1)]
    layout = list(zip(names, args.slots))
    np_ = sum(args.slots)
    script = str(REPO / "benchmarks" / "cross_host_ranks.py")
    runs, failed = [], False
    if args.link is not None:
        reason = link.unavailable_reason()
        kind, handle, line = link.root_qdisc() if reason is None else ("", "0:", "")
        if reason or handle != "0:":
            print(f"cannot cap the link: {reason or f'lo already has a root qdisc ({line})'}",
                  file=sys.stderr)
            return 2
    try:
        bed = HostBed(names)
        bed.start()
    except BedUnavailable as exc:
        print(f"cannot simulate hosts here: {exc}", file=sys.stderr)
        return 2
    env = {"OMP_NUM_THREADS": "1"}
    try:
        for run in range(args.runs):
            out = bed.root / "jobs" / f"cross-{run}.json"
            cmd = [mpiexec_path(), "-n", str(np_), "-hosts", host_list(layout), sys.executable,
                   script, "--sizes", args.sizes, "--small-count", str(args.small_count),
                   "--json", str(out), *args.rest]
            if args.link is not None:
                cmd += ["--link", args.link]
            # the cap is on only while a job runs (every loopback connection pays for it)
            try:
                with link.maybe_capped(args.link, limit_s=args.timeout + 60):
                    job = bed.run(cmd, np_, timeout=args.timeout, env=env, cwd=str(REPO))
            except link.LinkUnavailable as exc:
                print(f"cannot cap the link: {exc}", file=sys.stderr)
                failed = True
                break
            print(f"--- run {run + 1} of {args.runs} ---\n{job.stdout.strip()}", flush=True)
            if job.returncode != 0 or not out.exists():
                print(job.output, file=sys.stderr)
                failed = True
                break
            runs.append(json.loads(out.read_text()))
    finally:
        problems = bed.close()
    if problems:
        print("tearing the simulated hosts down: " + "; ".join(problems), file=sys.stderr)
    if runs:
        print(f"\n{args.layout} ranks, medians over {len(runs)} runs of each run's median "
              f"(per iteration, max over ranks); " + (
                  "link unshaped" if args.link is None else
                  f"lo capped at {link.format_rate(args.link_bytes_per_s)} (floor: bytes that "
                  f"must cross between hosts / that rate, one link shared both ways)"))
        print("\n".join(summary(runs)))
    if args.json:
        Path(args.json).write_text(json.dumps({"layout": args.layout, "link": args.link,
                                               "runs": runs},
                                              indent=2) + "\n")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
