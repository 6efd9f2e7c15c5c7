#!/usr/bin/env python3
"""The ranks' side of ``compression_benchmark.py``: training steps of a bandwidth-bound MLP
with ``hvd.DistributedOptimizer(..., compression=X)`` for each compression X, in one job.

Run it under MPI (``compression_benchmark.py`` does, on simulated hosts, or alone at 1 rank)::

    mpiexec -n 4 -hosts a:2,b:2 python benchmarks/compression_ranks.py --json out.json

For each compression (``none``, ``fp16``, ``powersgd1``, ``powersgd2``, ``powersgd4``: PowerSGD
at that rank) a fresh model (same seed on every rank, so no broadcast crosses the link) and a
fresh optimizer run ``--warmup`` steps (at least ``start_iter + 1``, so PowerSGD's plain steps
are never timed) and then ``--steps`` timed steps.  A step is zero_grad, forward, backward and
``optimizer.step()``; its time is the slowest rank's, and a configuration's is the median over
its timed steps.

Each step is also split into where its time goes, with timers wrapped around hvdlite's own
methods from outside (nothing in hvdlite changes): for PowerSGD the reduction at the end of
backward (``reduce_gradients``), within it the waits of its three allreduces (uncompressed
bucket, P, Q) and the Gram-Schmidt orthogonalization, the rest being the factors' matrix
products and error feedback; for the plain path the time in ``optimizer.step()`` (what is still
being reduced once backward ends).

``--digits`` instead times the digits example's model (examples/pytorch_digits.py) at 1 rank,
with and without PowerSGD (rank 2, as the example), for PowerSGD's overhead on a small model.
The configuration ``bare`` is torch's optimizer without hvdlite's wrapper.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.torch import powersgd_reducer  # noqa: E402
from compression_steps import (common_arguments, job_document, print_result,  # noqa: E402
                               run_ranks, step_result)   # (benchmarks/ is on sys.path)

PHASES = ("reduce", "wait_uncompressed", "wait_P", "wait_Q", "orthogonalize", "factors",
          "step_call")


def parse_args(argv=None) -> argparse.Namespace:
    p = common_arguments(__doc__.splitlines()[0])
    p.add_argument("--digits", action="store_true",
                   help="time the digits example's model instead (1 rank)")
    return p.parse_args(argv)


def mlp(widths: list[int], classes: int) -> nn.Sequential:
    """Linear layers of ``widths`` with ReLUs between, then a ``classes``-way head."""
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], classes))


def digits_model() -> nn.Module:
    """examples/pytorch_digits.py's DigitsNet (64 -> 128 -> 64 -> 10), built without importing
    the example (which needs scikit-learn for its data)."""
    return mlp([64, 128, 64], 10)


def compression_of(name: str, start_iter: int):
    """``compression=`` for a configuration name (none, fp16, powersgd<rank>)."""
    if name.startswith("powersgd"):
        return hvd.Compression.powersgd(rank=int(name[len("powersgd"):]), start_iter=start_iter)
    return getattr(hvd.Compression, name)


class Phases:
    """Per-step timers wrapped around PowerSGDReducer's methods (from outside hvdlite)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        cls = powersgd_reducer.PowerSGDReducer
        self._saved = (cls.reduce_gradients, cls._allreduce_group,
                       powersgd_reducer.orthogonalize_)
        reduce, group, ortho = self._saved
        phases = self

        def timed_reduce(reducer, *a, **k):
            t = time.perf_counter()
            try:
                return reduce(reducer, *a, **k)
            finally:
                phases.now["reduce"] += time.perf_counter() - t

        def timed_group(reducer, tensors, what, *a, **k):
            handle, wire = group(reducer, tensors, what, *a, **k)
            return _TimedHandle(handle, "wait_" + what, phases.now), wire

        def timed_ortho(*a, **k):
            t = time.perf_counter()
            try:
                return ortho(*a, **k)
            finally:
                phases.now["orthogonalize"] += time.perf_counter() - t

        cls.reduce_gradients = timed_reduce
        cls._allreduce_group = timed_group
        powersgd_reducer.orthogonalize_ = timed_ortho

    def take(self) -> dict[str, float]:
        """This step's times (seconds) by phase; starts the next step's at zero."""
        taken = dict(self.now)
        self.now.clear()
        return taken


class _TimedHandle:
    def __init__(self, handle, key: str, sink: dict) -> None:
        self._handle, self._key, self._sink = handle, key, sink

    def wait(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._handle.wait(*a, **k)
        finally:
            self._sink[self._key] += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._handle, name)


def run_config(name: str, args, make_model, data, phases: Phases, comm) -> dict:
    """Warm-up and timed steps of one compression; the slowest rank's times per step."""
    torch.manual_seed(args.seed)   # (the same initial model on every rank)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if name != "bare":   # ("bare": torch's optimizer alone, the reference of a 1-rank job)
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=compression_of(name, args.start_iter))
    x, y = data
    warmup = max(args.warmup, args.start_iter + 1)
    times, splits = [], []
    for i in range(warmup + args.steps):
        phases.take()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        optimizer.step()
        t2 = time.perf_counter()
        if i >= warmup:
            split = phases.take()
            split["step_call"] = t2 - t1
            # (PowerSGD's matrix products and error feedback: the reduction less its waits)
            split["factors"] = split.get("reduce", 0.0) - split.get("orthogonalize", 0.0) - sum(
                v for k, v in split.items() if k.startswith("wait_"))
            times.append(t2 - t0)
            splits.append(split)
    # the slowest rank's time of each step
    per_rank = comm.allgather((times, [{k: s.get(k, 0.0) for k in PHASES} for s in splits]))
    step_s = [max(r[0][i] for r in per_rank) for i in range(args.steps)]
    # phases: each rank's median, averaged over the ranks (a mean keeps the parts additive)
    phase_ms = {k: 1e3 * statistics.fmean(statistics.median(s[k] for s in r[1])
                                          for r in per_rank) for k in PHASES}
    shapes = [tuple(p.shape) for p in model.parameters()]
    del optimizer, model
    return step_result(name, step_s, args.batch_size, comm.Get_size(), shapes, phase_ms)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    from mpi4py import MPI   # (after init: hvdlite initialised MPI)
    comm = MPI.COMM_WORLD
    hosts = len(set(comm.allgather(MPI.Get_processor_name())))
    names = [n for n in args.compressions.split(",") if n]
    if args.digits:
        widths, classes = [64], 10
        make_model = digits_model
        args.batch_size = args.batch_size if args.batch_size != 8 else 32   # the example's
    else:
        widths, classes = [int(w) for w in args.widths.split(",")], args.classes
        make_model = lambda: mlp(widths, classes)   # noqa: E731
    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    data = (torch.randn(args.batch_size, widths[0], generator=gen),
            torch.randint(0, classes, (args.batch_size,), generator=gen))
    params = sum(p.numel() for p in make_model().parameters())
    phases = Phases()
    results = []
    for name in names:
        results.append(run_config(name, args, make_model, data, phases, comm))
        if hvd.rank() == 0:
            print_result(results[-1])
    if args.json and hvd.rank() == 0:
        model = "digits" if args.digits else {"widths": widths, "classes": classes}
        Path(args.json).write_text(json.dumps(job_document(
            args, hvd.size(), hosts, params, model, results), indent=2) + "\n")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    run_ranks(main)
