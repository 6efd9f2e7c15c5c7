"""Randomized steps of mixed collectives, checked against numpy references on every rank.

Each step draws (from a generator every rank seeds alike) 1-19 operations: allreduce in and
out of place (every op, prescale/postscale), allgather with per-rank row counts, broadcast in
and out of place from a random root, alltoall with random splits, reducescatter, grouped
allreduce and allgather, over every integer and float dtype and shapes from scalar to 3-D,
including empty ones, and now and then up to 570k elements (fused batches and single
tensors large enough for the intra-node paths: the shared-memory window and direct copies);
names reuse a pool of 60, so the response cache sees hits, changed parameters and evictions.
Each rank submits them in its own random order, sleeping at random between submissions (now
and then 30 ms), optionally from two threads, and waits for them in another random order.
Sometimes one rank gives one allreduce a different shape (every rank must get a
TensorMismatchError for it and correct results for the rest), sometimes the step ends with a
barrier; with ``--sets`` some operations run on process sets of 1-2 ranks.
Inputs are small integers, regenerated on every rank from (seed, step, name, rank), so each
rank computes every expected result itself.  Checks run after the step's last wait, so a
failed check never leaves another rank waiting.

argv: seeds (comma-separated), steps per seed, then optional flags --sets and --threads.
Each seed is one reported case, ``seed<k>``.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # sibling helper modules

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hvdlite as hvd  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402

SEEDS = [int(s) for s in sys.argv[1].split(",")]
STEPS = int(sys.argv[2])
SETS = "--sets" in sys.argv[3:]
THREADS = "--threads" in sys.argv[3:]

_WORLD = MPI.COMM_WORLD.Get_size()
# Sets of 1 or 2 ranks (never the whole world): [0, 1], [0, last], [1..last].
SET_RANKS = []
for ranks in ([0, 1], [0, _WORLD - 1], list(range(1, _WORLD))):
    if ranks not in SET_RANKS and len(set(ranks)) == len(ranks) and len(ranks) < _WORLD:
        SET_RANKS.append(ranks)
if SETS:
    SET_OBJECTS = [hvd.ProcessSet(ranks) for ranks in SET_RANKS]
    hvd.init(process_sets=SET_OBJECTS)
    PROCESS_SET = {tuple(r): ps for r, ps in zip(SET_RANKS, SET_OBJECTS)}
else:
    hvd.init()
    PROCESS_SET = {}
RANK, SIZE = hvd.rank(), hvd.size()
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
KINDS = ["allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "alltoall",
         "reducescatter", "grouped_allreduce", "grouped_allgather"]
ROW_KINDS = ("allgather", "alltoall", "reducescatter", "grouped_allgather")


def rng_for(seed, *parts):
    return np.random.default_rng(zlib.crc32(repr((seed,) + parts).encode()))


def data(seed, step, name, rank, dtype, shape, op):
    g = rng_for(seed, "data", step, name, rank)
    if op == "Product":
        values = g.integers(1, 3, size=shape)        # products of <= 4 ranks stay small
    elif np.dtype(dtype).kind == "u":
        values = g.integers(0, 6, size=shape)
    else:
        values = g.integers(-4, 5, size=shape)
    return np.asarray(values).astype(dtype)


def reduced(arrays, op, dtype, pre=1.0, post=1.0):
    """Reference reduction in float64 (exact for these small integers), cast back."""
    xs = [a.astype(np.float64) * pre for a in arrays]
    if op in ("Sum", "Average"):
        out = sum(xs) / (len(xs) if op == "Average" else 1)
    elif op == "Min":
        out = np.minimum.reduce(xs)
    elif op == "Max":
        out = np.maximum.reduce(xs)
    else:
        out = np.multiply.reduce(xs)
    return (out * post).astype(dtype)


def check(label, got, expected, dtype):
    got = np.asarray(got)
    assert got.shape == expected.shape, f"{label}: shape {got.shape} != {expected.shape}"
    if np.dtype(dtype).kind in "iu":
        assert np.array_equal(got, expected), f"{label}: {got.ravel()[:6]} != " \
                                              f"{expected.ravel()[:6]}"
    else:
        tol = 2e-2 if dtype == "float16" else 1e-5
        assert np.allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol,
                           atol=tol), f"{label}: {got.ravel()[:6]} != {expected.ravel()[:6]}"


def plan(seed, step):
    """This step's operations (the same on every rank) and the mismatch to inject, if any."""
    g = rng_for(seed, "plan", step)
    ops = []
    for i in g.choice(60, size=int(g.integers(1, 20)), replace=False):
        kind = KINDS[int(g.integers(len(KINDS)))]
        dtype = DTYPES[int(g.integers(len(DTYPES)))]
        shape = tuple(int(x) for x in g.integers(0, 5, size=int(g.integers(0, 4))))
        if kind in ROW_KINDS and not shape:
            shape = (int(g.integers(0, 5)),)
        if g.random() < 0.15:   # large enough for the intra-node paths (64 KiB, 1 MiB, 2 MiB)
            shape = (int(g.integers(1, 140)), 4096)
        op = ["Sum", "Average", "Min", "Max", "Product"][int(g.integers(5))]
        if (kind == "reducescatter" and op == "Product") or (
                np.dtype(dtype).kind in "iu" and op == "Average"):
            op = "Sum"   # (integer Average truncates: covered by the deterministic tests)
        pre = post = 1.0
        if np.dtype(dtype).kind == "f" and g.random() < 0.3:
            pre, post = 0.5, 4.0
        ranks = list(range(SIZE))
        if SETS and g.random() < 0.35:
            ranks = SET_RANKS[int(g.integers(len(SET_RANKS)))]
        ops.append(dict(name=f"fuzz.{i}", kind=kind, dtype=dtype, shape=shape, op=op, pre=pre,
                        post=post, ranks=ranks, root=ranks[int(g.integers(len(ranks)))],
                        members=int(g.integers(1, 4))))
    bad = None
    if g.random() < 0.15:
        candidates = [k for k, o in enumerate(ops)
                      if o["kind"] in ("allreduce", "allreduce_") and len(o["ranks"]) > 1]
        if candidates:
            k = candidates[int(g.integers(len(candidates)))]
            bad = (k, ops[k]["ranks"][int(g.integers(len(ops[k]["ranks"])))])
    return ops, bad, g.random() < 0.1


def rows_of(seed, o, step, rank):
    return int(rng_for(seed, "rows", o["name"], step, rank).integers(0, 4))


def splits_of(seed, o, step, rank):
    rows = o["shape"][0]
    cuts = np.sort(rng_for(seed, "splits", o["name"], step, rank).integers(
        0, rows + 1, size=len(o["ranks"]) - 1))
    return np.diff(np.concatenate([[0], cuts, [rows]])).astype(np.int64)


def submit(seed, o, step, mismatch):
    """Start operation ``o``; returns (handle, the input array(s))."""
    name, kind, dtype, shape, op = o["name"], o["kind"], o["dtype"], o["shape"], o["op"]
    ps = PROCESS_SET.get(tuple(o["ranks"]))
    if mismatch:
        shape = shape + (7,)
    if kind in ("allreduce", "allreduce_"):
        x = data(seed, step, name, RANK, dtype, shape, op)
        start = hvd.allreduce_async_ if kind == "allreduce_" else hvd.allreduce_async
        return start(x, name=name, op=OPS[op], prescale_factor=o["pre"],
                     postscale_factor=o["post"], process_set=ps), x
    if kind == "allgather":
        x = data(seed, step, name, RANK, dtype, (rows_of(seed, o, step, RANK),) + shape[1:], op)
        return hvd.allgather_async(x, name=name, process_set=ps), x
    if kind in ("broadcast", "broadcast_"):
        x = data(seed, step, name, RANK, dtype, shape, op)
        start = hvd.broadcast_async_ if kind == "broadcast_" else hvd.broadcast_async
        return start(x, root_rank=o["root"], name=name, process_set=ps), x
    if kind == "alltoall":
        x = data(seed, step, name, RANK, dtype, shape, op)
        return hvd.alltoall_async(x, splits=splits_of(seed, o, step, RANK), name=name,
                                  process_set=ps), x
    if kind == "reducescatter":
        x = data(seed, step, name, RANK, dtype, shape, op)
        return hvd.reducescatter_async(x, name=name, op=OPS[op], process_set=ps), x
    if kind == "grouped_allreduce":
        xs = [data(seed, step, f"{name}/{j}", RANK, dtype, shape, op)
              for j in range(o["members"])]
        return hvd.grouped_allreduce_async(xs, name=name, op=OPS[op], prescale_factor=o["pre"],
                                           postscale_factor=o["post"], process_set=ps), xs
    xs = [data(seed, step, f"{name}/{j}", RANK, dtype,
               (rows_of(seed, o, step, RANK) + j,) + shape[1:], op) for j in range(o["members"])]
    return hvd.grouped_allgather_async(xs, name=name, process_set=ps), xs


def verify(seed, o, step, got, x):
    name, kind, dtype, shape, op = o["name"], o["kind"], o["dtype"], o["shape"], o["op"]
    ranks, me = o["ranks"], o["ranks"].index(RANK)
    label = f"step {step} {kind} {name} {dtype}{shape} {op} on ranks {ranks}"

    def inputs(tag=name, shape_of=lambda r: shape):
        return [data(seed, step, tag, r, dtype, shape_of(r), op) for r in ranks]

    if kind in ("allreduce", "allreduce_"):
        expected = reduced(inputs(), op, dtype, o["pre"], o["post"])
        check(label, got, expected, dtype)
        if kind == "allreduce_":
            check(label + " (in place)", x, expected, dtype)
    elif kind == "allgather":
        check(label, got, np.concatenate(
            inputs(shape_of=lambda r: (rows_of(seed, o, step, r),) + shape[1:])), dtype)
    elif kind in ("broadcast", "broadcast_"):
        expected = data(seed, step, name, o["root"], dtype, shape, op)
        check(label, got, expected, dtype)
        if kind == "broadcast_":
            check(label + " (in place)", x, expected, dtype)
    elif kind == "alltoall":
        received, received_splits = got
        parts = []
        for r, xr in zip(ranks, inputs()):
            splits = splits_of(seed, o, step, r)
            start = int(splits[:me].sum())
            parts.append(xr[start:start + int(splits[me])])
        check(label, received, np.concatenate(parts), dtype)
        check(label + " splits", received_splits, np.array([len(p) for p in parts]), "int64")
    elif kind == "reducescatter":
        full, n = reduced(inputs(), op, dtype), len(ranks)
        counts = [shape[0] // n + (1 if r < shape[0] % n else 0) for r in range(n)]
        start = sum(counts[:me])
        check(label, got, full[start:start + counts[me]], dtype)
    elif kind == "grouped_allreduce":
        for j in range(o["members"]):
            check(f"{label}[{j}]", got[j],
                  reduced(inputs(f"{name}/{j}"), op, dtype, o["pre"], o["post"]), dtype)
    else:
        for j in range(o["members"]):
            rows = lambda r, j=j: (rows_of(seed, o, step, r) + j,) + shape[1:]  # noqa: E731
            check(f"{label}[{j}]", got[j], np.concatenate(inputs(f"{name}/{j}", rows)), dtype)


def run_step(seed, step, problems):
    ops, bad, barrier = plan(seed, step)
    mine = rng_for(seed, "order", step, RANK)
    order = [int(k) for k in mine.permutation(len(ops)) if RANK in ops[int(k)]["ranks"]]
    started, errors = {}, []

    def submit_all(ks, g):
        try:
            for k in ks:
                if g.random() < 0.2:
                    time.sleep(float(g.random()) * (0.03 if g.random() < 0.1 else 0.002))
                started[k] = submit(seed, ops[k], step, bad == (k, RANK))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    if THREADS and len(order) > 1:
        threads = [threading.Thread(target=submit_all,
                                    args=(order[i::2], rng_for(seed, "thread", step, RANK, i)))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        submit_all(order, mine)
    if errors:
        raise errors[0]   # a submission failed: the ranks are out of step, nothing to save
    if barrier:
        hvd.barrier()
    outcomes = {}
    for k in mine.permutation(len(ops)):
        if int(k) in started:
            handle, x = started[int(k)]
            try:
                outcomes[int(k)] = (handle.wait(), None)
            except hvd.TensorMismatchError as exc:
                outcomes[int(k)] = (None, exc)
    for k, (got, error) in outcomes.items():
        o, x = ops[k], started[k][1]
        try:
            if bad is not None and bad[0] == k:
                assert error is not None, f"step {step} {o['name']}: mismatch not reported"
            else:
                assert error is None, f"step {step} {o['name']}: unexpected {error}"
                verify(seed, o, step, got, x)
        except AssertionError as exc:
            problems.append(str(exc))


def run_seed(seed):
    problems = []
    for step in range(STEPS):
        run_step(seed, step, problems)
    assert not problems, f"{len(problems)} wrong results, first: {problems[0]}"


r = Reporter(RANK)
for seed in SEEDS:
    r.case(f"seed{seed}", run_seed, seed)
r.write()
hvd.shutdown()
