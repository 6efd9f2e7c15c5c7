"""hvdlite.tensorflow's alltoall, reducescatter, grouped ops, join, process sets and Adasum.

One launch per rank count runs every case (``argv[1] == "adasum"``: only the Adasum cases, for
the 4-rank launch).  Every rank regenerates every rank's input from the case name and checks
its result against a numpy reference of the documented semantics; gradients are checked against
hand-derived references for the summed loss of all ranks.  The case names are listed in
tests/tensorflow/test_collectives.py.
"""
import os
import sys
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.keras as hvdk  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "main"

if MODE == "adasum":
    hvd.init()
    EVEN = ODD = None
else:
    from mpi4py import MPI
    _world = MPI.COMM_WORLD.Get_size()
    EVEN = hvd.ProcessSet([q for q in range(_world) if q % 2 == 0])
    ODD = hvd.ProcessSet([q for q in range(_world) if q % 2 == 1])
    hvd.init(process_sets=[EVEN, ODD])
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)


# --- helpers -----------------------------------------------------------------------------------
def rng(*parts):
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def ints(case, q, shape, dtype=np.float32):
    """Rank ``q``'s input for ``case``: small integers (exact in every float dtype)."""
    return rng(case, q, shape).integers(-4, 5, size=shape).astype(dtype)


def run(fn, graph, *args):
    """``fn(*args)`` eagerly or through a fresh tf.function."""
    return tf.function(fn)(*args) if graph else fn(*args)


def offsets(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(int)


def split_rows(rows, parts):
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def pyfunc_ops(fn, *args) -> list:
    """The Python nodes (hvdlite's collectives) of ``fn`` traced as a tf.function."""
    graph = tf.function(fn).get_concrete_function(*args).graph
    return [op for op in graph.get_operations() if "PyFunc" in op.type]


def pyfunc_nodes(fn, *args) -> int:
    return len(pyfunc_ops(fn, *args))


def node_arity(fn, *args) -> list[tuple[int, int]]:
    """(inputs, outputs) of each Python node of ``fn`` traced as a tf.function."""
    return [(len(op.inputs), len(op.outputs)) for op in pyfunc_ops(fn, *args)]


def expect_raises(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {exc}"
        return
    raise AssertionError(f"{exc_type.__name__} not raised")


# --- alltoall ------------------------------------------------------------------------------------
def alltoall_ref(inputs, splits, me):
    parts, counts = [], []
    for q, x in enumerate(inputs):
        off = offsets(splits[q])
        parts.append(x[off[me]:off[me + 1]])
        counts.append(splits[q][me])
    return np.concatenate(parts), np.array(counts, np.int32)


def uneven_splits(size):
    """Rank 0 sends nothing; the others send (q + 2j) % 3 rows to rank j (some zero)."""
    return [[0] * size] + [[(q + 2 * j) % 3 for j in range(size)] for q in range(1, size)]


def alltoall_even(graph):
    for dt in (np.float32, np.int64, np.float16):
        case = f"a2a.even.{np.dtype(dt).name}"
        inputs = [ints(case, q, (2 * SIZE, 3), dt) for q in range(SIZE)]
        got = run(lambda x: hvd.alltoall(x), graph, tf.constant(inputs[RANK]))
        assert isinstance(got, tf.Tensor), "without splits alltoall returns only the output"
        want, _ = alltoall_ref(inputs, [[2] * SIZE] * SIZE, RANK)
        assert got.dtype.as_numpy_dtype == dt
        np.testing.assert_array_equal(got.numpy(), want)


def alltoall_uneven(graph):
    splits = uneven_splits(SIZE)
    inputs = [ints("a2a.uneven", q, (sum(splits[q]), 2)) for q in range(SIZE)]
    for as_tensor in (False, True):
        s = tf.constant(splits[RANK], tf.int32) if as_tensor else splits[RANK]
        got, received = run(lambda x: hvd.alltoall(x, splits=s, name=None), graph,
                            tf.constant(inputs[RANK]))
        want, want_counts = alltoall_ref(inputs, splits, RANK)
        assert got.shape == want.shape, (got.shape, want.shape)
        np.testing.assert_array_equal(got.numpy(), want)
        assert received.dtype == tf.int32
        assert received.numpy().tolist() == want_counts.tolist(), received
    # splits passed as a tf.function argument (int64), 1-D input
    x1 = [ints("a2a.uneven1d", q, (sum(splits[q]),)) for q in range(SIZE)]
    got, received = run(lambda x, s: hvd.alltoall(x, splits=s), graph, tf.constant(x1[RANK]),
                        tf.constant(splits[RANK], tf.int64))
    want, want_counts = alltoall_ref(x1, splits, RANK)
    np.testing.assert_array_equal(got.numpy(), want)
    assert received.numpy().tolist() == want_counts.tolist()


def alltoall_static_shapes():
    splits = uneven_splits(SIZE)
    x = tf.zeros([sum(splits[RANK]), 4])
    cf = tf.function(lambda t: hvd.alltoall(t, splits=splits[RANK])).get_concrete_function(x)
    out, received = cf.structured_outputs
    assert out.shape.as_list() == [None, 4], out.shape
    assert received.shape.as_list() == [SIZE], received.shape


def alltoall_grad(graph):
    splits = uneven_splits(SIZE)
    inputs = [ints("a2a.grad.x", q, (sum(splits[q]), 2), np.float64) for q in range(SIZE)]
    outs = [alltoall_ref(inputs, splits, q)[0] for q in range(SIZE)]
    weights = [ints("a2a.grad.w", q, outs[q].shape, np.float64) for q in range(SIZE)]
    x = tf.Variable(inputs[RANK])
    w = tf.constant(weights[RANK])

    def compute():
        with tf.GradientTape() as tape:
            out, _ = hvd.alltoall(x, splits=splits[RANK])
            loss = tf.reduce_sum(out * w)
        return tape.gradient(loss, x)

    got = run(compute, graph)
    # Block j of this rank's input landed on rank j after the rows of lower ranks.
    want = []
    for j in range(SIZE):
        before = sum(splits[p][j] for p in range(RANK))
        want.append(weights[j][before:before + splits[RANK][j]])
    np.testing.assert_array_equal(got.numpy(), np.concatenate(want))


def alltoall_errors():
    x = tf.zeros([SIZE * 2, 2])
    for graph in (False, True):
        expect_raises(ValueError, lambda: run(lambda t: hvd.alltoall(t, splits=[1] * (SIZE + 1)),
                                              graph, x), "splits")
        expect_raises(ValueError, lambda: run(lambda t: hvd.alltoall(t, splits=[SIZE * 2 + 1]
                                                                     + [0] * (SIZE - 1)),
                                              graph, x), "sum")
        expect_raises(ValueError, lambda: run(lambda t: hvd.alltoall(t), graph, tf.ones([])),
                      "scalar")
    expect_raises(ValueError, lambda: hvd.alltoall(tf.zeros([SIZE * 2 + 1])), "divisible")
    ok = hvd.alltoall(tf.fill([SIZE], float(RANK)))
    assert ok.numpy().tolist() == [float(q) for q in range(SIZE)]


# --- reducescatter -------------------------------------------------------------------------------
def scatter_ref(inputs, op, pre=1.0, post=1.0):
    total = np.sum([x.astype(np.float64) * pre for x in inputs], axis=0) * post
    if op == "Average":
        total = total / SIZE
    counts = split_rows(inputs[0].shape[0], SIZE)
    off = offsets(counts)
    return total[off[RANK]:off[RANK + 1]]


def reducescatter_ops(graph):
    rows = 2 * SIZE + 1
    for op, dt in (("Sum", np.float32), ("Average", np.float64), ("Sum", np.int32),
                   ("Average", np.float32)):
        case = f"rs.{op}.{np.dtype(dt).name}"
        inputs = [ints(case, q, (rows, 3), dt) for q in range(SIZE)]
        got = run(lambda x: hvd.reducescatter(x, op=getattr(hvd, op)), graph,
                  tf.constant(inputs[RANK]))
        want = scatter_ref(inputs, op)
        assert got.shape[0] == split_rows(rows, SIZE)[RANK], got.shape
        assert got.dtype.as_numpy_dtype == dt
        np.testing.assert_allclose(got.numpy(), want.astype(dt), rtol=1e-6, err_msg=case)
    # default op is Average; fewer rows than ranks; scale factors
    inputs = [ints("rs.default", q, (SIZE - 1,)) for q in range(SIZE)]
    got = run(lambda x: hvd.reducescatter(x), graph, tf.constant(inputs[RANK]))
    np.testing.assert_allclose(got.numpy(), scatter_ref(inputs, "Average"), rtol=1e-6)
    inputs = [ints("rs.scaled", q, (rows, 2)) for q in range(SIZE)]
    got = run(lambda x: hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5,
                                          postscale_factor=3.0), graph,
              tf.constant(inputs[RANK]))
    np.testing.assert_allclose(got.numpy(), scatter_ref(inputs, "Sum", 0.5, 3.0), rtol=1e-6)


def reducescatter_static_shape():
    rows = 2 * SIZE + 1
    cf = tf.function(lambda t: hvd.reducescatter(t, op=hvd.Sum)).get_concrete_function(
        tf.zeros([rows, 5]))
    assert cf.structured_outputs.shape.as_list() == [split_rows(rows, SIZE)[RANK], 5]


def reducescatter_grad(graph):
    rows = 2 * SIZE + 1
    counts = split_rows(rows, SIZE)
    x = tf.Variable(ints("rs.grad.x", RANK, (rows, 2), np.float64))
    weights = [ints("rs.grad.w", q, (counts[q], 2), np.float64) for q in range(SIZE)]
    w = tf.constant(weights[RANK])
    settings = [("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Average", 2.0, 0.25),
                ("Sum", 3.0, 1.0)]

    def compute():
        grads = []
        for op, pre, post in settings:
            with tf.GradientTape() as tape:
                y = hvd.reducescatter(x, op=getattr(hvd, op), prescale_factor=pre,
                                      postscale_factor=post)
                loss = tf.reduce_sum(y * w)
            grads.append(tape.gradient(loss, x))
        return grads

    got = run(compute, graph)
    for g, (op, pre, post) in zip(got, settings):
        # Horovod: allgather of the output gradients, times the size for Sum, prescale and
        # postscale (no division for Average)
        factor = pre * post * (SIZE if op == "Sum" else 1)
        np.testing.assert_allclose(g.numpy(), np.concatenate(weights) * factor, rtol=1e-12,
                                   err_msg=f"{op} {pre} {post}")


def reducescatter_errors():
    for graph in (False, True):
        # Horovod's reducescatter refuses ops other than Sum/Average with AbortedError
        expect_raises(tf.errors.AbortedError, lambda: run(
            lambda t: hvd.reducescatter(t, op=hvd.Adasum), graph, tf.ones([4])), "Adasum")
        expect_raises(ValueError, lambda: run(lambda t: hvd.reducescatter(t), graph,
                                              tf.ones([])), "scalar")
    x = tf.Variable(tf.ones([SIZE]))
    with tf.GradientTape() as tape:
        y = hvd.reducescatter(x, op=hvd.Max)
    expect_raises(NotImplementedError, lambda: tape.gradient(y, x), "Max")
    out = hvdk.reducescatter(np.full((SIZE, 2), RANK + 1.0, np.float32), op=hvd.Sum)
    assert isinstance(out, np.ndarray) and out.tolist() == [[SIZE * (SIZE + 1) / 2] * 2]


# --- grouped ops ---------------------------------------------------------------------------------
def grouped_allgather(graph):
    inputs = [[ints("gag.a", q, (q + 1, 2)), ints("gag.b", q, (2 * q,), np.int64),
               ints("gag.c", q, (), np.float64)] for q in range(SIZE)]
    got = run(lambda a, b, c: hvd.grouped_allgather([a, b, c]), graph,
              *[tf.constant(v) for v in inputs[RANK]])
    assert isinstance(got, list) and len(got) == 3
    for k in range(3):
        want = np.concatenate([np.reshape(per[k], (-1,) + per[k].shape[1:]) for per in inputs])
        assert got[k].dtype.as_numpy_dtype == want.dtype
        np.testing.assert_array_equal(got[k].numpy(), want)
    mine = [tf.constant(v) for v in inputs[RANK]]
    assert pyfunc_nodes(lambda a, b, c: hvd.grouped_allgather([a, b, c]), *mine) == 1
    assert hvd.grouped_allgather([]) == []


def grouped_allgather_grad(graph):
    xs = [tf.Variable(ints("gag.grad.a", RANK, (RANK + 1, 2), np.float64)),
          tf.Variable(np.float64(RANK + 0.5))]
    total = sum(q + 1 for q in range(SIZE))
    wa = [ints("gag.grad.wa", q, (total, 2), np.float64) for q in range(SIZE)]
    wc = [ints("gag.grad.wc", q, (SIZE,), np.float64) for q in range(SIZE)]

    def compute():
        with tf.GradientTape() as tape:
            a, c = hvd.grouped_allgather(xs)
            loss = tf.reduce_sum(a * wa[RANK]) + tf.reduce_sum(c * wc[RANK])
        return tape.gradient(loss, xs)

    ga, gc = run(compute, graph)
    # Horovod: this rank's rows of the upstream gradient averaged over the ranks
    start = sum(q + 1 for q in range(RANK))
    np.testing.assert_allclose(ga.numpy(), (np.sum(wa, 0) / SIZE)[start:start + RANK + 1],
                               rtol=1e-12)
    assert gc.shape == ()
    np.testing.assert_allclose(gc.numpy(), np.sum(wc, 0)[RANK] / SIZE, rtol=1e-12)


def grouped_reducescatter(graph):
    rows = SIZE + 1
    inputs = [[ints("grs.a", q, (rows, 2)), ints("grs.b", q, (rows + SIZE,), np.float64),
               ints("grs.c", q, (rows, 1), np.int32)] for q in range(SIZE)]
    got = run(lambda a, b, c: hvd.grouped_reducescatter([a, b, c], op=hvd.Sum), graph,
              *[tf.constant(v) for v in inputs[RANK]])
    for k in range(3):
        want = scatter_ref([per[k] for per in inputs], "Sum")
        np.testing.assert_array_equal(got[k].numpy(), want.astype(inputs[0][k].dtype))
    got = run(lambda a, b: hvd.grouped_reducescatter([a, b]), graph,
              *[tf.constant(v) for v in inputs[RANK][:2]])
    for k in range(2):
        np.testing.assert_allclose(got[k].numpy(), scatter_ref([per[k] for per in inputs],
                                                               "Average"), rtol=1e-6)
    mine = [tf.constant(v) for v in inputs[RANK]]
    assert pyfunc_nodes(lambda a, b, c: hvd.grouped_reducescatter([a, b, c]), *mine) == 1


def grouped_reducescatter_grad(graph):
    rows = SIZE + 2
    counts = split_rows(rows, SIZE)
    xs = [tf.Variable(ints("grs.grad.a", RANK, (rows, 2), np.float64)),
          tf.Variable(ints("grs.grad.b", RANK, (rows,), np.float32))]
    wa = [ints("grs.grad.wa", q, (counts[q], 2), np.float64) for q in range(SIZE)]
    wb = [ints("grs.grad.wb", q, (counts[q],), np.float32) for q in range(SIZE)]

    def compute():
        with tf.GradientTape() as tape:
            a, b = hvd.grouped_reducescatter(xs, op=hvd.Average, postscale_factor=2.0)
            loss = tf.reduce_sum(a * wa[RANK]) + tf.cast(tf.reduce_sum(b * wb[RANK]),
                                                         tf.float64)
        return tape.gradient(loss, xs)

    ga, gb = run(compute, graph)
    # Horovod: Average does not divide the gradient by the size; postscale multiplies it
    np.testing.assert_allclose(ga.numpy(), np.concatenate(wa) * 2.0, rtol=1e-12)
    np.testing.assert_allclose(gb.numpy(), np.concatenate(wb) * 2.0, rtol=1e-6)


def grouped_allreduce(graph):
    inputs = [[ints("gar.a", q, (3, 2)), ints("gar.b", q, (4,), np.int32),
               ints("gar.c", q, (), np.float64)] for q in range(SIZE)]
    got = run(lambda a, b, c: hvd.grouped_allreduce([a, b, c], op=hvd.Sum), graph,
              *[tf.constant(v) for v in inputs[RANK]])
    for k in range(3):
        want = np.sum([per[k] for per in inputs], axis=0).astype(inputs[0][k].dtype)
        assert got[k].dtype.as_numpy_dtype == want.dtype
        np.testing.assert_array_equal(got[k].numpy(), want)
    mine = [tf.constant(v) for v in inputs[RANK]]
    assert pyfunc_nodes(lambda a, b, c: hvd.grouped_allreduce([a, b, c]), *mine) == 1
    # IndexedSlices inside a group, default op Average
    emb = tf.Variable(np.zeros((5, 2), np.float32))
    dense = tf.Variable(np.full((2,), RANK, np.float32))
    ids = tf.constant([RANK % 5, (RANK + 1) % 5])

    def sparse_and_dense():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, ids)) + tf.reduce_sum(dense * dense)
        g_emb, g_dense = tape.gradient(loss, [emb, dense])
        return hvd.grouped_allreduce([g_emb, g_dense])

    g_emb, g_dense = run(sparse_and_dense, graph)
    assert isinstance(g_emb, tf.IndexedSlices)
    want = np.zeros((5, 2), np.float32)
    for q in range(SIZE):
        for i in (q % 5, (q + 1) % 5):
            want[i] += 1.0 / SIZE
    np.testing.assert_allclose(tf.convert_to_tensor(g_emb).numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(g_dense.numpy(), [2 * np.mean(range(SIZE))] * 2, rtol=1e-6)


def grouped_allreduce_grad(graph):
    xs = [tf.Variable(ints("gar.grad.a", RANK, (3,), np.float64)),
          tf.Variable(ints("gar.grad.b", RANK, (2, 2), np.float32))]
    wa = [ints("gar.grad.wa", q, (3,), np.float64) for q in range(SIZE)]
    wb = [ints("gar.grad.wb", q, (2, 2), np.float32) for q in range(SIZE)]
    n = tf.constant([RANK, 1], tf.int32)   # an integer member: no gradient, no error

    def compute():
        with tf.GradientTape() as tape:
            a, b, _ = hvd.grouped_allreduce([xs[0], xs[1], n], op=hvd.Sum,
                                            prescale_factor=2.0)
            loss = tf.reduce_sum(a * wa[RANK]) + tf.cast(tf.reduce_sum(b * wb[RANK]),
                                                         tf.float64)
        return tape.gradient(loss, xs)

    ga, gb = run(compute, graph)
    np.testing.assert_allclose(ga.numpy(), 2.0 * np.sum(wa, 0), rtol=1e-12)
    np.testing.assert_allclose(gb.numpy(), 2.0 * np.sum(wb, 0), rtol=1e-6)


def grouped_allreduce_flat(graph):
    """A group of one dtype with known shapes reaches its graph node as one flat tensor (one
    input, one output) and comes back in its members' shapes: exact sums, 0-d and empty
    members, the gradient (the same grouped allreduce of the upstream gradients), and a
    member whose shape differs across ranks failing the group with that member's name, after
    which the job goes on."""
    shapes = [(3, 2), (4,), (), (0,), (5, 1, 2)]
    inputs = [[ints(f"garf.{k}", q, shape, np.float32) for k, shape in enumerate(shapes)]
              for q in range(SIZE)]
    mine = [tf.constant(v) for v in inputs[RANK]]
    got = run(lambda *xs: hvd.grouped_allreduce(list(xs), op=hvd.Sum, name="garf"), graph,
              *mine)
    for k, shape in enumerate(shapes):
        want = np.sum([per[k] for per in inputs], axis=0).astype(np.float32)
        assert tuple(got[k].shape) == shape, (k, got[k].shape)
        np.testing.assert_array_equal(got[k].numpy(), want)
    if graph:
        arity = node_arity(lambda *xs: hvd.grouped_allreduce(list(xs), name="garf.n"), *mine)
        assert arity == [(1, 1)], arity
    # members too large to be worth concatenating, and of another dtype, travel on their own
    mixed = [[ints("garf.m0", q, (3,), np.float32), ints("garf.m1", q, (9000,), np.float32),
              ints("garf.m2", q, (2, 2), np.int32), ints("garf.m3", q, (4,), np.float32)]
             for q in range(SIZE)]
    mine_mixed = [tf.constant(v) for v in mixed[RANK]]
    got = run(lambda *xs: hvd.grouped_allreduce(list(xs), op=hvd.Sum, name="garf.mixed"),
              graph, *mine_mixed)
    for k in range(4):
        want = np.sum([per[k] for per in mixed], axis=0).astype(mixed[0][k].dtype)
        assert got[k].dtype.as_numpy_dtype == want.dtype and tuple(got[k].shape) == want.shape
        np.testing.assert_array_equal(got[k].numpy(), want)
    if graph:
        arity = node_arity(lambda *xs: hvd.grouped_allreduce(list(xs), name="garf.mixed.n"),
                           *mine_mixed)
        assert arity == [(3, 3)], arity
    xs = [tf.Variable(ints("garf.grad.a", RANK, (3,), np.float32)),
          tf.Variable(ints("garf.grad.b", RANK, (2, 2), np.float32))]
    ws = [[ints(f"garf.grad.w{k}", q, v.shape, np.float32) for q in range(SIZE)]
          for k, v in enumerate(xs)]

    def compute():
        with tf.GradientTape() as tape:
            a, b = hvd.grouped_allreduce(xs, op=hvd.Sum, prescale_factor=2.0, name="garf.g")
            loss = tf.reduce_sum(a * ws[0][RANK]) + tf.reduce_sum(b * ws[1][RANK])
        return tape.gradient(loss, xs)

    for grad, w in zip(run(compute, graph), ws):
        np.testing.assert_allclose(grad.numpy(), 2.0 * np.sum(w, 0), rtol=1e-6)
    odd = [tf.ones([2]), tf.ones([3 if RANK == 0 else 4])]
    expect_raises(tf.errors.InvalidArgumentError if graph else tf.errors.FailedPreconditionError,
                  lambda: run(lambda a, b: hvd.grouped_allreduce([a, b], name="garf.mm"),
                              graph, *odd), "garf.mm.1")
    after = run(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum, name="garf.after"),
                graph, tf.ones([2]), tf.ones([3]))
    np.testing.assert_array_equal(after[1].numpy(), np.full(3, float(SIZE)))


# --- join ----------------------------------------------------------------------------------------
def join_case(graph):
    """Rank r runs r + 1 allreduce steps, then joins; joined ranks contribute zeros.

    Eagerly the steps are named: unnamed eager ops take their names from per-rank call
    counters, which a rank-dependent number of steps would leave out of step (as in Horovod).
    Inside tf.function the trace-time name is the same on every step."""
    x = tf.fill([3], float(RANK + 1))
    step = (tf.function(lambda t: hvd.allreduce(t)) if graph
            else (lambda t: hvd.allreduce(t, name="join.eager.step")))
    results = [step(x).numpy() for _ in range(RANK + 1)]
    last = tf.function(lambda: hvd.join())() if graph else hvd.join()
    assert last.dtype == tf.int32 and int(last) == SIZE - 1, last
    for s, got in enumerate(results):
        want = sum(q + 1 for q in range(s, SIZE)) / SIZE
        np.testing.assert_allclose(got, [want] * 3, rtol=1e-6, err_msg=f"step {s}")
    # everything works normally afterwards
    got = hvd.allgather(tf.constant([RANK]))
    assert got.numpy().tolist() == list(range(SIZE))


# --- Adasum --------------------------------------------------------------------------------------
def adasum_pair(a, b):
    dot = float(np.dot(a.ravel(), b.ravel()))
    na, nb = float(np.dot(a.ravel(), a.ravel())), float(np.dot(b.ravel(), b.ravel()))
    ca = 1.0 - dot / (2 * na) if na else 1.0
    cb = 1.0 - dot / (2 * nb) if nb else 1.0
    return ca * a + cb * b


def adasum_ref(vectors):
    level = list(vectors)
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def adasum_case(graph):
    """Global Adasum at 2 and 4 ranks; at 3 ranks on the 2-rank set of even ranks."""
    if SIZE == 3:
        ps, members = EVEN, EVEN.ranks
    else:
        ps, members = hvd.global_process_set, list(range(SIZE))
    if RANK not in members:
        return
    for dt, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        inputs = {q: rng("adasum", q, dt).standard_normal((4, 3)).astype(dt) for q in members}
        got = run(lambda t: hvd.allreduce(t, op=hvd.Adasum, process_set=ps), graph,
                  tf.constant(inputs[RANK]))
        want = adasum_ref([inputs[q].astype(np.float64) for q in members])
        assert got.dtype.as_numpy_dtype == dt
        np.testing.assert_allclose(got.numpy(), want, rtol=tol, atol=tol)


def adasum_errors():
    if SIZE & (SIZE - 1):
        # Horovod's class for Adasum on a number of ranks that is not a power of two
        for graph in (False, True):
            expect_raises(NotImplementedError, lambda: run(
                lambda t: hvd.allreduce(t, op=hvd.Adasum), graph, tf.ones([2])), "power")
            expect_raises(NotImplementedError, lambda: run(
                lambda t: hvd.grouped_allreduce([t], op=hvd.Adasum), graph, tf.ones([2])),
                "power")
        return
    x = tf.Variable(tf.ones([3]) * (RANK + 1))
    for graph in (False, True):
        def compute():
            with tf.GradientTape() as tape:
                y = hvd.allreduce(x, op=hvd.Adasum)
            return tape.gradient(y, x)
        expect_raises(NotImplementedError, lambda: run(compute, graph), "Adasum")
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
    expect_raises(NotImplementedError, lambda: hvd.allreduce(slices, op=hvd.Adasum), "Adasum")


# --- process sets --------------------------------------------------------------------------------
def my_set():
    return EVEN if RANK % 2 == 0 else ODD


def ps_ops(graph):
    ps = my_set()
    members = ps.ranks
    n, me = len(members), members.index(RANK)
    val = {q: ints("ps.ops", q, (n + 1, 2)) for q in members}
    x = tf.constant(val[RANK])
    splits = {q: [(members.index(q) + j) % 2 for j in range(n)] for q in members}
    xa = {q: ints("ps.a2a", q, (sum(splits[q]), 2)) for q in members}

    def body(t, ta):
        return (hvd.allreduce(t, op=hvd.Sum, process_set=ps),
                hvd.allreduce(t, process_set=ps),
                hvd.allgather(t, process_set=ps),
                hvd.broadcast(t, members[-1], process_set=ps),
                hvd.alltoall(ta, splits=splits[RANK], process_set=ps),
                hvd.reducescatter(t, op=hvd.Sum, process_set=ps),
                hvd.grouped_allgather([t, t[:1]], process_set=ps),
                hvd.grouped_allreduce([t, t * 2], op=hvd.Sum, process_set=ps),
                hvd.grouped_reducescatter([t], op=hvd.Sum, process_set=ps))

    s, avg, gat, bc, (a2a, rec), rs, gag, gar, grs = run(body, graph, x, tf.constant(xa[RANK]))
    total = np.sum([val[q] for q in members], axis=0)
    np.testing.assert_array_equal(s.numpy(), total)
    np.testing.assert_allclose(avg.numpy(), total / n, rtol=1e-6)
    np.testing.assert_array_equal(gat.numpy(), np.concatenate([val[q] for q in members]))
    np.testing.assert_array_equal(bc.numpy(), val[members[-1]])
    parts = []
    for q in members:
        off = offsets(splits[q])
        parts.append(xa[q][off[me]:off[me + 1]])
    np.testing.assert_array_equal(a2a.numpy().reshape(-1, 2), np.concatenate(parts))
    assert rec.numpy().tolist() == [splits[q][me] for q in members]
    off = offsets(split_rows(n + 1, n))
    np.testing.assert_array_equal(rs.numpy(), total[off[me]:off[me + 1]])
    np.testing.assert_array_equal(grs[0].numpy(), total[off[me]:off[me + 1]])
    np.testing.assert_array_equal(gag[1].numpy(), np.stack([val[q][0] for q in members]))
    np.testing.assert_array_equal(gar[1].numpy(), 2 * total)
    hvd.barrier(process_set=ps)
    if graph:
        tf.function(lambda: hvd.barrier(process_set=ps))()


def ps_graph_naming():
    """Only even ranks run set ops inside the function; the global op after them must still
    get the same trace-time name on every rank."""
    x = tf.constant([float(RANK)])

    @tf.function
    def f(t):
        if RANK % 2 == 0:
            hvd.allreduce(t, process_set=EVEN)
            hvd.allgather(t, process_set=EVEN)
        return hvd.allreduce(t, op=hvd.Sum)

    for _ in range(2):
        assert f(x).numpy().tolist() == [float(sum(range(SIZE)))]


def ps_errors():
    other = ODD if RANK % 2 == 0 else EVEN
    for graph in (False, True):
        expect_raises(ValueError, lambda: run(lambda t: hvd.allreduce(t, process_set=other),
                                              graph, tf.ones([2])), "not a member")
        expect_raises(ValueError, lambda: run(lambda t: hvd.alltoall(t, process_set=other),
                                              graph, tf.ones([2])), "not a member")
        outsider = [q for q in range(SIZE) if q not in my_set().ranks][0]
        expect_raises(ValueError, lambda: run(lambda t: hvd.broadcast(t, outsider,
                                                                      process_set=my_set()),
                                              graph, tf.ones([2])), "root_rank")
        expect_raises(ValueError, lambda: run(lambda t: hvd.allgather(
            t, process_set=hvd.ProcessSet([0])), graph, tf.ones([2])), "not registered")
    expect_raises(ValueError, lambda: hvd.broadcast(tf.ones([1]), SIZE), "root_rank")
    assert int(hvd.size_op()) == SIZE
    assert int(hvd.size_op(EVEN.process_set_id)) == len(EVEN.ranks)
    assert int(hvd.size_op(process_set_id=ODD.process_set_id)) == len(ODD.ranks)
    assert int(hvd.process_set_included_op(EVEN.process_set_id)) == int(RANK % 2 == 0)
    assert int(hvd.process_set_included_op(0)) == 1
    assert int(hvd.size_op(99)) == -3   # Horovod's code for an unknown process set
    assert hvd.get_process_set_ids_and_ranks()[EVEN.process_set_id] == EVEN.ranks


def ps_tape(graph):
    """DistributedGradientTape(process_set=EVEN): members average over EVEN, the others keep
    their local gradient."""
    v = tf.Variable(np.arange(3, dtype=np.float64))
    coef = {q: float(q + 1) for q in range(SIZE)}

    def compute():
        with tf.GradientTape() as tape:
            loss = coef[RANK] * tf.reduce_sum(v * v)
        tape = hvd.DistributedGradientTape(tape, process_set=EVEN)
        return tape.gradient(loss, [v])[0]

    got = run(compute, graph)
    base = 2 * np.arange(3, dtype=np.float64)
    if RANK in EVEN.ranks:
        want = base * np.mean([coef[q] for q in EVEN.ranks])
    else:
        want = base * coef[RANK]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


def ps_keras_optimizer():
    import keras
    v = keras.Variable(np.zeros(2, np.float32))
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0),
                                    process_set=EVEN, name="ps_keras")
    opt.apply([tf.constant([RANK + 1.0, 1.0])], [v])
    if RANK in EVEN.ranks:
        want = -np.array([np.mean([q + 1.0 for q in EVEN.ranks]), 1.0])
    else:
        want = -np.array([RANK + 1.0, 1.0])
    np.testing.assert_allclose(np.asarray(v.numpy()), want, rtol=1e-6)


def ps_join():
    ps = my_set()
    x = tf.fill([2], float(RANK + 1))
    idx = ps.ranks.index(RANK)
    got = [hvd.allreduce(x, op=hvd.Sum, process_set=ps, name="ps.join.step").numpy()
           for _ in range(idx + 1)]
    last = hvd.join(process_set=ps)
    assert int(last) == ps.ranks[-1], (int(last), ps.ranks)
    for s, g in enumerate(got):
        want = sum(q + 1 for q in ps.ranks[s:])
        assert g.tolist() == [want] * 2, (s, g)


def ps_dynamic():
    """Remove the odd set, check it is gone, register a new set with the same ranks."""
    global ODD
    old = ODD
    assert hvd.remove_process_set(old)
    if RANK % 2 == 1:
        expect_raises(ValueError, lambda: hvd.allreduce(tf.ones([1]), process_set=old),
                      "not registered")
    ODD = hvd.add_process_set([q for q in range(SIZE) if q % 2 == 1])
    assert ODD.process_set_id not in (None, 0, old.process_set_id), ODD
    if RANK % 2 == 1:
        for graph in (False, True):
            got = run(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=ODD), graph,
                      tf.ones([2]))
            assert got.numpy().tolist() == [float(len(ODD.ranks))] * 2
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy().tolist() == [SIZE]


# --- run -----------------------------------------------------------------------------------------
if MODE == "adasum":
    r.case("adasum.eager", adasum_case, False)
    r.case("adasum.graph", adasum_case, True)
    r.case("adasum.errors", adasum_errors)
else:
    for graph, mode in ((False, "eager"), (True, "graph")):
        r.case(f"alltoall.even.{mode}", alltoall_even, graph)
        r.case(f"alltoall.uneven.{mode}", alltoall_uneven, graph)
        r.case(f"alltoall.grad.{mode}", alltoall_grad, graph)
        r.case(f"reducescatter.ops.{mode}", reducescatter_ops, graph)
        r.case(f"reducescatter.grad.{mode}", reducescatter_grad, graph)
        r.case(f"grouped_allgather.{mode}", grouped_allgather, graph)
        r.case(f"grouped_allgather.grad.{mode}", grouped_allgather_grad, graph)
        r.case(f"grouped_reducescatter.{mode}", grouped_reducescatter, graph)
        r.case(f"grouped_reducescatter.grad.{mode}", grouped_reducescatter_grad, graph)
        r.case(f"grouped_allreduce.{mode}", grouped_allreduce, graph)
        r.case(f"grouped_allreduce.grad.{mode}", grouped_allreduce_grad, graph)
        r.case(f"grouped_allreduce.flat.{mode}", grouped_allreduce_flat, graph)
        r.case(f"join.{mode}", join_case, graph)
        r.case(f"adasum.{mode}", adasum_case, graph)
        r.case(f"process_set.ops.{mode}", ps_ops, graph)
        r.case(f"process_set.tape.{mode}", ps_tape, graph)
    r.case("alltoall.static_shapes", alltoall_static_shapes)
    r.case("alltoall.errors", alltoall_errors)
    r.case("reducescatter.static_shape", reducescatter_static_shape)
    r.case("reducescatter.errors", reducescatter_errors)
    r.case("adasum.errors", adasum_errors)
    r.case("process_set.graph_naming", ps_graph_naming)
    r.case("process_set.errors", ps_errors)
    r.case("process_set.keras_optimizer", ps_keras_optimizer)
    r.case("process_set.join", ps_join)
    r.case("process_set.dynamic", ps_dynamic)
r.write()
