#!/usr/bin/env python3
"""The same collectives under ``torchrun`` and under ``mpiexec``, in the same run (issue 48).

Runs benchmarks/allreduce_benchmark.py (hvdlite against raw mpi4py on the same buffers, every
result checked against numpy) as a job of ``--np`` ranks started by each launcher in turn,
``--rounds`` times alternately (mpiexec, torchrun, mpiexec, ...), so that the machine's drift
hits both alike, and prints per buffer size the best median of each launcher for hvdlite's
in-place allreduce, raw MPI's Allreduce, and the many-small-tensors round, with the ratio
torchrun / mpiexec (1.00x: no slower).  Under torchrun, hvd.init() forms the world itself
(MPICH's manual launch); after that the ranks are an MPI world like any other, so the goal
is 1.00x within noise.

    python benchmarks/launcher_benchmark.py --np 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "allreduce_benchmark.py"
SHORT = ["--sizes", "4K,1M", "--small-count", "8", "--small-kib", "4", "--after-compute-ms",
         "0", "--iterations", "20", "--min-iterations", "5", "--time-budget", "0.5",
         "--blocks", "2"]


def launch(kind: str, np_: int, workload_args: list[str], out: str, timeout: float) -> dict:
    bin_dir = os.path.dirname(sys.executable)
    program = [str(WORKLOAD), *workload_args, "--json", out]
    if kind == "mpiexec":
        cmd = [os.path.join(bin_dir, "mpiexec"), "-n", str(np_), sys.executable, *program]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(np_), *program]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": bin_dir + os.pathsep +
           os.environ.get("PATH", "")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(Path(out).read_text())


def rows(results: dict[str, list[dict]]) -> list[tuple[str, dict[str, float]]]:
    """(label, {launcher/variant: best median ms}) per buffer size and for the small round."""
    out = []
    sizes = [s["size"] for s in results["mpiexec"][0]["sizes"]]
    for i, size in enumerate(sizes):
        best = {}
        for kind, runs in results.items():
            best[f"{kind}.hvd"] = min(r["sizes"][i]["allreduce_inplace"]["median_ms"]
                                      for r in runs)
            best[f"{kind}.raw"] = min(r["sizes"][i]["raw"]["median_ms"] for r in runs)
        out.append((size, best))
    if results["mpiexec"][0].get("small"):
        small = results["mpiexec"][0]["small"]
        best = {}
        for kind, runs in results.items():
            best[f"{kind}.hvd"] = min(r["small"]["hvdlite"]["median_ms"] for r in runs)
            best[f"{kind}.raw"] = min(r["small"]["raw"]["median_ms"] for r in runs)
        out.append((f"{small['count']} x {small['tensor_bytes'] // 1024} KiB", best))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", action="store_true", help="a quick schedule (for tests)")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON here")
    parser.add_argument("workload", nargs=argparse.REMAINDER,
                        help="options for allreduce_benchmark.py (after --)")
    args = parser.parse_args(argv)
    workload = SHORT if args.short else [a for a in args.workload if a != "--"]
    results: dict[str, list[dict]] = {"mpiexec": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for kind in results:
                out = os.path.join(tmp, f"{kind}{round_}.json")
                document = launch(kind, args.np, workload, out, timeout=900)
                if not all(s["correct"] for s in document["sizes"]):
                    raise SystemExit(f"{kind}: a result differed from numpy")
                results[kind].append(document)
    table = rows(results)
    print(f"hvdlite collectives, {args.np} ranks, torchrun against mpiexec ({args.rounds} "
          f"alternating rounds, best median ms of each)")
    print(f"{'case':>16} {'mpiexec hvd':>12} {'torchrun hvd':>13} {'ratio':>7} "
          f"{'mpiexec raw':>12} {'torchrun raw':>13} {'ratio':>7}")
    for label, best in table:
        print(f"{label:>16} {best['mpiexec.hvd']:12.3f} {best['torchrun.hvd']:13.3f} "
              f"{best['torchrun.hvd'] / best['mpiexec.hvd']:6.2f}x "
              f"{best['mpiexec.raw']:12.3f} {best['torchrun.raw']:13.3f} "
              f"{best['torchrun.raw'] / best['mpiexec.raw']:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"np": args.np, "rounds": args.rounds,
                                               "rows": dict(table)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
