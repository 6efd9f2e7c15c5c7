"""hvdlite.tensorflow against Horovod's TensorFlow semantics, in TF1 sessions, tf.function and
eagerly (issue 33): gradients of every differentiable collective, tf.IndexedSlices, error
classes, TF1-graph behaviour (in-place broadcast, broadcast after the training op, the TF1
optimizer) and process-set non-members.

Every expected number is written down from Horovod's definitions (horovod/tensorflow/mpi_ops.py
and __init__.py), from every rank's deterministic input; see each case.  Loss of rank q is
``sum(output * W_q)``, so the upstream gradient of rank q's output is ``W_q``.  Case names are
listed in tests/tensorflow/workers/tf_fidelity_cases.py; the graph modes run before eager.
"""
import os
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

from mpi4py import MPI  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.keras as hvdk  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402
from tf_fidelity_cases import (CASES, GRAPH_BUILD_MODES, GRAD_CASES, MODES,  # noqa: E402
                               SPARSE_CASES)

_world = MPI.COMM_WORLD.Get_size()
EVEN = hvd.ProcessSet([q for q in range(_world) if q % 2 == 0])
ODD = hvd.ProcessSet([q for q in range(_world) if q % 2 == 1])
hvd.init(process_sets=[EVEN, ODD])
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)


# --- helpers -----------------------------------------------------------------------------------
def rng(*parts):
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def ints(case, q, shape, dtype=np.float64):
    """Rank ``q``'s input for ``case``: small integers (exact in every dtype used here)."""
    return rng(case, q, shape).integers(-4, 5, size=shape).astype(dtype)


def offsets(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(int)


def split_rows(rows, parts):
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def my_set():
    return EVEN if RANK % 2 == 0 else ODD


def numpy_of(x):
    if hasattr(x, "indices") and hasattr(x, "values"):   # IndexedSlices (or a session's value)
        return (np.asarray(numpy_of(x.values)), np.asarray(numpy_of(x.indices)))
    if isinstance(x, (list, tuple)):
        return [numpy_of(v) for v in x]
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def session_run(build, runs=1):
    """Build a TF1 graph with ``build() -> fetches`` and run it ``runs`` times in a session;
    returns the last result (numpy)."""
    graph = tf.Graph()
    with graph.as_default():
        fetches = build()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            results = [sess.run(fetches) for _ in range(runs)]
    for other in results[1:]:   # a TF1 graph reruns identically
        np.testing.assert_equal(numpy_of(other), numpy_of(results[0]))
    return numpy_of(results[-1])


def run(mode, fn, *values):
    """``fn(*tensors)`` (no gradient) in ``mode`` (session, graph or eager); numpy results."""
    if mode == "session":
        return session_run(lambda: fn(*[tf.constant(v) for v in values]), runs=2)
    tensors = [tf.constant(v) for v in values]
    return numpy_of(tf.function(fn)(*tensors) if mode == "graph" else fn(*tensors))


def gradients(mode, loss_fn, *values):
    """(d loss / d inputs, forward outputs) of ``loss_fn(*tensors) -> (loss, [outputs])`` in
    ``mode``: session (tf.compat.v1.gradients), outer (forward in tf.function, tape outside),
    graph (tape inside tf.function) or eager."""
    if mode == "session":
        def build():
            xs = [tf.constant(v) for v in values]
            loss, outs = loss_fn(*xs)
            return tf.compat.v1.gradients(loss, xs), outs
        grads, outs = session_run(build, runs=2)
        return grads, outs
    xs = [tf.constant(v) for v in values]

    def taped(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss, outs = loss_fn(*xs)
        return tape.gradient(loss, list(xs)), outs

    if mode == "outer":
        forward = tf.function(loss_fn)
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss, outs = forward(*xs)
        return numpy_of(tape.gradient(loss, xs)), numpy_of(outs)
    grads, outs = tf.function(taped)(*xs) if mode == "graph" else taped(*xs)
    return numpy_of(grads), numpy_of(outs)


def raises(classes, fn, *needles):
    """``fn()`` raises an instance of every class in ``classes``; returns it."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - checked below
        for cls in classes:
            assert isinstance(exc, cls), f"{type(exc).__mro__} is not a {cls.__name__}: {exc}"
        message = exc.message if isinstance(exc, tf.errors.OpError) else str(exc)
        for needle in needles:
            assert needle in message, f"{needle!r} not in {message}"
        return exc
    raise AssertionError(f"{[c.__name__ for c in classes]} not raised")


def close(got, want, what=""):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0, err_msg=what)


# --- gradients (item 1, item 9) ----------------------------------------------------------------
def weights(case, shape_of_rank, dtype=np.float64):
    return [ints(case + ".w", q, shape_of_rank(q), dtype) for q in range(SIZE)]


def grad_allreduce(mode):
    """Horovod: the gradient of allreduce is the same allreduce (op, prescale, postscale) of
    the upstream gradients."""
    settings = [(hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 2.0, 0.5),
                (hvd.Average, 0.5, 3.0)]
    xs = [[ints(f"ar.x{k}", q, (3,)) for k in range(len(settings))] for q in range(SIZE)]
    ws = [[ints(f"ar.w{k}", q, (3,)) for k in range(len(settings))] for q in range(SIZE)]

    def loss_fn(*x):
        outs = [hvd.allreduce(t, op=op, prescale_factor=pre, postscale_factor=post)
                for t, (op, pre, post) in zip(x, settings)]
        return tf.add_n([tf.reduce_sum(o * w) for o, w in zip(outs, ws[RANK])]), outs

    grads, outs = gradients(mode, loss_fn, *xs[RANK])
    for k, (op, pre, post) in enumerate(settings):
        div = SIZE if op == hvd.Average else 1
        close(outs[k], post * np.sum([pre * x[k] for x in xs], 0) / div, f"forward {k}")
        close(grads[k], pre * post * np.sum([w[k] for w in ws], 0) / div, f"grad {k}")


def grad_grouped_allreduce(mode):
    xs = [[ints("gar.a", q, (3,)), ints("gar.b", q, (2, 2))] for q in range(SIZE)]
    ws = [[ints("gar.wa", q, (3,)), ints("gar.wb", q, (2, 2))] for q in range(SIZE)]

    def loss_fn(a, b):
        s = hvd.grouped_allreduce([a, b], op=hvd.Sum, prescale_factor=2.0)
        m = hvd.grouped_allreduce([a, b], op=hvd.Average, postscale_factor=0.5)
        outs = s + m
        loss = tf.add_n([tf.reduce_sum(o * w) for o, w in zip(outs, ws[RANK] * 2)])
        return loss, outs

    grads, _ = gradients(mode, loss_fn, *xs[RANK])
    for k in range(2):
        wsum = np.sum([w[k] for w in ws], 0)
        close(grads[k], 2.0 * wsum + 0.5 * wsum / SIZE, f"tensor {k}")


def grad_allgather(mode):
    """Horovod: allreduce Average of the upstream gradient, then this rank's rows."""
    rows = [q + 1 for q in range(SIZE)]
    total = sum(rows)
    xs = [ints("ag.x", q, (rows[q], 2)) for q in range(SIZE)]
    ws = weights("ag", lambda q: (total, 2))

    def loss_fn(x):
        out = hvd.allgather(x)
        return tf.reduce_sum(out * ws[RANK]), [out]

    grads, outs = gradients(mode, loss_fn, xs[RANK])
    close(outs[0], np.concatenate(xs))
    off = offsets(rows)
    close(grads[0], (np.sum(ws, 0) / SIZE)[off[RANK]:off[RANK + 1]])


def grad_grouped_allgather(mode):
    rows = [q + 1 for q in range(SIZE)]
    xa = [ints("gag.a", q, (rows[q], 2)) for q in range(SIZE)]
    xb = [ints("gag.b", q, (2,), np.float32) for q in range(SIZE)]
    wa = weights("gag.a", lambda q: (sum(rows), 2))
    wb = weights("gag.b", lambda q: (2 * SIZE,), np.float32)

    def loss_fn(a, b):
        ga, gb = hvd.grouped_allgather([a, b])
        loss = tf.reduce_sum(ga * wa[RANK]) + tf.cast(tf.reduce_sum(gb * wb[RANK]), tf.float64)
        return loss, [ga, gb]

    (da, db), _ = gradients(mode, loss_fn, xa[RANK], xb[RANK])
    off = offsets(rows)
    close(da, (np.sum(wa, 0) / SIZE)[off[RANK]:off[RANK + 1]])
    np.testing.assert_allclose(db, (np.sum(wb, 0) / SIZE)[2 * RANK:2 * RANK + 2], rtol=1e-6)


def grad_broadcast(mode):
    """Horovod: allreduce Average of the upstream gradient on the root, that times 0 on the
    other ranks."""
    xs = [[ints(f"bc.x{root}", q, (4,)) for root in range(SIZE)] for q in range(SIZE)]
    ws = [[ints(f"bc.w{root}", q, (4,)) for root in range(SIZE)] for q in range(SIZE)]

    def loss_fn(*x):
        outs = [hvd.broadcast(t, root) for root, t in enumerate(x)]
        return tf.add_n([tf.reduce_sum(o * w) for o, w in zip(outs, ws[RANK])]), outs

    grads, outs = gradients(mode, loss_fn, *xs[RANK])
    for root in range(SIZE):
        close(outs[root], xs[root][root], f"forward root {root}")
        want = np.sum([w[root] for w in ws], 0) / SIZE if RANK == root else np.zeros(4)
        close(grads[root], want, f"root {root}")


def grad_reducescatter(mode):
    """Horovod: allgather of the upstream gradient times the set's size for Sum, times
    prescale_factor and postscale_factor (no division for Average)."""
    rows = 2 * SIZE + 1
    counts = split_rows(rows, SIZE)
    off = offsets(counts)
    settings = [(hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 2.0, 0.5),
                (hvd.Average, 3.0, 0.25)]
    xs = [[ints(f"rs.x{k}", q, (rows, 2)) for k in range(len(settings))] for q in range(SIZE)]
    ws = [[ints(f"rs.w{k}", q, (counts[q], 2)) for k in range(len(settings))]
          for q in range(SIZE)]

    def loss_fn(*x):
        outs = [hvd.reducescatter(t, op=op, prescale_factor=pre, postscale_factor=post)
                for t, (op, pre, post) in zip(x, settings)]
        return tf.add_n([tf.reduce_sum(o * w) for o, w in zip(outs, ws[RANK])]), outs

    grads, outs = gradients(mode, loss_fn, *xs[RANK])
    for k, (op, pre, post) in enumerate(settings):
        total = post * np.sum([pre * x[k] for x in xs], 0) / (SIZE if op == hvd.Average else 1)
        close(outs[k], total[off[RANK]:off[RANK + 1]], f"forward {k}")
        factor = (SIZE if op == hvd.Sum else 1) * pre * post
        close(grads[k], np.concatenate([w[k] for w in ws]) * factor, f"grad {k}")


def grad_grouped_reducescatter(mode):
    rows = SIZE + 2
    counts = split_rows(rows, SIZE)
    xa = [ints("grs.a", q, (rows, 2)) for q in range(SIZE)]
    xb = [ints("grs.b", q, (rows,)) for q in range(SIZE)]
    wa = weights("grs.a", lambda q: (counts[q], 2))
    wb = weights("grs.b", lambda q: (counts[q],))

    def loss_fn(a, b):
        sa, sb = hvd.grouped_reducescatter([a, b], op=hvd.Sum, prescale_factor=2.0)
        ma, mb = hvd.grouped_reducescatter([a, b], op=hvd.Average, postscale_factor=0.5)
        loss = (tf.reduce_sum((sa + ma) * wa[RANK]) + tf.reduce_sum((sb + mb) * wb[RANK]))
        return loss, [sa, sb]

    (da, db), _ = gradients(mode, loss_fn, xa[RANK], xb[RANK])
    factor = SIZE * 2.0 + 0.5
    close(da, np.concatenate(wa) * factor)
    close(db, np.concatenate(wb) * factor)


def uneven_splits(size):
    """Rank 0 sends nothing; the others send (q + 2j) % 3 rows to rank j (some zero)."""
    return [[0] * size] + [[(q + 2 * j) % 3 for j in range(size)] for q in range(1, size)]


def alltoall_grad_ref(splits, ws, me, rows):
    """Horovod: alltoall of the output gradient with the received splits: block j of this
    rank's rows landed on rank j after the rows of lower ranks; rows not sent get zeros."""
    parts = []
    for j in range(len(splits)):
        before = sum(splits[p][j] for p in range(me))
        parts.append(ws[j][before:before + splits[me][j]])
    got = np.concatenate(parts)
    return np.concatenate([got, np.zeros((rows - got.shape[0],) + got.shape[1:])])


def _alltoall_case(mode, extra_rows):
    splits = uneven_splits(SIZE)
    rows = [sum(splits[q]) + extra_rows for q in range(SIZE)]
    xs = [ints(f"a2a{extra_rows}.x", q, (rows[q], 2)) for q in range(SIZE)]
    received = [sum(splits[p][q] for p in range(SIZE)) for q in range(SIZE)]
    ws = weights(f"a2a{extra_rows}", lambda q: (received[q], 2))

    def loss_fn(x):
        out, counts = hvd.alltoall(x, splits=splits[RANK])
        return tf.reduce_sum(out * ws[RANK]), [out, counts]

    grads, (out, counts) = gradients(mode, loss_fn, xs[RANK])
    want = np.concatenate([xs[q][offsets(splits[q])[RANK]:offsets(splits[q])[RANK + 1]]
                           for q in range(SIZE)])
    close(out, want, "forward")
    assert counts.tolist() == [splits[q][RANK] for q in range(SIZE)], counts
    close(grads[0], alltoall_grad_ref(splits, ws, RANK, rows[RANK]))


def grad_alltoall(mode):
    _alltoall_case(mode, 0)


def grad_alltoall_fewer_rows(mode):
    """Horovod sends only the first sum(splits) rows; the rest get a zero gradient."""
    _alltoall_case(mode, 2)


def grad_process_set(mode):
    """allgather, broadcast, reducescatter and alltoall on this rank's set (EVEN or ODD): the
    same rules, with the set's size and the rank's index in the set."""
    ps = my_set()
    members = ps.ranks
    n, me = len(members), members.index(RANK)
    rows = {q: members.index(q) + 1 for q in members}
    counts = split_rows(n + 1, n)
    root = members[-1]
    x = {q: ints("ps.x", q, (rows[q], 2)) for q in members}
    xb = {q: ints("ps.xb", q, (3,)) for q in members}
    xr = {q: ints("ps.xr", q, (n + 1, 2)) for q in members}
    xa = {q: ints("ps.xa", q, (2 * n, 2)) for q in members}
    wg = {q: ints("ps.wg", q, (sum(rows.values()), 2)) for q in members}
    wb = {q: ints("ps.wb", q, (3,)) for q in members}
    wr = {q: ints("ps.wr", q, (counts[members.index(q)], 2)) for q in members}
    wa = {q: ints("ps.wa", q, (2 * n, 2)) for q in members}

    def loss_fn(t, tb, tr, ta):
        g = hvd.allgather(t, process_set=ps)
        b = hvd.broadcast(tb, root, process_set=ps)
        rs = hvd.reducescatter(tr, op=hvd.Sum, process_set=ps)
        a = hvd.alltoall(ta, process_set=ps)
        loss = (tf.reduce_sum(g * wg[RANK]) + tf.reduce_sum(b * wb[RANK])
                + tf.reduce_sum(rs * wr[RANK]) + tf.reduce_sum(a * wa[RANK]))
        return loss, [g, b, rs, a]

    (dg, db, dr, da), (g, b, rs, a) = gradients(mode, loss_fn, x[RANK], xb[RANK], xr[RANK],
                                                xa[RANK])
    off = offsets([rows[q] for q in members])
    close(g, np.concatenate([x[q] for q in members]))
    close(dg, (np.sum([wg[q] for q in members], 0) / n)[off[me]:off[me + 1]], "allgather")
    close(b, xb[root])
    close(db, np.sum([wb[q] for q in members], 0) / n if RANK == root else np.zeros(3),
          "broadcast")
    roff = offsets(counts)
    close(rs, np.sum([xr[q] for q in members], 0)[roff[me]:roff[me + 1]])
    close(dr, np.concatenate([wr[q] for q in members]) * n, "reducescatter Sum")
    # even alltoall: block j of this rank's rows went to member j, landing at position me
    close(a, np.concatenate([xa[q][2 * me:2 * me + 2] for q in members]))
    close(da, np.concatenate([wa[q][2 * me:2 * me + 2] for q in members]), "alltoall")


GRAD_FUNCS = {"allreduce": grad_allreduce, "grouped_allreduce": grad_grouped_allreduce,
              "allgather": grad_allgather, "grouped_allgather": grad_grouped_allgather,
              "broadcast": grad_broadcast, "reducescatter": grad_reducescatter,
              "grouped_reducescatter": grad_grouped_reducescatter, "alltoall": grad_alltoall,
              "alltoall_fewer_rows": grad_alltoall_fewer_rows,
              "process_set": grad_process_set}


# --- tf.IndexedSlices (item 10) ----------------------------------------------------------------
def sparse_inputs(q):
    a = (ints("sp.a", q, (2, 2), np.int32), np.array([q % 3, (q + 1) % 3], np.int32))
    b = ints("sp.b", q, (3,), np.float32)
    c = (ints("sp.c", q, (1, 2), np.float32), np.array([q % 4], np.int64))
    d = ints("sp.d", q, (2, 2))
    return a, b, c, d


def sparse_grouped_mixed_average(mode):
    """grouped_allreduce of [IndexedSlices(int32), dense float32, IndexedSlices(float32), dense
    float64] with Average.  Horovod: each IndexedSlices' values are allgathered and divided by
    the size in TensorFlow (``values / size``: int32 values become float64, float32 values are
    divided in float32), its indices allgathered; dense tensors averaged by the core.  hvdlite
    used to multiply by a rounded 1/size in the values' dtype (integers truncated to 0)."""
    mine = sparse_inputs(RANK)

    def fn(av, ai, b, cv, ci, d):
        out = hvd.grouped_allreduce([tf.IndexedSlices(av, ai, tf.constant([3, 2])), b,
                                     tf.IndexedSlices(cv, ci, tf.constant([4, 2])), d],
                                    op=hvd.Average)
        assert isinstance(out[0], tf.IndexedSlices) and isinstance(out[2], tf.IndexedSlices)
        return out

    (av, ai), b, (cv, ci), d = run(mode, fn, *mine[0], mine[1], *mine[2], mine[3])
    every = [sparse_inputs(q) for q in range(SIZE)]
    assert av.dtype == np.float64, av.dtype
    np.testing.assert_array_equal(av, np.concatenate([e[0][0] for e in every]) / SIZE)
    np.testing.assert_array_equal(ai, np.concatenate([e[0][1] for e in every]))
    assert cv.dtype == np.float32, cv.dtype
    np.testing.assert_array_equal(cv, np.concatenate([e[2][0] for e in every])
                                  / np.float32(SIZE))
    np.testing.assert_array_equal(ci, np.concatenate([e[2][1] for e in every]))
    np.testing.assert_allclose(b, np.mean([e[1] for e in every], 0), rtol=1e-6)
    close(d, np.mean([e[3] for e in every], 0))


def sparse_integer_average(mode):
    """allreduce of integer IndexedSlices with Average: TensorFlow's ``values / size``
    (int16 -> float32, int64 -> float64); Sum keeps the integers."""
    vals = {dt: [ints(f"spi.{np.dtype(dt).name}", q, (2, 3), dt) for q in range(SIZE)]
            for dt in (np.int16, np.int64)}
    idx = np.array([RANK, RANK + 1], np.int32)

    def fn(v16, v64, i):
        shape = tf.constant([SIZE + 1, 3])
        return [hvd.allreduce(tf.IndexedSlices(v16, i, shape)),
                hvd.allreduce(tf.IndexedSlices(v64, i, shape)),
                hvd.allreduce(tf.IndexedSlices(v64, i, shape), op=hvd.Sum)]

    (a16, _), (a64, i64), (s64, _) = run(mode, fn, vals[np.int16][RANK],
                                          vals[np.int64][RANK], idx)
    assert a16.dtype == np.float32 and a64.dtype == np.float64, (a16.dtype, a64.dtype)
    np.testing.assert_array_equal(a16, np.concatenate(vals[np.int16]).astype(np.float32)
                                  / np.float32(SIZE))
    np.testing.assert_array_equal(a64, np.concatenate(vals[np.int64]) / SIZE)
    assert s64.dtype == np.int64
    np.testing.assert_array_equal(s64, np.concatenate(vals[np.int64]))
    assert i64.tolist() == sum([[q, q + 1] for q in range(SIZE)], [])


def _sparse(values=None):
    return tf.IndexedSlices(tf.ones([1, 2]) if values is None else values, tf.constant([0]),
                            tf.constant([3, 2]))


def _build_only(mode, fn):
    """Call ``fn()`` (which builds ops) eagerly, while tracing a tf.function, or in a TF1
    graph."""
    if mode == "eager":
        return fn()
    if mode == "graph":
        return tf.function(fn)()
    with tf.Graph().as_default():
        return fn()


def sparse_scale_factors_rejected(mode):
    """Horovod raises NotImplementedError for prescale/postscale with tf.IndexedSlices."""
    for kwargs in ({"prescale_factor": 2.0}, {"postscale_factor": 0.5}):
        raises([NotImplementedError], lambda: _build_only(
            mode, lambda: hvd.allreduce(_sparse(), **kwargs)), "IndexedSlices")
        raises([NotImplementedError], lambda: _build_only(
            mode, lambda: hvd.grouped_allreduce([_sparse(), tf.ones([2])], **kwargs)),
            "IndexedSlices")
    assert hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist() == [SIZE] * 2


def sparse_ops_rejected(mode):
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        raises([NotImplementedError], lambda: _build_only(
            mode, lambda: hvd.allreduce(_sparse(), op=op)), "IndexedSlices")
        raises([NotImplementedError], lambda: _build_only(
            mode, lambda: hvd.grouped_allreduce([tf.ones([2]), _sparse()], op=op)),
            "IndexedSlices")


SPARSE_FUNCS = {"grouped_mixed_average": sparse_grouped_mixed_average,
                "integer_average": sparse_integer_average,
                "scale_factors_rejected": sparse_scale_factors_rejected,
                "ops_rejected": sparse_ops_rejected}


# --- errors (items 7, 10) ----------------------------------------------------------------------
def _mismatch_classes(mode):
    """Horovod: FailedPreconditionError.  hvdlite: the same eagerly (also a
    TensorMismatchError); in a graph TensorFlow reports the Python node's failure as
    InvalidArgumentError (see hvdlite/tensorflow/errors.py)."""
    if mode == "eager":
        return [tf.errors.FailedPreconditionError, hvd.TensorMismatchError]
    return [tf.errors.InvalidArgumentError]


def errors_mismatch(mode):
    cases = [
        ("shape", lambda: hvd.allreduce(tf.ones([RANK + 2]), name="fid.mm.shape")),
        ("dtype", lambda: hvd.allgather(tf.ones([2], tf.float32 if RANK else tf.float64),
                                            name="fid.mm.dtype")),
        ("shape", lambda: hvd.alltoall(tf.ones([2 * SIZE, RANK + 1]), name="fid.mm.a2a")),
        ("root rank", lambda: hvd.broadcast(tf.ones([2]), RANK, name="fid.mm.root")),
        ("shape", lambda: hvd.reducescatter(tf.ones([SIZE, RANK + 1]), name="fid.mm.rs")),
    ]
    for needle, fn in cases:
        if mode == "session":
            raises(_mismatch_classes(mode), lambda: session_run(fn), "Mismatched", needle)
        else:
            raises(_mismatch_classes(mode), lambda: tf.function(fn)() if mode == "graph"
                   else fn(), "Mismatched", needle)
        # the job goes on
        assert hvd.allreduce(tf.ones([1]), op=hvd.Sum, name="fid.mm.ok").numpy() == SIZE


def errors_arguments(mode):
    """Horovod reports these as InvalidArgumentError (when the op runs); hvdlite raises it
    while the op is built (also a ValueError)."""
    other = ODD if RANK % 2 == 0 else EVEN
    outsider = [q for q in range(SIZE) if q not in my_set().ranks]
    cases = [
        ("divisible", lambda: hvd.alltoall(tf.ones([SIZE + 1]))),
        ("splits", lambda: hvd.alltoall(tf.ones([SIZE]), splits=[1] * (SIZE + 1))),
        ("more than", lambda: hvd.alltoall(tf.ones([SIZE]), splits=[SIZE] * SIZE)),
        ("scalar", lambda: hvd.alltoall(tf.ones([]))),
        ("scalar", lambda: hvd.reducescatter(tf.ones([]))),
        ("scalar", lambda: hvd.grouped_reducescatter([tf.ones([2]), tf.ones([])])),
        ("root_rank", lambda: hvd.broadcast(tf.ones([1]), SIZE)),
        ("not registered", lambda: hvd.allgather(tf.ones([1]),
                                                 process_set=hvd.ProcessSet([0]))),
    ]
    if other.ranks:
        cases.append(("not a member", lambda: hvd.allreduce(tf.ones([1]), process_set=other)))
    if outsider:
        cases.append(("root_rank", lambda: hvd.broadcast(tf.ones([1]), outsider[0],
                                                         process_set=my_set())))
    for needle, fn in cases:
        raises([tf.errors.InvalidArgumentError, ValueError],
               lambda: _build_only(mode, fn), needle)
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum, name="fid.arg.ok").numpy() == SIZE


def errors_reducescatter_adasum():
    """Horovod's reducescatter backend refuses ops other than Sum/Average: AbortedError."""
    for mode in GRAPH_BUILD_MODES:
        raises([tf.errors.AbortedError, hvd.HorovodInternalError], lambda: _build_only(
            mode, lambda: hvd.reducescatter(tf.ones([SIZE]), op=hvd.Adasum)), "Adasum")
        raises([tf.errors.AbortedError], lambda: _build_only(
            mode, lambda: hvd.grouped_reducescatter([tf.ones([SIZE])], op=hvd.Adasum)))


def errors_graph_run_time():
    """Splits known only when the graph runs: the node fails with InvalidArgumentError (the
    same class as Horovod's), eagerly at once."""
    x = np.ones([SIZE, 2], np.float32)
    too_many = np.full([SIZE], 2, np.int32)
    f = tf.function(lambda t, s: hvd.alltoall(t, splits=s, name="fid.rt"))
    raises([tf.errors.InvalidArgumentError], lambda: f(tf.constant(x), tf.constant(too_many)),
           "split")

    def build():
        s = tf.compat.v1.placeholder(tf.int32, [SIZE])
        return hvd.alltoall(tf.constant(x), splits=s, name="fid.rt.sess"), s

    graph = tf.Graph()
    with graph.as_default():
        (out, _), s = build()
        with tf.compat.v1.Session(graph=graph) as sess:
            raises([tf.errors.InvalidArgumentError],
                   lambda: sess.run(out, {s: too_many}), "split")
            got = sess.run(out, {s: np.ones([SIZE], np.int32)})
    assert got.shape == (SIZE, 2)
    raises([tf.errors.InvalidArgumentError, ValueError],
           lambda: hvd.alltoall(tf.constant(x), splits=tf.constant(too_many)))


def alltoall_fewer_rows(mode):
    """Horovod accepts splits that sum to fewer rows than the tensor has, and sends those."""
    x = [ints("a2a.few", q, (SIZE + 3, 2)) for q in range(SIZE)]

    def fn(t):
        return hvd.alltoall(t, splits=[1] * SIZE)

    out, received = run(mode, fn, x[RANK])
    close(out, np.stack([x[q][RANK] for q in range(SIZE)]))
    assert received.tolist() == [1] * SIZE


def process_set_codes():
    """Horovod's size_op/process_set_included_op return -3 for an unknown process set."""
    assert int(hvd.size_op(99)) == -3 and int(hvd.process_set_included_op(99)) == -3
    assert int(hvd.size_op(EVEN.process_set_id)) == len(EVEN.ranks)
    assert int(hvd.process_set_included_op(EVEN.process_set_id)) == int(RANK % 2 == 0)
    assert int(tf.function(lambda: hvd.size_op())()) == SIZE


# --- TF1 graphs --------------------------------------------------------------------------------
def session_broadcast_inplace():
    """Horovod's test_horovod_broadcast_inplace(_multiple) in a TF1 session: ResourceVariable
    and RefVariable, several dtypes and roots, each op evaluated repeatedly, earlier ops after
    later ones were built.  The graph also holds a collective fed by a placeholder, built
    first: running a broadcast must not run it (hvdlite used to chain every collective of a
    graph after the previous one, so each broadcast needed that feed)."""
    from tensorflow.python.ops import resource_variable_ops
    from tensorflow.python.ops.ref_variable import RefVariable
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        fed = tf.compat.v1.placeholder(tf.float32, [2])
        hvd.allreduce(fed, name="fid.fed")
        built = []
        for use_resource in (False, True):
            for dtype in (tf.uint8, tf.int32, tf.float32, tf.bool):
                for dim in (1, 2):
                    for root in range(SIZE):
                        init = tf.cast((tf.ones([3] * dim) * RANK) % (2 if dtype == tf.bool
                                                                       else 256), dtype)
                        cls = resource_variable_ops.ResourceVariable if use_resource \
                            else RefVariable
                        var = cls(init)
                        sess.run(var.initializer)
                        (b,) = hvd.broadcast_([var], root)
                        want = np.full([3] * dim, root % 2 if dtype == tf.bool else root)
                        got = sess.run(b)
                        assert np.array_equal(got.astype(np.int64), want), (dtype, root, got)
                        assert np.array_equal(sess.run(var), got)
                        built.append((var, b, want))
        # several variables in one call, then every earlier op again
        vs = [tf.compat.v1.Variable(np.full([2] * (k + 1), RANK, np.float32), use_resource=k % 2)
              for k in range(3)]
        sess.run([v.initializer for v in vs])
        outs = hvd.broadcast_(vs, SIZE - 1)
        for v, o in zip(vs, sess.run(outs)):
            assert np.all(o == SIZE - 1) and np.all(sess.run(v) == SIZE - 1)
        for var, b, want in built[:4]:
            sess.run(var.initializer)
            assert np.array_equal(sess.run(b).astype(np.int64), want)


def session_broadcast_variables_after_train_op():
    """Horovod's TF1 recipe: build the training step (fed by a placeholder), then the broadcast
    of the variables; running the broadcast must not need the step's feed (hvdlite used to
    chain every collective of a TF1 graph after the previous one, so it ran the step's gradient
    allreduce too).  broadcast_global_variables builds the same op in a TF1 graph, and raises
    RuntimeError eagerly, as Horovod's."""
    for use_global in (False, True):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float64, [2])
            w = tf.compat.v1.Variable(np.full(2, RANK + 1.0), name="w")
            loss = tf.reduce_sum(w * w * x)
            (grad,) = tf.compat.v1.gradients(loss, [w])
            (avg,) = hvd.grouped_allreduce([grad])
            step = w.assign_sub(0.25 * avg)
            bcast = (hvd.broadcast_global_variables(0) if use_global
                     else hvd.broadcast_variables(tf.compat.v1.global_variables(), 0))
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(bcast)
                assert sess.run(w).tolist() == [1.0, 1.0]
                xs = [np.array([q + 1.0, 2.0]) for q in range(SIZE)]
                got = sess.run(step, {x: xs[RANK]})
                close(got, 1.0 - 0.25 * np.mean([2 * xq for xq in xs], 0))
    raises([RuntimeError], lambda: hvd.broadcast_global_variables(0), "eager")


def _legacy_expectations(lr, members, coef):
    """w after one SGD step from 1.0 on loss_q = coef(q) * sum(w * w) + sum(gather(emb, q)),
    gradients averaged over ``members`` (a rank outside them uses its own)."""
    group = members if RANK in members else [RANK]
    dense = 1.0 - lr * np.mean([2.0 * coef(q) for q in group])
    emb = np.ones((SIZE + 1, 2))
    for q in group:
        emb[q] -= lr / len(group)
    return dense, emb


def _legacy_loss(w, emb):
    return (RANK + 1.0) * tf.reduce_sum(w * w) + tf.reduce_sum(tf.gather(emb, [RANK]))


def session_legacy_optimizer(process_set=hvd.global_process_set, members=None):
    """hvd.DistributedOptimizer(tf.compat.v1.train.Optimizer) as in Horovod: minimize() averages
    the gradients (dense and tf.IndexedSlices) before applying them."""
    members = list(range(SIZE)) if members is None else members
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.Variable(np.ones(3))
        emb = tf.compat.v1.Variable(np.ones((SIZE + 1, 2)))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5),
                                       process_set=process_set)
        train = opt.minimize(_legacy_loss(w, emb))
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            got_w, got_emb = sess.run([w, emb])
    dense, emb_want = _legacy_expectations(0.5, members, lambda q: q + 1.0)
    close(got_w, np.full(3, dense))
    close(got_emb, emb_want)


def eager_legacy_optimizer(process_set=hvd.global_process_set, members=None):
    members = list(range(SIZE)) if members is None else members
    w = tf.Variable(np.ones(3))
    emb = tf.Variable(np.ones((SIZE + 1, 2)))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5),
                                   process_set=process_set)
    opt.minimize(lambda: _legacy_loss(w, emb), var_list=[w, emb])
    dense, emb_want = _legacy_expectations(0.5, members, lambda q: q + 1.0)
    close(w.numpy(), np.full(3, dense))
    close(emb.numpy(), emb_want)
    raises([ValueError], lambda: hvd.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5), backward_passes_per_step=2))


# --- process-set non-members (item 5) ----------------------------------------------------------
def nonmember_tape():
    """DistributedGradientTape(process_set=EVEN): members average over EVEN; other ranks get
    their local gradients (dense and tf.IndexedSlices) untouched, and a registered local
    source divided by EVEN's size, as Horovod's tape does (process_set.size())."""
    v = tf.Variable(np.arange(3.0))
    loc = tf.Variable(np.ones(2))
    emb = tf.Variable(np.ones((SIZE + 1, 2)))
    members = EVEN.ranks

    def compute():
        with tf.GradientTape() as tape:
            loss = ((RANK + 1.0) * tf.reduce_sum(v * v) + tf.reduce_sum(tf.gather(emb, [RANK]))
                    + (RANK + 1.0) * tf.reduce_sum(loc))
        tape = hvd.DistributedGradientTape(tape, process_set=EVEN)
        tape.register_local_source(loc)
        return tape.gradient(loss, [v, emb, loc])

    for graph in (False, True):
        gv, gemb, gloc = tf.function(compute)() if graph else compute()
        group = members if RANK in members else [RANK]
        close(gv.numpy(), 2 * np.arange(3.0) * np.mean([q + 1.0 for q in group]))
        assert isinstance(gemb, tf.IndexedSlices)
        dense = np.zeros((SIZE + 1, 2))
        for q in group:
            dense[q] += 1.0 / len(group)
        close(tf.convert_to_tensor(gemb).numpy(), dense)
        close(gloc.numpy(), np.full(2, (RANK + 1.0) / len(members)))


def nonmember_keras():
    """Keras DistributedOptimizer(process_set=EVEN), one and two backward passes per step, and
    model.fit: ranks outside EVEN apply their local gradients."""
    import keras
    members = EVEN.ranks
    group = members if RANK in members else [RANK]
    for passes in (1, 2):
        var = keras.Variable(np.zeros(2, np.float32))
        opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=EVEN,
                                        backward_passes_per_step=passes,
                                        name=f"nonmember{passes}")
        for _ in range(passes):
            opt.apply([tf.constant([RANK + 1.0, 1.0], tf.float32)], [var])
        want = -passes * np.array([np.mean([q + 1.0 for q in group]), 1.0])
        np.testing.assert_allclose(np.asarray(var.numpy()), want, rtol=1e-6)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False,
                                                                    kernel_initializer="ones")])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.5),
                                                      process_set=EVEN), loss="mse")
    x = np.full((2, 1), 1.0, np.float32)
    y = np.full((2, 1), 1.0 - (RANK + 1.0), np.float32)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    # d mse / d k at k = 1: 2 * (k - y) = 2 * (q + 1); averaged over the group
    want = 1.0 - 0.5 * np.mean([2.0 * (q + 1.0) for q in group])
    np.testing.assert_allclose(np.asarray(model.layers[0].kernel.numpy()), [[want]], rtol=1e-6)


def nonmember_legacy_optimizer():
    session_legacy_optimizer(EVEN, EVEN.ranks)
    eager_legacy_optimizer(EVEN, EVEN.ranks)


# --- API details --------------------------------------------------------------------------------
def tape_horovod_signature():
    """Horovod's tape: gradient(target, sources, output_gradients, use_generic_names) and
    get_local_and_global_gradients -> (local pairs, global pairs)."""
    a, b = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
    with tf.GradientTape(persistent=True) as tape:
        loss = (RANK + 1.0) * (tf.reduce_sum(a * a) + tf.reduce_sum(b))
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(b)
    (ga, gb) = tape.gradient(loss, [a, b], None, True)
    mean = np.mean([q + 1.0 for q in range(SIZE)])
    np.testing.assert_allclose(ga.numpy(), 2 * mean * np.array([1.0, 2.0]), rtol=1e-6)
    np.testing.assert_allclose(gb.numpy(), [(RANK + 1.0) / SIZE], rtol=1e-6)
    local, shared = tape.get_local_and_global_gradients(loss, [a, b])
    assert [s for s, _ in local] == [b] and [s for s, _ in shared] == [a]
    np.testing.assert_allclose(shared[0][1].numpy(), ga.numpy(), rtol=1e-6)
    np.testing.assert_allclose(local[0][1].numpy(), gb.numpy(), rtol=1e-6)


def optimizer_groups_arguments():
    """Horovod: num_groups is deprecated (DeprecationWarning) and stands in for groups; both
    may be given; groups <= 0 raises ValueError."""
    import warnings
    import keras
    for make in (lambda **kw: hvd.DistributedGradientTape(tf.GradientTape(), **kw),
                 lambda **kw: hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw),
                 lambda **kw: hvd.DistributedOptimizer(
                     tf.compat.v1.train.GradientDescentOptimizer(0.1), **kw)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make(num_groups=2, groups=3)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught
        raises([ValueError], lambda: make(groups=0), "groups")


# --- eager hand-off: no copies where TensorFlow allows, no gradient recording without a tape ----
def eager_zero_copy():
    """Eagerly a CPU tensor reaches the core as a view of its buffer, and an aligned result
    comes back as a tensor sharing its memory (DLPack); an unaligned one, and dtypes DLPack
    does not carry, are copied, with the same values."""
    from hvdlite.common.memory import aligned_empty
    from hvdlite.tensorflow.eager_arrays import as_tensor, host_array
    t = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
    view = host_array(t)
    assert np.shares_memory(view, t._numpy()), "the input was copied"
    np.testing.assert_array_equal(view, np.arange(12).reshape(3, 4))
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8):
        aligned = aligned_empty((5, 3), dtype)
        aligned[...] = np.arange(15).reshape(5, 3)
        adopted = as_tensor(aligned, tf.as_dtype(dtype))
        assert adopted.dtype == tf.as_dtype(dtype) and adopted.shape == (5, 3), adopted
        assert np.shares_memory(adopted._numpy(), aligned), f"{dtype}: an aligned result was copied"
        np.testing.assert_array_equal(adopted.numpy(), np.arange(15).reshape(5, 3))
    raw = np.empty(400, dtype=np.uint8)   # a float32 array starting 4 bytes past a 64-byte line
    start = (-raw.ctypes.data % 64) + 4
    unaligned = raw[start:start + 4 * 64].view(np.float32)
    unaligned[...] = np.arange(64)
    copied = as_tensor(unaligned, tf.float32)
    assert not np.shares_memory(copied._numpy(), unaligned), "an unaligned result was adopted"
    np.testing.assert_array_equal(copied.numpy(), np.arange(64))
    for values, dtype in ((np.array([True, False]), tf.bool),
                          (np.array([1 + 2j], np.complex64), tf.complex64)):
        np.testing.assert_array_equal(as_tensor(values, dtype).numpy(), values)
    scalar = aligned_empty((), np.float64)
    scalar[...] = 2.5
    assert as_tensor(scalar, tf.float64).numpy() == 2.5
    big = tf.constant(np.full(1 << 18, RANK + 1, dtype=np.float32))   # 1 MiB: aligned result
    got = hvd.allreduce(big, op=hvd.Sum, name="eager.zero_copy.big")
    np.testing.assert_array_equal(got.numpy(), np.full(1 << 18, sum(range(1, SIZE + 1))))
    np.testing.assert_array_equal(big.numpy(), np.full(1 << 18, RANK + 1))   # input intact
    half = hvd.allreduce(tf.constant(np.full(7, RANK + 1, np.float32), dtype=tf.bfloat16),
                         op=hvd.Sum, name="eager.zero_copy.bf16")
    assert half.dtype == tf.bfloat16, half.dtype
    np.testing.assert_array_equal(tf.cast(half, tf.float32).numpy(),
                                  np.full(7, sum(range(1, SIZE + 1))))


def eager_records_only_under_a_tape():
    """An eager allreduce outside any gradient tape builds no custom gradient (the wrapper's
    cost is the largest part of a small eager op); under a tape, or a forward accumulator,
    it does, and the gradient is Horovod's (the allreduce of the upstream gradient)."""
    from hvdlite.tensorflow import autodiff
    calls = []
    original = autodiff.tf.custom_gradient

    def counting(f):
        calls.append(f)
        return original(f)

    autodiff.tf.custom_gradient = counting
    try:
        x = tf.constant(np.full(3, float(RANK + 1)))
        got = hvd.allreduce(x, op=hvd.Sum, name="eager.no_tape")
        assert not calls, f"custom_gradient built {len(calls)} times without a tape"
        np.testing.assert_array_equal(got.numpy(), np.full(3, sum(range(1, SIZE + 1))))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd.allreduce(x, op=hvd.Sum, name="eager.tape")
            loss = tf.reduce_sum(y * float(RANK + 1))
        assert len(calls) == 1, len(calls)
        grad = tape.gradient(loss, x)
        np.testing.assert_array_equal(grad.numpy(), np.full(3, float(sum(range(1, SIZE + 1)))))
        with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)):
            hvd.allreduce(x, op=hvd.Sum, name="eager.accumulator")
        assert len(calls) > 1, "no custom gradient under a forward accumulator"
    finally:
        autodiff.tf.custom_gradient = original


# --- run: graph modes first, eager last ----------------------------------------------------------
# --- item 8: an eager op that fails on one rank before it is submitted --------------------------
LAST = SIZE - 1


def unnamed_follow_ups():
    """Unnamed eager ops of different shapes after the error pair across ranks (with drifting
    automatic names they would pair with the wrong tensors, or wait for ever)."""
    for k in range(3):
        got = hvd.allreduce(tf.constant(np.arange(k + 2, dtype=np.float64) * (RANK + 1)),
                            op=hvd.Sum).numpy()
        np.testing.assert_array_equal(got, np.arange(k + 2) * sum(range(1, SIZE + 1)))
    got = hvd.allgather(tf.fill([RANK + 1, 2], float(RANK))).numpy()
    np.testing.assert_array_equal(got, np.concatenate([np.full((q + 1, 2), float(q))
                                                       for q in range(SIZE)]))


def unnamed_one_rank(bad, good, cause):
    """Rank LAST's eager op raises in its own checks; the others' op fails with
    FailedOnRankError naming rank LAST and ``cause``; then unnamed ops pair again."""
    try:
        (bad if RANK == LAST else good)()
        outcome = None
    except Exception as exc:  # noqa: BLE001 - checked below
        outcome = exc
    unnamed_follow_ups()
    assert outcome is not None, "nothing raised"
    if RANK != LAST:
        assert isinstance(outcome, hvd.FailedOnRankError), repr(outcome)
        assert f"ranks [{LAST}]" in str(outcome) and cause in str(outcome), str(outcome)
    else:
        assert not isinstance(outcome, hvd.FailedOnRankError), repr(outcome)


def unnamed_eager_dtype():
    unnamed_one_rank(lambda: hvd.allreduce(tf.constant([1 + 2j, 3j], dtype=tf.complex64)),
                     lambda: hvd.allreduce(tf.ones([2])), "complex64")


def unnamed_eager_root_rank():
    unnamed_one_rank(lambda: hvd.broadcast(tf.ones([3]), root_rank=SIZE + 5),
                     lambda: hvd.broadcast(tf.ones([3]), root_rank=0), "root")


def unnamed_eager_splits():
    x = tf.ones([2 * SIZE, 2])
    unnamed_one_rank(lambda: hvd.alltoall(x, splits=[1] * (SIZE + 1)),
                     lambda: hvd.alltoall(x), "splits")


def unnamed_eager_grouped_member():
    unnamed_one_rank(
        lambda: hvd.grouped_allreduce([tf.ones([2]), tf.constant([1j], dtype=tf.complex64)]),
        lambda: hvd.grouped_allreduce([tf.ones([2]), tf.ones([1])]), "complex64")


for mode in MODES:
    for c in GRAD_CASES:
        r.case(f"grad.{c}.{mode}", GRAD_FUNCS[c], mode)
for mode in GRAPH_BUILD_MODES:
    for c in SPARSE_CASES:
        r.case(f"sparse.{c}.{mode}", SPARSE_FUNCS[c], mode)
    r.case(f"errors.mismatch.{mode}", errors_mismatch, mode)
    r.case(f"errors.arguments.{mode}", errors_arguments, mode)
    r.case(f"alltoall.fewer_rows.{mode}", alltoall_fewer_rows, mode)
r.case("errors.reducescatter_adasum", errors_reducescatter_adasum)
r.case("errors.graph_run_time", errors_graph_run_time)
r.case("ops.process_set_codes", process_set_codes)
r.case("session.broadcast_inplace", session_broadcast_inplace)
r.case("session.broadcast_variables_after_train_op", session_broadcast_variables_after_train_op)
r.case("session.legacy_optimizer", session_legacy_optimizer)
r.case("eager.legacy_optimizer", eager_legacy_optimizer)
r.case("nonmember.tape", nonmember_tape)
r.case("nonmember.keras", nonmember_keras)
r.case("nonmember.legacy_optimizer", nonmember_legacy_optimizer)
r.case("tape.horovod_signature", tape_horovod_signature)
r.case("optimizer.groups_arguments", optimizer_groups_arguments)
r.case("unnamed.eager_dtype", unnamed_eager_dtype)
r.case("unnamed.eager_root_rank", unnamed_eager_root_rank)
r.case("unnamed.eager_splits", unnamed_eager_splits)
r.case("unnamed.eager_grouped_member", unnamed_eager_grouped_member)
r.case("eager.zero_copy", eager_zero_copy)
r.case("eager.records_only_under_a_tape", eager_records_only_under_a_tape)

missing = sorted(set(CASES) - set(r.results))
assert not missing, missing
r.write()
