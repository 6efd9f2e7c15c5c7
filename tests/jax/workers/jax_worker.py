"""Every hvdlite.jax case in one launch (the case names are in jax_cases.py).

Every rank regenerates every rank's input from the case name and checks its result against a
numpy reference of the documented semantics; gradients against the torch adapter's rules
worked out by hand; optimizer steps against a single-process optax reference, and parameters
bitwise across ranks.  ``.eager`` cases run on concrete arrays, ``.jit`` ones inside jax.jit.
"""
import os
import sys
import time
import zlib

import numpy as np

import jax
import jax.numpy as jnp
import ml_dtypes
import optax
from mpi4py import MPI

import hvdlite.jax as hvd
from tests.jax.workers.jax_cases import CASES, DTYPES, MODES, OPS
from tests.workers._report import Reporter

_world = MPI.COMM_WORLD.Get_size()
EVEN = hvd.ProcessSet([q for q in range(_world) if q % 2 == 0])
ODD = hvd.ProcessSet([q for q in range(_world) if q % 2 == 1])
hvd.init(process_sets=[EVEN, ODD])
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
             "int32": np.int32, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


# --- helpers -----------------------------------------------------------------------------------
def rng(*parts):
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def ints(case, q, shape, dtype=np.float32, low=-4, high=5):
    if np.dtype(dtype) == np.bool_:
        return rng(case, q, shape).integers(0, 2, size=shape).astype(np.bool_)
    if np.dtype(dtype).kind == "u":
        low = 0
    return rng(case, q, shape).integers(low, high, size=shape).astype(dtype)


def every(case, shape, dtype=np.float32, ranks=None, **kw):
    return [ints(case, q, shape, dtype, **kw) for q in (range(SIZE) if ranks is None else ranks)]


def run(fn, mode, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


def same(got, want, exact=True):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if exact:
        np.testing.assert_array_equal(got.astype(np.float64) if got.dtype != np.bool_ else got,
                                      want.astype(np.float64) if want.dtype != np.bool_ else want)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=2e-2 if got.dtype.itemsize == 2 else 1e-6, atol=1e-6)


def expect_raises(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {str(exc)[-800:]}"
        return exc
    raise AssertionError(f"{exc_type.__name__} not raised")


def reduce_ref(inputs, op, dtype):
    dt = np.dtype(dtype)
    stack = np.stack([x.astype(np.float64) for x in inputs])
    if dt == np.bool_:
        stack = np.stack(inputs)
        return (stack.any(0) if op in ("Sum", "Max") else stack.all(0)).astype(np.bool_)
    out = {"Sum": stack.sum(0), "Min": stack.min(0), "Max": stack.max(0),
           "Product": stack.prod(0), "Average": stack.sum(0) / len(inputs)}[op]
    if op == "Average" and dt.kind in "iu":
        out = np.trunc(stack.sum(0) * (1.0 / len(inputs)))
    return out.astype(dt)


def split_rows(rows, parts):
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(int)


# --- collectives -------------------------------------------------------------------------------
def allreduce_case(mode, op, dt):
    case = f"ar.{op}.{dt}"
    low, high = (-2, 3) if op == "Product" else (-4, 5)
    inputs = every(case, (2, 3), NP_DTYPES[dt], low=low, high=high)
    got = run(lambda x: hvd.allreduce(x, op=getattr(hvd, op)), mode, jnp.asarray(inputs[RANK]))
    same(got, reduce_ref(inputs, op, NP_DTYPES[dt]),
         exact=not (op == "Average" and dt.startswith(("float", "bfloat"))))
    scalar = every(case + "s", (), NP_DTYPES[dt], low=low, high=high)
    got = run(lambda x: hvd.allreduce(x, op=getattr(hvd, op)), mode, jnp.asarray(scalar[RANK]))
    same(got, reduce_ref(scalar, op, NP_DTYPES[dt]),
         exact=not (op == "Average" and dt.startswith(("float", "bfloat"))))


def allreduce_scaled(mode):
    inputs = every("scaled", (5,))
    got = run(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
              mode, jnp.asarray(inputs[RANK]))
    same(got, (np.sum(inputs, 0) * 0.5 * 3.0).astype(np.float32))
    got = run(lambda x: hvd.allreduce(x, prescale_factor=2.0), mode, jnp.asarray(inputs[RANK]))
    same(got, (np.sum(inputs, 0) * 2.0 / SIZE).astype(np.float32), exact=False)


def allreduce_compressed(mode):
    inputs = every("compressed", (6,))
    for c in (hvd.Compression.fp16, hvd.Compression.bf16):
        got = run(lambda x: hvd.allreduce(x, op=hvd.Sum, compression=c), mode,
                  jnp.asarray(inputs[RANK]))
        same(got, np.sum(inputs, 0).astype(np.float32))   # small integers: exact in 16 bits
    ints32 = every("compressed.int", (3,), np.int32)
    got = run(lambda x: hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16), mode,
              jnp.asarray(ints32[RANK]))
    same(got, np.sum(ints32, 0).astype(np.int32))


def allreduce_average_flag(mode):
    inputs = every("avgflag", (4,))
    got = run(lambda x: hvd.allreduce(x, average=False), mode, jnp.asarray(inputs[RANK]))
    same(got, np.sum(inputs, 0).astype(np.float32))
    got = run(lambda x: hvd.allreduce(x), mode, jnp.asarray(inputs[RANK]))   # default Average
    same(got, (np.sum(inputs, 0) / SIZE).astype(np.float32), exact=False)


def grouped_allreduce(mode):
    a = every("ga.a", (2, 3))
    b = every("ga.b", (4,), np.int32)
    c = every("ga.c", (), ml_dtypes.bfloat16)
    got = run(lambda x, y, z: hvd.grouped_allreduce([x, y, z], op=hvd.Sum), mode,
              jnp.asarray(a[RANK]), jnp.asarray(b[RANK]), jnp.asarray(c[RANK]))
    assert isinstance(got, list) and len(got) == 3
    for g, inputs, dt in zip(got, (a, b, c), (np.float32, np.int32, ml_dtypes.bfloat16)):
        same(g, reduce_ref(inputs, "Sum", dt))


def allgather_case(mode):
    for dt in (np.float32, np.int32, np.bool_):
        inputs = every(f"ag.{np.dtype(dt).name}", (2, 3), dt)
        got = run(hvd.allgather, mode, jnp.asarray(inputs[RANK]))
        same(got, np.concatenate(inputs))
    scalars = every("ag.scalar", ())
    same(run(hvd.allgather, mode, jnp.asarray(scalars[RANK])), np.stack(scalars))


def allgather_uneven_eager():
    inputs = [ints("agu", q, (q + 1, 2)) for q in range(SIZE)]
    same(hvd.allgather(jnp.asarray(inputs[RANK])), np.concatenate(inputs))
    zero = [ints("agz", q, (0 if q == 1 else 2, 3), np.int32) for q in range(SIZE)]
    same(hvd.allgather(jnp.asarray(zero[RANK])), np.concatenate(zero))


def grouped_allgather(mode):
    a = every("gag.a", (2, 3))
    b = every("gag.b", (), np.int32)
    got = run(lambda x, y: hvd.grouped_allgather([x, y]), mode, jnp.asarray(a[RANK]),
              jnp.asarray(b[RANK]))
    same(got[0], np.concatenate(a))
    same(got[1], np.stack(b))


def broadcast_case(mode):
    for root in range(SIZE):
        for dt in (np.float32, np.int8, np.bool_):
            inputs = every(f"bc.{root}.{np.dtype(dt).name}", (3, 2), dt)
            got = run(lambda x: hvd.broadcast(x, root), mode, jnp.asarray(inputs[RANK]))
            same(got, inputs[root])


def alltoall_case(mode):
    inputs = every("a2a", (2 * SIZE, 3))
    got = run(hvd.alltoall, mode, jnp.asarray(inputs[RANK]))
    same(got, np.concatenate([x[2 * RANK:2 * RANK + 2] for x in inputs]))
    got, received = run(lambda x: hvd.alltoall(x, splits=[1] * SIZE), mode,
                        jnp.asarray(inputs[RANK][:SIZE]))
    same(got, np.stack([x[RANK] for x in inputs]))
    same(received, np.ones(SIZE, np.int32))


def uneven_splits():
    return [[0] * SIZE] + [[(q + 2 * j) % 3 for j in range(SIZE)] for q in range(1, SIZE)]


def alltoall_splits_eager():
    splits = uneven_splits()
    inputs = [ints("a2as", q, (sum(splits[q]), 2)) for q in range(SIZE)]
    got, received = hvd.alltoall(jnp.asarray(inputs[RANK]), splits=splits[RANK])
    want = np.concatenate([x[offsets(splits[q])[RANK]:offsets(splits[q])[RANK + 1]]
                           for q, x in enumerate(inputs)])
    same(got, want)
    same(received, np.array([splits[q][RANK] for q in range(SIZE)], np.int32))


def reducescatter_case(mode):
    rows = 2 * SIZE + 1
    mine = split_rows(rows, SIZE)
    lo, hi = offsets(mine)[RANK], offsets(mine)[RANK + 1]
    for op in ("Sum", "Max", "Average"):
        inputs = every(f"rs.{op}", (rows, 2))
        got = run(lambda x: hvd.reducescatter(x, op=getattr(hvd, op)), mode,
                  jnp.asarray(inputs[RANK]))
        same(got, reduce_ref(inputs, op, np.float32)[lo:hi], exact=op != "Average")


def grouped_reducescatter(mode):
    a = every("grs.a", (5, 2))
    b = every("grs.b", (3,), np.int32)
    got = run(lambda x, y: hvd.grouped_reducescatter([x, y], op=hvd.Sum), mode,
              jnp.asarray(a[RANK]), jnp.asarray(b[RANK]))
    for g, inputs, dt in zip(got, (a, b), (np.float32, np.int32)):
        counts = split_rows(inputs[0].shape[0], SIZE)
        o = offsets(counts)
        same(g, reduce_ref(inputs, "Sum", dt)[o[RANK]:o[RANK + 1]])


def process_set_case(mode):
    ps = EVEN if RANK % 2 == 0 else ODD
    inputs = {q: ints("ps", q, (3,)) for q in ps.ranks}
    got = run(lambda x: hvd.allreduce(x, op=hvd.Sum, process_set=ps), mode,
              jnp.asarray(inputs[RANK]))
    same(got, np.sum([inputs[q] for q in ps.ranks], 0).astype(np.float32))
    root = ps.ranks[-1]
    got = run(lambda x: hvd.broadcast(x, root, process_set=ps), mode, jnp.asarray(inputs[RANK]))
    same(got, inputs[root])
    got = run(lambda x: hvd.allgather(x, process_set=ps), mode, jnp.asarray(inputs[RANK]))
    same(got, np.concatenate([inputs[q] for q in ps.ranks]))


def broadcast_parameters_case(mode):
    root = SIZE - 1

    def tree(q):
        params = {"w": ints("bp.w", q, (3, 2)), "b": [ints("bp.b", q, (2,), np.int32),
                                                      ints("bp.s", q, ())]}
        return {"params": params, "opt": optax.adam(1e-3).init(params)}

    mine, want = tree(RANK), tree(root)
    mine["opt"] = jax.tree_util.tree_map(lambda x: x + RANK, mine["opt"])
    want["opt"] = jax.tree_util.tree_map(lambda x: x + root, want["opt"])
    mine = jax.tree_util.tree_map(jnp.asarray, mine)
    got = run(lambda t: hvd.broadcast_parameters(t, root), mode, mine)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(mine)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        same(g, np.asarray(w))
    if mode == "eager":
        got = hvd.broadcast_parameters({"a": jnp.asarray(float(RANK)), "lr": 0.1 * RANK}, root)
        assert float(got["a"]) == root and got["lr"] == 0.1 * root, got


def pytree_case(mode):
    def tree(q):
        return {"w": ints("pt.w", q, (2, 3)), "b": [ints("pt.b", q, (4,), np.int32),
                                                    ints("pt.s", q, ())]}

    trees = [tree(q) for q in range(SIZE)]
    mine = jax.tree_util.tree_map(jnp.asarray, trees[RANK])
    flat = [jax.tree_util.tree_leaves(t) for t in trees]
    got = run(lambda t: hvd.allreduce(t, op=hvd.Sum), mode, mine)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(mine)
    for i, g in enumerate(jax.tree_util.tree_leaves(got)):
        same(g, reduce_ref([f[i] for f in flat], "Sum", flat[0][i].dtype))
    got = run(lambda t: hvd.allgather(t), mode, mine)
    for i, g in enumerate(jax.tree_util.tree_leaves(got)):
        same(g, np.concatenate([np.atleast_1d(f[i]) for f in flat]))
    got = run(lambda t: hvd.broadcast(t, SIZE - 1), mode, mine)
    for i, g in enumerate(jax.tree_util.tree_leaves(got)):
        same(g, flat[SIZE - 1][i])


# --- gradients ---------------------------------------------------------------------------------
def grad_fn(loss, mode):
    g = jax.grad(loss)
    return jax.jit(g) if mode == "jit" else g


def grad_allreduce(mode):
    x = every("gr.ar.x", (4,))
    w = every("gr.ar.w", (4,))
    for op, pre, post in (("Sum", 0.5, 2.0), ("Average", 1.0, 1.0), ("Average", 2.0, 0.25)):
        g = grad_fn(lambda v: jnp.sum(hvd.allreduce(v, op=getattr(hvd, op), prescale_factor=pre,
                                                    postscale_factor=post) * w[RANK]), mode)
        got = g(jnp.asarray(x[RANK]))
        total = np.sum(w, 0) * pre * post
        same(got, (total if op == "Sum" else total / SIZE).astype(np.float32), exact=False)


def grad_allgather(mode):
    rows = [2] * SIZE if mode == "jit" else [q + 1 for q in range(SIZE)]
    x = [ints("gr.ag.x", q, (rows[q], 3)) for q in range(SIZE)]
    w = every("gr.ag.w", (sum(rows), 3))
    got = grad_fn(lambda v: jnp.sum(hvd.allgather(v) * w[RANK]), mode)(jnp.asarray(x[RANK]))
    o = offsets(rows)
    same(got, (np.mean(w, 0)[o[RANK]:o[RANK + 1]]).astype(np.float32), exact=False)
    s = every("gr.ag.s", ())
    ws = every("gr.ag.ws", (SIZE,))
    got = grad_fn(lambda v: jnp.sum(hvd.allgather(v) * ws[RANK]), mode)(jnp.asarray(s[RANK]))
    same(got, np.float32(np.mean(ws, 0)[RANK]), exact=False)


def grad_broadcast(mode):
    x = every("gr.bc.x", (3,))
    w = every("gr.bc.w", (3,))
    for root in range(SIZE):
        got = grad_fn(lambda v: jnp.sum(hvd.broadcast(v, root) * w[RANK]), mode)(
            jnp.asarray(x[RANK]))
        want = np.mean(w, 0) if RANK == root else np.zeros(3)
        same(got, want.astype(np.float32), exact=False)


def grad_alltoall(mode):
    splits = [[2] * SIZE] * SIZE if mode == "jit" else uneven_splits()
    x = [ints("gr.a2a.x", q, (sum(splits[q]), 2)) for q in range(SIZE)]
    received = [[splits[q][j] for q in range(SIZE)] for j in range(SIZE)]
    w = [ints("gr.a2a.w", j, (sum(received[j]), 2)) for j in range(SIZE)]
    s = None if mode == "jit" else splits[RANK]

    def loss(v):
        out = hvd.alltoall(v, splits=s)
        out = out if s is None else out[0]
        return jnp.sum(out * w[RANK])

    got = grad_fn(loss, mode)(jnp.asarray(x[RANK]))
    parts = []
    for j in range(SIZE):   # my rows sent to j get j's gradient rows for what came from me
        start = sum(splits[q][j] for q in range(RANK))
        parts.append(w[j][start:start + splits[RANK][j]])
    same(got, np.concatenate(parts).astype(np.float32))


def grad_reducescatter(mode):
    rows = 2 * SIZE + 1
    counts = split_rows(rows, SIZE)
    x = every("gr.rs.x", (rows, 2))
    w = [ints("gr.rs.w", q, (counts[q], 2)) for q in range(SIZE)]
    for op, pre, post in (("Sum", 1.0, 1.0), ("Average", 0.5, 3.0)):
        got = grad_fn(lambda v: jnp.sum(hvd.reducescatter(
            v, op=getattr(hvd, op), prescale_factor=pre, postscale_factor=post) * w[RANK]),
            mode)(jnp.asarray(x[RANK]))
        factor = pre * post * (SIZE if op == "Sum" else 1)
        same(got, (np.concatenate(w) * factor).astype(np.float32))


def grad_grouped(mode):
    a, b = every("gr.g.a", (3,)), every("gr.g.b", (2, 2))
    wa, wb = every("gr.g.wa", (3,)), every("gr.g.wb", (2, 2))
    n = every("gr.g.n", (2,), np.int32)

    def loss(u, v, k):
        ra, rb, rk = hvd.grouped_allreduce([u, v, k], op=hvd.Average)
        return jnp.sum(ra * wa[RANK]) + jnp.sum(rb * wb[RANK]) + jnp.sum(rk) * 0

    g = jax.grad(loss, argnums=(0, 1))
    g = jax.jit(g) if mode == "jit" else g
    ga, gb = g(jnp.asarray(a[RANK]), jnp.asarray(b[RANK]), jnp.asarray(n[RANK]))
    same(ga, np.mean(wa, 0).astype(np.float32), exact=False)
    same(gb, np.mean(wb, 0).astype(np.float32), exact=False)
    rows = 2 * SIZE
    counts = split_rows(rows, SIZE)
    c = every("gr.g.c", (rows,))
    wc = [ints("gr.g.wc", q, (counts[q],)) for q in range(SIZE)]
    got = grad_fn(lambda u: jnp.sum(hvd.grouped_reducescatter([u, u * 2], op=hvd.Sum)[1]
                                    * wc[RANK]), mode)(jnp.asarray(c[RANK]))
    same(got, (np.concatenate(wc) * SIZE * 2).astype(np.float32))
    gg = grad_fn(lambda u: jnp.sum(hvd.grouped_allgather([u, u])[0] * wa[0].sum()), mode)(
        jnp.asarray(a[RANK]))
    same(gg, np.full(3, wa[0].sum(), np.float32))


def grad_min_raises(mode):
    x = jnp.asarray(ints("gr.min", RANK, (3,)))
    expect_raises(hvd.UnsupportedOperationError,
                  lambda: grad_fn(lambda v: jnp.sum(hvd.allreduce(v, op=hvd.Min)), mode)(x),
                  "Min")


# --- mismatches and ordering in jit -------------------------------------------------------------
def check_every_rank_raised(exc, cls, *needles):
    assert isinstance(exc, jax.errors.JaxRuntimeError), type(exc)
    original = hvd.original_error(exc)
    assert isinstance(original, cls), (type(original), str(exc)[-600:])
    for needle in needles:
        assert needle in str(exc), f"{needle!r} not in {str(exc)[-600:]}"


def still_working():
    got = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum))(jnp.ones(2))
    same(got, np.full(2, SIZE, np.float32))


def mismatch_shape_in_jit():
    x = jnp.ones((3,) if RANK == 0 else (4,))
    exc = expect_raises(jax.errors.JaxRuntimeError,
                        lambda: jax.jit(hvd.allreduce)(x).block_until_ready(),
                        "TensorMismatchError")
    check_every_rank_raised(exc, hvd.TensorMismatchError, "allreduce.jax.")
    still_working()


def mismatch_dtype_in_jit():
    x = jnp.ones(3, jnp.float32 if RANK == 0 else jnp.int32)
    exc = expect_raises(jax.errors.JaxRuntimeError,
                        lambda: jax.jit(lambda t: hvd.broadcast(t, 0))(x).block_until_ready())
    check_every_rank_raised(exc, hvd.TensorMismatchError)
    still_working()


def mismatch_allgather_rows_in_jit():
    x = jnp.ones((1 if RANK == 0 else 2, 2))
    exc = expect_raises(jax.errors.JaxRuntimeError,
                        lambda: jax.jit(hvd.allgather)(x).block_until_ready())
    check_every_rank_raised(exc, hvd.TensorMismatchError, "same number of rows")
    still_working()


def mismatch_eager():
    x = jnp.ones((3,) if RANK == 0 else (4,))
    expect_raises(hvd.TensorMismatchError, lambda: hvd.allreduce(x, name="eager.mismatch"))
    expect_raises(hvd.TensorMismatchError, lambda: hvd.allreduce(x))
    same(hvd.allreduce(jnp.ones(2), op=hvd.Sum), np.full(2, SIZE, np.float32))


def eager_failure_announced():
    """An unnamed eager op that fails its checks on rank 0 only: the others get
    FailedOnRankError naming rank 0 (no hang), and later unnamed ops stay paired."""
    if RANK == 0:
        expect_raises(ValueError, lambda: hvd.allreduce(jnp.ones(2), average=True, op=hvd.Sum),
                      "supersedes")
    else:
        expect_raises(hvd.FailedOnRankError, lambda: hvd.allreduce(jnp.ones(2)), "rank 0")
    same(hvd.allreduce(jnp.full(2, float(RANK)), op=hvd.Sum),
         np.full(2, float(sum(range(SIZE))), np.float32))


def independent_in_order():
    a, b = every("ind.a", (4,)), every("ind.b", (2,), np.int32)

    @jax.jit
    def f(x, y):
        return (hvd.allreduce(x, op=hvd.Sum), hvd.broadcast(y, SIZE - 1),
                hvd.allreduce(y, op=hvd.Max), hvd.allgather(x), hvd.allreduce(x * 2, op=hvd.Sum))

    for _ in range(3):
        s, bc, mx, ag, s2 = f(jnp.asarray(a[RANK]), jnp.asarray(b[RANK]))
        same(s, np.sum(a, 0).astype(np.float32))
        same(bc, b[SIZE - 1])
        same(mx, np.max(b, 0).astype(np.int32))
        same(ag, np.concatenate(a))
        same(s2, (2 * np.sum(a, 0)).astype(np.float32))


def retrace_on_one_rank():
    def fn(x):
        return hvd.allreduce(x, op=hvd.Sum) + hvd.allreduce(x * 3, op=hvd.Sum)

    cached = jax.jit(fn)
    x = jnp.arange(3.0) + RANK
    want = (np.arange(3.0) * SIZE + sum(range(SIZE))) * 4
    for i in range(3):
        if RANK == 0:   # rank 0 traces afresh every time (and traces one more it never runs)
            jax.jit(fn).lower(x)
            got = jax.jit(fn)(x)
        else:
            got = cached(x)
        same(got, want.astype(np.float32))


def eager_and_jit_interleaved():
    f = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum))
    pending = []
    for i in range(6):
        pending.append((i, f(jnp.full(3, float(RANK + i)))))            # dispatched, async
        eager = hvd.allreduce(jnp.full(2, float(RANK * i)), op=hvd.Sum)  # unnamed, eager
        same(eager, np.full(2, float(sum(q * i for q in range(SIZE))), np.float32))
    for i, got in pending:
        same(got, np.full(3, float(sum(q + i for q in range(SIZE))), np.float32))


def named_repeated():
    f = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum, name="jax.test.named"))
    for i in range(3):
        same(f(jnp.full(2, float(i + RANK))), np.full(2, float(sum(i + q for q in range(SIZE))),
                                                      np.float32))


def cond_and_scan():
    @jax.jit
    def f(x, pred):
        y = jax.lax.cond(pred, lambda v: hvd.allreduce(v, op=hvd.Sum),
                         lambda v: hvd.allreduce(v, op=hvd.Max), x)

        def body(carry, _):
            return hvd.allreduce(carry, op=hvd.Sum), carry.sum()

        z, sums = jax.lax.scan(body, x, None, length=3)
        return y, z, sums

    x = jnp.full(2, float(RANK + 1))
    total = float(sum(q + 1 for q in range(SIZE)))
    for pred in (True, False):
        y, z, sums = f(x, pred)
        same(y, np.full(2, total if pred else float(SIZE), np.float32))
        same(z, np.full(2, total * SIZE ** 2, np.float32))


def not_a_member_at_trace():
    if RANK in EVEN.ranks:
        return
    expect_raises(ValueError, lambda: jax.jit(lambda x: hvd.allreduce(x, process_set=EVEN))(
        jnp.ones(2)))


# --- optimizer ---------------------------------------------------------------------------------
def mlp_init():
    k = rng("mlp")
    return {"w1": (k.standard_normal((4, 8)) * 0.5).astype(np.float32),
            "b1": np.zeros(8, np.float32),
            "w2": (k.standard_normal((8, 3)) * 0.5).astype(np.float32),
            "b2": np.zeros(3, np.float32)}


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


GRAD = jax.jit(jax.grad(loss_fn))   # compiled once for every case and the references


def batch(step, q):
    g = rng("batch", step, q)
    return g.standard_normal((6, 4)).astype(np.float32), g.integers(0, 3, size=6)


def identical_across_ranks(params, process_set=None):
    flat = np.concatenate([np.asarray(v).reshape(-1).view(np.uint32)
                           for v in jax.tree_util.tree_leaves(params)])
    everyone = hvd.allgather_object(flat.tobytes(), process_set=process_set or
                                    hvd.global_process_set)
    assert all(b == everyone[0] for b in everyone), "parameters differ across ranks"


def train(mode, inner, steps, members=None, **kwargs):
    """Train with DistributedOptimizer and with a one-process reference; compare."""
    ps = kwargs.get("process_set")
    opt = hvd.DistributedOptimizer(inner, **kwargs)
    params = hvd.broadcast_parameters(jax.tree_util.tree_map(jnp.asarray, mlp_init()), 0)
    state = opt.init(params)

    def update(g, p, s):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    if mode == "jit":
        step = jax.jit(lambda p, s, x, y: update(jax.grad(loss_fn)(p, x, y), p, s))
    else:   # the gradients from the compiled function, the optimizer's update eagerly
        def step(p, s, x, y):
            return update(GRAD(p, x, y), p, s)
    ref_params = jax.tree_util.tree_map(jnp.asarray, mlp_init())
    ref_state = inner.init(ref_params)
    passes = kwargs.get("backward_passes_per_step", 1)
    acc = None
    group = members if members is not None else list(range(SIZE))
    for i in range(steps):
        params, state = step(params, state, *map(jnp.asarray, batch(i, RANK)))
        if ps is None:
            identical_across_ranks(params)
        elif RANK in ps.ranks:
            identical_across_ranks(params, ps)
        grads = [GRAD(ref_params, *map(jnp.asarray, batch(i, q))) for q in group]
        g = jax.tree_util.tree_map(lambda *gs: sum(gs) / len(gs), *grads)
        acc = g if acc is None else jax.tree_util.tree_map(jnp.add, acc, g)
        if (i + 1) % passes == 0:
            updates, ref_state = inner.update(acc, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, updates)
            acc = None
        for got, want in zip(jax.tree_util.tree_leaves(params),
                             jax.tree_util.tree_leaves(ref_params)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                                       rtol=kwargs.pop("_rtol", 2e-5),
                                       atol=5e-3 if "compression" in kwargs else 2e-6)


def optimizer_sgd(mode):
    train(mode, optax.sgd(0.1, momentum=0.9), 3)


def optimizer_adam_bpps2(mode):
    train(mode, optax.adam(1e-2), 4, backward_passes_per_step=2)


def optimizer_fp16(mode):
    train(mode, optax.sgd(0.1), 3, compression=hvd.Compression.fp16)


def optimizer_process_set(mode):
    members = EVEN.ranks if RANK in EVEN.ranks else [RANK]
    train(mode, optax.sgd(0.1), 2, members=members, process_set=EVEN)


def powersgd_refused():
    expect_raises(NotImplementedError, lambda: hvd.Compression.powersgd(rank=1), "fp16")


# --- elastic, timeline -------------------------------------------------------------------------
def elastic_state():
    params = {"w": jnp.full(3, float(RANK)), "b": [jnp.zeros(2)]}
    opt_state = optax.sgd(0.1, momentum=0.9).init(params)
    state = hvd.elastic.JaxState(params=params, opt_state=opt_state, epoch=RANK)
    state.params = {"w": jnp.full(3, 7.0), "b": [jnp.ones(2)]}
    state.epoch = 9
    state.restore()
    same(state.params["w"], np.full(3, float(RANK), np.float32))
    assert state.epoch == RANK
    state.params = {"w": jnp.full(3, 5.0 + RANK), "b": [jnp.ones(2)]}
    state.commit()
    state.params = {"w": jnp.zeros(3), "b": [jnp.zeros(2)]}
    state.restore()
    same(state.params["w"], np.full(3, 5.0 + RANK, np.float32))
    state.sync()
    same(state.params["w"], np.full(3, 5.0, np.float32))
    assert state.epoch == 0
    committed = state.committed_state()
    other = hvd.elastic.JaxState(params={"w": jnp.zeros(3), "b": [jnp.zeros(2)]},
                                 opt_state=opt_state, epoch=-1)
    other.load_committed_state(committed)   # the last commit: saved before the sync
    same(other.params["w"], np.full(3, 5.0 + RANK, np.float32))
    assert other.epoch == 0


def elastic_run_without_driver():
    state = hvd.elastic.JaxState(params={"w": jnp.full(2, float(RANK + 3))}, step=RANK)

    @hvd.elastic.run
    def train_fn(s):
        return s.params["w"], s.step

    w, step = train_fn(state)
    same(w, np.full(2, 3.0, np.float32))
    assert step == 0


def timeline_case():
    path = os.path.join(os.environ["HVDLITE_TEST_OUT"], "jax_timeline.json")
    hvd.start_timeline(path)
    jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum))(jnp.ones(2)).block_until_ready()
    hvd.allreduce(jnp.ones(2), name="jax.timeline.eager")
    hvd.barrier()
    hvd.stop_timeline()
    if RANK == 0:
        text = open(path).read()
        assert "allreduce.jax." in text and "jax.timeline.eager" in text, text[:500]


# --- run -----------------------------------------------------------------------------------------
PER_MODE = {"allreduce.scaled": allreduce_scaled, "allreduce.compressed": allreduce_compressed,
            "allreduce.average_flag": allreduce_average_flag,
            "grouped_allreduce": grouped_allreduce, "allgather": allgather_case,
            "grouped_allgather": grouped_allgather, "broadcast": broadcast_case,
            "alltoall": alltoall_case, "reducescatter": reducescatter_case,
            "grouped_reducescatter": grouped_reducescatter, "process_set": process_set_case,
            "broadcast_parameters": broadcast_parameters_case, "pytree": pytree_case,
            "grad.allreduce": grad_allreduce, "grad.allgather": grad_allgather,
            "grad.broadcast": grad_broadcast, "grad.alltoall": grad_alltoall,
            "grad.reducescatter": grad_reducescatter, "grad.grouped": grad_grouped,
            "grad.min_raises": grad_min_raises,
            "optimizer.sgd": optimizer_sgd, "optimizer.adam_bpps2": optimizer_adam_bpps2,
            "optimizer.fp16": optimizer_fp16, "optimizer.process_set": optimizer_process_set}
SINGLE = {"allgather.uneven_eager": allgather_uneven_eager,
          "alltoall.splits_eager": alltoall_splits_eager,
          "mismatch.shape_in_jit": mismatch_shape_in_jit,
          "mismatch.dtype_in_jit": mismatch_dtype_in_jit,
          "mismatch.allgather_rows_in_jit": mismatch_allgather_rows_in_jit,
          "mismatch.eager": mismatch_eager,
          "mismatch.eager_failure_announced": eager_failure_announced,
          "jit.independent_collectives_in_order": independent_in_order,
          "jit.retrace_on_one_rank": retrace_on_one_rank,
          "jit.eager_and_jit_interleaved": eager_and_jit_interleaved,
          "jit.named_repeated": named_repeated, "jit.cond_and_scan": cond_and_scan,
          "jit.not_a_member_raises_at_trace": not_a_member_at_trace,
          "optimizer.powersgd_refused": powersgd_refused,
          "elastic.state": elastic_state, "elastic.run_without_driver": elastic_run_without_driver,
          "timeline.records_jit_collectives": timeline_case}

only = set(sys.argv[1:])
TIMES = os.environ.get("JAX_WORKER_TIMES")
for case in CASES:
    started = time.perf_counter()
    if only and not any(case.startswith(o) for o in only):
        continue
    name, _, mode = case.rpartition(".")
    if mode in MODES and name.startswith("allreduce.") and name.split(".")[1] in OPS:
        _, op, dt = name.split(".")
        assert dt in DTYPES
        r.case(case, allreduce_case, mode, op, dt)
    elif mode in MODES and name in PER_MODE:
        r.case(case, PER_MODE[name], mode)
    else:
        r.case(case, SINGLE[case])
    if TIMES and RANK == 0:
        print(f"{time.perf_counter() - started:7.3f} s {case}", flush=True)
r.write()
