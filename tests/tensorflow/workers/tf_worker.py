"""All ``hvdlite.tensorflow`` / ``.keras`` cases in one launch (TensorFlow's import is slow).

Every rank builds every rank's input locally and computes the expected result with numpy, so
the references do not depend on hvdlite.
"""
import os
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import ml_dtypes  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.keras as hvdk  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402
from tf_cases import DTYPES, KINDS, OTHER_CASES  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)

TF_DTYPES = {"bool": tf.bool, "uint8": tf.uint8, "int8": tf.int8, "int16": tf.int16,
             "int32": tf.int32, "int64": tf.int64, "float16": tf.float16,
             "bfloat16": tf.bfloat16, "float32": tf.float32, "float64": tf.float64}
NP_DTYPES = {k: (np.dtype(ml_dtypes.bfloat16) if k == "bfloat16" else np.dtype(k))
             for k in TF_DTYPES}
SHAPES = [(), (7,), (2, 3, 4), (0,)]
GATHER_ROWS_SHAPES = [(), (3,), (2, 2)]     # trailing shape; rows differ per rank


def seed(*parts):
    return zlib.crc32(repr(parts).encode())


def make(rank, dt, shape, kind):
    """Rank ``rank``'s input: small integers, exact in every dtype and free of overflow."""
    rng = np.random.default_rng(seed(rank, dt, shape, kind))
    if dt == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    lo = 0 if dt == "uint8" else -3
    if kind == "allreduce_Product":
        lo = 1 if dt == "uint8" else -2
        vals = rng.integers(lo, 3, size=shape)
    else:
        vals = rng.integers(lo, 4, size=shape)
    if dt.startswith(("float", "bfloat")):
        vals = vals / 2.0
    return vals.astype(NP_DTYPES[dt])


def reference(kind, dt, inputs):
    stack = np.stack([x.astype(np.float64) for x in inputs])
    if dt == "bool":
        b = np.stack(inputs)
        if kind in ("allreduce_Sum", "allreduce_Max"):
            return b.any(axis=0)
        return b.all(axis=0)
    op = kind.split("_")[1]
    if op == "Sum":
        out = stack.sum(0)
    elif op == "Average":
        out = stack.sum(0) / SIZE
        if NP_DTYPES[dt].kind in "iu":
            out = np.trunc(out)
    elif op == "Min":
        out = stack.min(0)
    elif op == "Max":
        out = stack.max(0)
    else:
        out = stack.prod(0)
    return out.astype(NP_DTYPES[dt])


def check_equal(got, want, dt, what):
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if dt in ("float16", "bfloat16", "float32", "float64"):
        tol = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}[dt]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                                   atol=tol, err_msg=what)
    else:
        assert np.array_equal(got, want), f"{what}: {got} != {want}"


def run_op(kind, tensors, names):
    out = []
    for t, n in zip(tensors, names):
        if kind.startswith("allreduce_"):
            op = getattr(hvd, kind.split("_")[1])
            out.append(hvd.allreduce(t, op=op, name=n))
        elif kind == "allgather":
            out.append(hvd.allgather(t, name=n))
        else:
            out.append(hvd.broadcast(t, SIZE - 1, name=n))
    return out


def op_case(mode, kind, dt):
    if kind == "allgather":
        shapes = [((RANK + 1),) + s for s in GATHER_ROWS_SHAPES] + [()]
        inputs = [[make(q, dt, ((q + 1),) + s, kind) for q in range(SIZE)]
                  for s in GATHER_ROWS_SHAPES]
        inputs.append([make(q, dt, (), kind) for q in range(SIZE)])      # scalar -> one row
        wants = [np.concatenate([x.reshape(-1, *x.shape[1:]) if x.ndim else x.reshape(1)
                                 for x in per]) for per in inputs]
    else:
        shapes = SHAPES
        inputs = [[make(q, dt, s, kind) for q in range(SIZE)] for s in shapes]
        if kind == "broadcast":
            wants = [per[SIZE - 1] for per in inputs]
        else:
            wants = [reference(kind, dt, per) for per in inputs]
    mine = [tf.constant(per[RANK], dtype=TF_DTYPES[dt]) for per in inputs]
    # Unnamed in graph mode (trace-time names); named eagerly half the time.
    names = [None if (mode == "graph" or i % 2) else f"{kind}.{dt}.{i}"
             for i in range(len(mine))]
    if mode == "eager":
        got = run_op(kind, mine, names)
    else:
        fn = tf.function(lambda *xs: run_op(kind, list(xs), names))
        got = fn(*mine)
        got2 = fn(*mine)    # second call: same graph, same (cached) names
        for a, b in zip(got, got2):
            assert np.array_equal(a.numpy(), b.numpy())
        if kind == "allgather":
            cf = fn.get_concrete_function(*mine)
            assert cf.structured_outputs[0].shape.as_list()[0] is None, "first dim not unknown"
    for g, w, x in zip(got, wants, mine):
        assert g.dtype == TF_DTYPES[dt], f"output dtype {g.dtype}"
        check_equal(g.numpy(), w, dt, f"{mode} {kind} {dt} shape {x.shape}")


for mode in ("eager", "graph"):
    for kind in KINDS:
        for dt in DTYPES:
            if dt == "bool" and kind == "allreduce_Average":
                continue
            r.case(f"ops.{mode}.{kind}.{dt}", op_case, mode, kind, dt)


def bool_average_rejected():
    try:
        hvd.allreduce(tf.constant([True, False]))
    except hvd.UnsupportedDtypeError as exc:
        assert "Average is not defined for bool" in str(exc), exc
    else:
        raise AssertionError("bool Average did not raise")


def unsupported_dtypes():
    for t in (tf.constant([1 + 2j], tf.complex64), tf.constant(["a"])):
        for fn in (lambda x: hvd.allreduce(x, op=hvd.Sum), hvd.allgather,
                   lambda x: hvd.broadcast(x, 0)):
            for graph in (False, True):
                try:
                    (tf.function(fn) if graph else fn)(t)
                except hvd.UnsupportedDtypeError as exc:
                    assert "does not support dtype" in str(exc), exc
                else:
                    raise AssertionError(f"{t.dtype} did not raise (graph={graph})")
    # still working afterwards
    assert hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist() == [SIZE] * 2


def scale_factors():
    x = [np.arange(5, dtype=np.float32) + q for q in range(SIZE)]
    want = (np.sum([v * 0.5 for v in x], axis=0) * 3.0).astype(np.float32)
    for graph in (False, True):
        f = lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
        got = (tf.function(f) if graph else f)(tf.constant(x[RANK]))
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    xi = [np.array([7, -7, 5], np.int32) * (q + 1) for q in range(SIZE)]
    got = hvd.allreduce(tf.constant(xi[RANK]), op=hvd.Average).numpy()
    assert got.tolist() == np.trunc(np.sum(xi, 0) / SIZE).astype(np.int32).tolist(), got
    # deprecated average= flag
    got = hvd.allreduce(tf.constant(x[RANK]), average=False).numpy()
    np.testing.assert_allclose(got, np.sum(x, 0))


def grouped_allreduce():
    xs = [[np.full((3,), q + 1, np.float32), np.full((2, 2), 2 * q, np.int64)]
          for q in range(SIZE)]
    for graph in (False, True):
        f = lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum)
        a, b = (tf.function(f) if graph else f)(*[tf.constant(v) for v in xs[RANK]])
        assert a.numpy().tolist() == [sum(q + 1 for q in range(SIZE))] * 3
        assert b.dtype == tf.int64
        assert b.numpy().tolist() == [[sum(2 * q for q in range(SIZE))] * 2] * 2
    a, b = hvd.grouped_allreduce([tf.ones([2]), tf.ones([3]) * RANK])
    np.testing.assert_allclose(b.numpy(), [np.mean(range(SIZE))] * 3)


def compression_fp16():
    x = [np.linspace(-1, 1, 9).astype(np.float32) * (q + 1) for q in range(SIZE)]
    got = hvd.allreduce(tf.constant(x[RANK]), compression=hvd.Compression.fp16)
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), np.mean(x, 0), rtol=2e-3, atol=2e-3)
    ints = hvd.allreduce(tf.constant([RANK], tf.int32), op=hvd.Sum,
                         compression=hvd.Compression.fp16)
    assert ints.dtype == tf.int32 and ints.numpy().tolist() == [sum(range(SIZE))]


def broadcast_variables():
    v1 = tf.Variable(np.full((3, 2), RANK, np.float32))
    v2 = tf.Variable(np.array([RANK, -RANK], np.int64))
    import keras
    kv = keras.Variable(np.full((4,), RANK + 0.5, np.float32))
    hvd.broadcast_variables([v1, v2, kv], root_rank=SIZE - 1)
    assert np.all(v1.numpy() == SIZE - 1)
    assert v2.numpy().tolist() == [SIZE - 1, -(SIZE - 1)]
    assert np.all(np.asarray(kv.numpy()) == SIZE - 0.5)
    w = tf.Variable(np.full((2,), RANK, np.float64))

    @tf.function
    def f():
        hvd.broadcast_variables([w], root_rank=0)
        return w.read_value()

    assert f().numpy().tolist() == [0.0, 0.0]


def broadcast_inplace():
    """hvd.broadcast_: assigns the root's values and returns them, eagerly and traced."""
    import keras
    v1 = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2) * (RANK + 1))
    kv = keras.Variable(np.array([RANK, 10 * RANK], np.int32))
    out = hvd.broadcast_([v1, kv], root_rank=SIZE - 1, name="bcast_inplace")
    want1 = np.arange(6, dtype=np.float32).reshape(3, 2) * SIZE
    want2 = [SIZE - 1, 10 * (SIZE - 1)]
    assert len(out) == 2 and isinstance(out[0], tf.Tensor)
    assert np.array_equal(out[0].numpy(), want1) and np.array_equal(v1.numpy(), want1)
    assert out[1].numpy().tolist() == want2 and np.asarray(kv.numpy()).tolist() == want2
    w = tf.Variable(np.zeros(3))   # a single variable, inside tf.function

    @tf.function
    def f():
        (value,) = hvd.broadcast_(w, root_rank=1)
        return value * 2

    for step in range(2):   # traced once, run twice: the root's fresh value each time
        w.assign(np.full(3, 100.0 * step + RANK))
        assert f().numpy().tolist() == [2 * (100.0 * step + 1)] * 3
        assert w.numpy().tolist() == [100.0 * step + 1] * 3
    assert hvd.broadcast_([], root_rank=0) == []
    try:
        hvd.broadcast_([w], root_rank=SIZE)
    except ValueError as exc:
        assert isinstance(exc, tf.errors.InvalidArgumentError), type(exc).__mro__
        assert "out of range" in str(exc), exc
    else:
        raise AssertionError("root_rank out of range was accepted")


def barrier_and_rank_ops():
    hvd.barrier()
    tf.function(lambda: hvd.barrier())()
    assert int(hvd.size_op()) == SIZE and int(hvd.rank_op()) == RANK
    assert int(hvd.local_size_op()) == SIZE and int(hvd.local_rank_op()) == RANK
    assert tf.function(lambda: hvd.rank_op() * 10)().numpy() == RANK * 10


def objects():
    obj = hvd.broadcast_object({"rank": RANK, "fn": "x"} if RANK == 1 else None, root_rank=1)
    assert obj == {"rank": 1, "fn": "x"}
    assert hvd.allgather_object((RANK, "r")) == [(q, "r") for q in range(SIZE)]


def graph_retrace_names():
    """One function traced for two shapes, called alternately: names stay consistent."""
    @tf.function
    def f(x):
        return hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x)

    for n in (2, 3, 2, 3):
        a, g = f(tf.ones([n]) * (RANK + 1))
        assert a.numpy().tolist() == [SIZE * (SIZE + 1) / 2] * n
        assert g.shape[0] == SIZE * n


for name, fn in [("ops.bool_average_rejected", bool_average_rejected),
                 ("ops.unsupported_dtypes", unsupported_dtypes),
                 ("ops.scale_factors", scale_factors),
                 ("ops.grouped_allreduce", grouped_allreduce),
                 ("ops.compression_fp16", compression_fp16),
                 ("ops.broadcast_variables", broadcast_variables),
                 ("ops.broadcast_inplace", broadcast_inplace),
                 ("ops.barrier_and_rank_ops", barrier_and_rank_ops),
                 ("ops.objects", objects),
                 ("ops.graph_retrace_names", graph_retrace_names)]:
    r.case(name, fn)


# --- gradients ---------------------------------------------------------------------------------
def grads_of(graph):
    """d/dx of several losses through each op, against hand-derived references."""
    x = tf.Variable(np.arange(4, dtype=np.float64) + RANK)
    w_all = [np.arange(4, dtype=np.float64) * (q + 1) for q in range(SIZE)]   # upstream per rank
    w = tf.constant(w_all[RANK])
    wg_all = [np.arange(4 * SIZE, dtype=np.float64) + q for q in range(SIZE)]
    wg = tf.constant(wg_all[RANK])

    def compute():
        out = {}
        for label, fwd in [("avg", lambda: hvd.allreduce(x, op=hvd.Average)),
                           ("sum", lambda: hvd.allreduce(x, op=hvd.Sum)),
                           ("scaled", lambda: hvd.allreduce(x, op=hvd.Sum,
                                                            prescale_factor=2.0)),
                           ("bcast", lambda: hvd.broadcast(x, 1)),
                           ]:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(fwd() * w)
            out[label] = tape.gradient(loss, x)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allgather(x) * wg)
        out["gather"] = tape.gradient(loss, x)
        return out

    got = tf.function(compute)() if graph else compute()
    wsum = np.sum(w_all, 0)
    # Horovod's gradients: broadcast and allgather average the upstream gradient over ranks
    # (the broadcast's non-root ranks get zeros), allreduce repeats its own op.
    expect = {"avg": wsum / SIZE, "sum": wsum, "scaled": 2.0 * wsum,
              "bcast": wsum / SIZE if RANK == 1 else np.zeros(4),
              "gather": (np.sum(wg_all, 0) / SIZE)[4 * RANK:4 * RANK + 4]}
    for k, v in expect.items():
        np.testing.assert_allclose(got[k].numpy(), v, rtol=1e-12, err_msg=k)


r.case("grad.eager", grads_of, False)
r.case("grad.graph", grads_of, True)


# --- errors ------------------------------------------------------------------------------------
def mismatch(graph):
    t = tf.ones([RANK + 2])
    f = lambda x: hvd.allreduce(x, name=f"mismatch.{graph}")
    try:
        (tf.function(f) if graph else f)(t)
    except hvd.TensorMismatchError as exc:
        # Eagerly: Horovod's class, also hvdlite's
        assert not graph, "graph mode should wrap the error"
        assert isinstance(exc, tf.errors.FailedPreconditionError), type(exc).__mro__
        msg = exc.message
    except tf.errors.OpError as exc:
        assert graph, f"eager mode raised {type(exc).__mro__}: {exc}"
        msg = exc.message
    else:
        raise AssertionError("mismatched shapes did not raise")
    assert f"Mismatched shape for tensor 'mismatch.{graph}'" in msg, msg
    assert "disagree with rank 0" in msg, msg
    ok = (tf.function(f) if graph else f)(tf.ones([3]) * RANK)
    np.testing.assert_allclose(ok.numpy(), [np.mean(range(SIZE))] * 3)


r.case("errors.mismatch_eager", mismatch, False)
r.case("errors.mismatch_graph", mismatch, True)


# --- DistributedGradientTape -------------------------------------------------------------------
def tape_sparse():
    emb = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
    ids = [np.array([q % 6, (q + 2) % 6]) for q in range(SIZE)]
    want = np.zeros((6, 2), np.float32)
    for q in range(SIZE):
        for i in ids[q]:
            want[i] += 1.0 / SIZE
    for sad in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, ids[RANK]))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sad)
        (g,) = tape.gradient(loss, [emb])
        assert isinstance(g, tf.IndexedSlices) != sad, type(g)
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), want, rtol=1e-6)


r.case("tape.sparse", tape_sparse)

DATA_RNG = np.random.default_rng(7)
X_ALL = DATA_RNG.normal(size=(SIZE * 8, 5)).astype(np.float32)
Y_ALL = DATA_RNG.normal(size=(SIZE * 8, 1)).astype(np.float32)


def init_weights():
    rng = np.random.default_rng(11)
    return [rng.normal(size=(5, 4)).astype(np.float32), np.zeros(4, np.float32),
            rng.normal(size=(4, 1)).astype(np.float32)]


def forward(ws, x):
    return tf.matmul(tf.tanh(tf.matmul(x, ws[0]) + ws[1]), ws[2])


def train(ws, x, y, distributed, graph, steps=3, lr=0.1):
    variables = [tf.Variable(w) for w in ws]
    if distributed and RANK != 0:   # different start; the broadcast below fixes it
        for v in variables:
            v.assign(v + 1.0)
    if distributed:
        if graph:
            @tf.function
            def bcast():
                hvd.broadcast_variables(variables, root_rank=0)

            bcast()
        else:
            hvd.broadcast_variables(variables, root_rank=0)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((forward(variables, x) - y) ** 2)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(lr * g)
        return loss

    stepper = tf.function(step) if graph else step
    for i in range(steps):
        stepper()
    return [v.numpy() for v in variables]


def tape_matches_reference(graph):
    ws = init_weights()
    shard = slice(RANK * 8, (RANK + 1) * 8)
    # reference: one process, the concatenated batch, rank 0's initial weights
    ref = train(ws, X_ALL, Y_ALL, False, False)
    got = train(ws, X_ALL[shard], Y_ALL[shard], True, graph)
    for g, w in zip(got, ref):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    flat = np.concatenate([g.ravel() for g in got])
    everyone = hvd.allgather(tf.constant(flat[None])).numpy()
    assert all(np.array_equal(everyone[0], row) for row in everyone), "ranks differ"


r.case("tape.train_matches_reference_eager", tape_matches_reference, False)
r.case("tape.train_matches_reference_graph", tape_matches_reference, True)


def steady_state_memory():
    """A training step in tf.function reuses its gradients' result memory from the previous
    step: the engine keeps no reference to a finished group's arrays, so they are released by
    reference counting alone (checked with Python's cyclic collector off, as inside timeit).
    Otherwise every step's large results are fresh memory, page-faulted again."""
    import gc
    from hvdlite.common.memory import result_pool
    w = tf.Variable(tf.fill([512, 512], 0.01))          # 1 MiB gradient: a pooled result
    b = tf.Variable(tf.zeros([512]))
    x = tf.fill([4, 512], float(RANK + 1))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) + b)
        tape = hvd.DistributedGradientTape(tape)
        for v, g in zip((w, b), tape.gradient(loss, [w, b])):
            v.assign_sub(0.001 * g)

    pool = result_pool()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            step()
        misses = pool.misses
        for _ in range(10):
            step()
        fresh = pool.misses - misses
    finally:
        gc.enable()
    assert fresh == 0, f"{fresh} of 10 steady-state steps allocated fresh result memory"


r.case("tape.steady_state_reuses_result_memory", steady_state_memory)

import keras  # noqa: E402


def backward_passes():
    for graph in (False, True):
        v = keras.Variable(np.zeros(3, np.float32))
        opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0),
                                        backward_passes_per_step=2,
                                        name=f"bpps{graph}")
        g1 = [np.array([1, 2, 3], np.float32) * (q + 1) for q in range(SIZE)]
        g2 = [np.array([0.5, 0, -1], np.float32) * (q + 1) for q in range(SIZE)]

        def apply(g):
            opt.apply([tf.convert_to_tensor(g)], [v])

        app = tf.function(apply) if graph else apply
        app(g1[RANK])
        assert np.all(np.asarray(v.numpy()) == 0), f"applied after one pass: {v.numpy()}"
        app(g2[RANK])
        want = -np.mean([a + b for a, b in zip(g1, g2)], axis=0)
        np.testing.assert_allclose(np.asarray(v.numpy()), want, rtol=1e-6)
        app(g1[RANK])
        np.testing.assert_allclose(np.asarray(v.numpy()), want, rtol=1e-6)


r.case("optimizer.backward_passes_per_step", backward_passes)


def metric_average():
    cb = hvdk.callbacks.MetricAverageCallback()
    logs = {"loss": float(RANK), "accuracy": 2.0 * RANK + 1, "val_loss": np.float32(RANK * 3)}
    cb.on_epoch_end(0, logs)
    m = np.mean(range(SIZE))
    np.testing.assert_allclose([logs["loss"], logs["accuracy"], logs["val_loss"]],
                               [m, 2 * m + 1, 3 * m])


r.case("keras.metric_average_callback", metric_average)


def keras_model(seed_):
    keras.utils.set_random_seed(seed_)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1)])


def fit_end_to_end():
    model = keras_model(100 + RANK)      # different initial weights on every rank
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05, momentum=0.5))
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    shard = slice(RANK * 8, (RANK + 1) * 8)
    x, y = X_ALL[shard], Y_ALL[shard] + RANK       # per-rank loss differs
    hist = model.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False,
                     callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                                hvdk.callbacks.MetricAverageCallback()])
    flat = np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])
    everyone = hvd.allgather(tf.constant(flat[None])).numpy()
    assert all(np.array_equal(everyone[0], row) for row in everyone), "weights differ"
    losses = np.array(hist.history["loss"])
    all_losses = hvd.allgather(tf.constant(losses[None])).numpy()
    assert all(np.array_equal(all_losses[0], row) for row in all_losses), \
        f"History not averaged: {all_losses}"
    opt_vars = np.concatenate([np.asarray(v.numpy()).ravel() for v in opt.variables])
    everyone = hvd.allgather(tf.constant(opt_vars[None].astype(np.float64))).numpy()
    assert all(np.array_equal(everyone[0], row) for row in everyone), "optimizer state differs"
    assert int(opt.iterations.numpy()) == 6, opt.iterations


r.case("keras.fit_end_to_end", fit_end_to_end)


def load_model_case():
    import tempfile
    model = keras_model(7 + RANK)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(X_ALL[:8], Y_ALL[:8], epochs=1, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.keras")
        model.save(path)
        plain = keras.models.load_model(path)         # loads without hvdlite's classes
        assert type(plain.optimizer) is keras.optimizers.Adam, type(plain.optimizer)
        loaded = hvdk.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    shard = slice(RANK * 8, (RANK + 1) * 8)
    loaded.fit(X_ALL[shard], Y_ALL[shard], epochs=1, verbose=0)   # different data per rank
    flat = np.concatenate([np.asarray(w).ravel() for w in loaded.get_weights()])
    everyone = hvd.allgather(tf.constant(flat[None])).numpy()
    assert all(np.array_equal(everyone[0], row) for row in everyone), "weights differ"


r.case("keras.load_model", load_model_case)


class LRRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate.numpy())))


def warmup_schedule():
    model = keras_model(5)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    rec = LRRecorder()
    x, y = X_ALL[:8], Y_ALL[:8]
    spe, warm, init_lr = 4, 2, 0.4
    hist = model.fit(x, y, batch_size=2, epochs=3, verbose=0, shuffle=False,
                     callbacks=[hvdk.callbacks.LearningRateWarmupCallback(
                         init_lr, warmup_epochs=warm, verbose=0), rec])
    want = []
    for epoch in range(3):
        for batch in range(spe):
            if epoch >= warm:
                want.append(want[-1])
                continue
            e = epoch + batch / spe + 1.0 / spe
            want.append(init_lr / SIZE * (e * (SIZE - 1) / warm + 1))
    np.testing.assert_allclose(rec.lrs, want, rtol=1e-6)
    np.testing.assert_allclose(want[2 * spe - 1], init_lr, rtol=1e-6)
    assert "lr" in hist.history


def schedule_callback():
    model = keras_model(6)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    rec = LRRecorder()
    cbs = [hvdk.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1, end_epoch=2),
           hvdk.callbacks.LearningRateScheduleCallback(0.2, lambda e: 0.25, start_epoch=2), rec]
    model.fit(X_ALL[:4], Y_ALL[:4], batch_size=2, epochs=3, verbose=0, callbacks=cbs)
    np.testing.assert_allclose(rec.lrs, [0.1, 0.1, 0.1, 0.1, 0.05, 0.05], rtol=1e-6)


r.case("keras.warmup_schedule", warmup_schedule)
r.case("keras.schedule_callback", schedule_callback)


def mixed():
    import torch
    import hvdlite.torch as hvdt
    assert hvdt.size() == SIZE and hvdt.rank() == RANK
    hvdt.init()     # no-op: the same core as hvdlite.tensorflow
    a = hvdt.allreduce(torch.full((3,), float(RANK)), op=hvdt.Sum, name="mixed.torch")
    b = hvd.allreduce(tf.fill([3], float(RANK)), op=hvd.Sum, name="mixed.tf")
    h = hvdt.allreduce_async(torch.ones(2) * RANK, op=hvdt.Max)
    c = hvd.allgather(tf.constant([RANK]))
    d = hvdt.synchronize(h)
    s = sum(range(SIZE))
    assert a.tolist() == [s] * 3 and b.numpy().tolist() == [s] * 3
    assert c.numpy().tolist() == list(range(SIZE)) and d.tolist() == [SIZE - 1] * 2


r.case("mixed.torch_and_tf", mixed)

missing = [c for c in OTHER_CASES if c not in r.results]
assert not missing, missing
r.write()
