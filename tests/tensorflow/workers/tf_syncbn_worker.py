"""hvdlite.tensorflow SyncBatchNormalization on every rank, checked against one plain
``keras.layers.BatchNormalization`` applied to the concatenation of all ranks' batches.

Every rank builds every rank's (often differently sized) batch, so besides running the layer on
its own batch it runs the reference on the whole batch and compares: its slice of the output and
of the input gradient, the moving statistics, and the gamma/beta gradients summed over ranks.
The upstream gradient is random (the gradient of ``out.sum()`` through batch norm is zero).
Runs under mpiexec (2, 3 ranks) and without it (one rank, tests/tensorflow/test_syncbn_one_rank.py).
"""
import os
import tempfile
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

from hvdlite.common import core as core_ops  # noqa: E402 - the door the adapters call
import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.keras as hvdk  # noqa: E402
from hvdlite.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402
from tf_syncbn_cases import cases_for  # noqa: E402

hvd.init()
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = hvd.rank(), hvd.size()
TOL = {"float64": dict(rtol=1e-10, atol=1e-10), "float32": dict(rtol=2e-5, atol=2e-5)}


class SyncedReporter(Reporter):
    """Every case ends with a barrier, so one rank's failure cannot shift the next case."""

    def case(self, name, fn, *args, **kwargs):
        super().case(name, fn, *args, **kwargs)
        COMM.Barrier()


r = SyncedReporter(RANK)


# --- inputs and references -----------------------------------------------------------------
def seed(*parts):
    return zlib.crc32(repr(parts).encode())


def rng(*parts):
    return np.random.default_rng(seed(*parts))


def equal_rows(k):
    return 4


def unequal_rows(k):
    return k + 1


def empty_first_rows(k):
    return 0 if (k == 0 and SIZE > 1) else k + 2


def batches(case, step, rows_of, trailing, dtype="float64", shift=0.5):
    """Every rank's batch (list, rank order): (rows_of(k), *trailing) values ~ N(shift, 2)."""
    return [(rng(case, step, k).normal(size=(rows_of(k),) + tuple(trailing)) * 2.0 + shift)
            .astype(dtype) for k in range(SIZE)]


def mine(parts):
    return parts[RANK]


def my_slice(whole, rows):
    """This rank's rows of an array laid out as the concatenation of the ranks' batches."""
    start = sum(rows[:RANK])
    return whole[start:start + rows[RANK]]


def make_pair(case, channels, ndim, dtype="float64", **kwargs):
    """(SyncBatchNormalization, plain BatchNormalization) built alike, with the same random
    gamma/beta (so that their gradients are not trivial) and non-trivial moving statistics."""
    sync = SyncBatchNormalization(dtype=dtype, **kwargs)
    ref = keras.layers.BatchNormalization(dtype=dtype, **kwargs)
    axis = kwargs.get("axis", -1)
    shape = [None] + [2] * (ndim - 1)
    shape[axis] = channels
    g = rng(case, "affine")
    weights = [g.uniform(0.5, 1.5, channels), g.normal(size=channels),
               g.normal(size=channels), g.uniform(0.5, 2.0, channels)]
    for layer in (sync, ref):
        layer.build(tuple(shape))
        layer.set_weights([w.astype(dtype) for w in weights] + layer.get_weights()[4:])
    return sync, ref


def channels_of(trailing, axis):
    return ((None,) + tuple(trailing))[axis]


def close(got, want, dtype, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), err_msg=what, **TOL[dtype])


def gathered_rows(value):
    """Every rank's copy of ``value`` (one row each), for checking they are identical."""
    return hvd.allgather(tf.constant(np.asarray(value, dtype=np.float64).reshape(1, -1))).numpy()


def check_same_on_all_ranks(value, what):
    everyone = gathered_rows(value)
    assert all(np.array_equal(everyone[0], row) for row in everyone), f"{what} differ: {everyone}"


def check_moving(sync, ref, dtype, what=""):
    close(sync.moving_mean.numpy(), ref.moving_mean.numpy(), dtype, f"moving_mean {what}")
    close(sync.moving_variance.numpy(), ref.moving_variance.numpy(), dtype,
          f"moving_variance {what}")
    check_same_on_all_ranks(np.concatenate([sync.moving_mean.numpy(),
                                            sync.moving_variance.numpy()]), "moving statistics")


def numpy_bn(x, gamma, beta, eps, axis=-1):
    """Training-mode batch norm in numpy (float64): the definition, independent of Keras."""
    x = np.asarray(x, np.float64)
    axes = tuple(i for i in range(x.ndim) if i != axis % x.ndim)
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    shape = [1] * x.ndim
    shape[axis] = -1
    return (x - mean) / np.sqrt(var + eps) * gamma.reshape(shape) + beta.reshape(shape)


def forward_check(case, rows_of, graph, dtype="float64", trailing=(3,), axis=-1):
    xs = batches(case, 0, rows_of, trailing, dtype)
    rows = [x.shape[0] for x in xs]
    sync, ref = make_pair(case, channels_of(trailing, axis), len(trailing) + 1, dtype, axis=axis)
    call = tf.function(lambda x: sync(x, training=True)) if graph else \
        (lambda x: sync(x, training=True))
    out = call(tf.constant(mine(xs))).numpy()
    whole = np.concatenate(xs)
    want = ref(tf.constant(whole), training=True).numpy()
    assert out.shape == mine(xs).shape and out.dtype == np.dtype(dtype), (out.shape, out.dtype)
    close(out, my_slice(want, rows), dtype, "output vs Keras BatchNormalization")
    by_def = numpy_bn(whole, sync.gamma.numpy(), sync.beta.numpy(), sync.epsilon, axis)
    close(out, my_slice(by_def, rows), dtype, "output vs the numpy definition")
    check_moving(sync, ref, dtype)


# --- forward ---------------------------------------------------------------------------------
r.case("forward.eager.equal", forward_check, "fe", equal_rows, False)
r.case("forward.graph.equal", forward_check, "fg", equal_rows, True)
r.case("forward.eager.unequal", forward_check, "fu", unequal_rows, False)
r.case("forward.graph.unequal", forward_check, "fgu", unequal_rows, True)
r.case("forward.float32.unequal", forward_check, "f32", unequal_rows, False, "float32")
r.case("forward.empty_rank", forward_check, "empty", empty_first_rows, True)


def all_ranks_empty():
    sync, _ = make_pair("allempty", 3, 2)
    before = [sync.moving_mean.numpy().copy(), sync.moving_variance.numpy().copy()]
    out = sync(tf.zeros((0, 3), tf.float64), training=True)
    assert out.shape == (0, 3), out.shape
    np.testing.assert_allclose(sync.moving_mean.numpy(), before[0], rtol=1e-15)
    np.testing.assert_allclose(sync.moving_variance.numpy(), before[1], rtol=1e-15)


if SIZE > 1:
    r.case("forward.all_ranks_empty", all_ranks_empty)


def masked():
    """Keras' ``mask`` (one dimension less than the input): masked-out elements are left out of
    the statistics of every rank."""
    xs = batches("mask", 0, unequal_rows, (5, 3))
    masks = [rng("mask", "m", k).random((x.shape[0], 5)) < 0.6 for k, x in enumerate(xs)]
    rows = [x.shape[0] for x in xs]
    sync, ref = make_pair("mask", 3, 3)
    dy = rng("mask", "dy").normal(size=(sum(rows), 5, 3))
    x = tf.constant(mine(xs))
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = sync(x, training=True, mask=tf.constant(mine(masks)))
        loss = tf.reduce_sum(out * my_slice(dy, rows))
    dx = tape.gradient(loss, x)
    whole = tf.constant(np.concatenate(xs))
    with tf.GradientTape() as tape:
        tape.watch(whole)
        want = ref(whole, training=True, mask=tf.constant(np.concatenate(masks)))
        ref_loss = tf.reduce_sum(want * dy)
    ref_dx = tape.gradient(ref_loss, whole)
    close(out, my_slice(want.numpy(), rows), "float64", "masked output")
    close(dx, my_slice(ref_dx.numpy(), rows), "float64", "masked input gradient")
    check_moving(sync, ref, "float64")


r.case("forward.mask", masked)


def renorm():
    sync, ref = make_pair("renorm", 3, 2, renorm=True, renorm_clipping={"rmax": 1.5, "dmax": 1})
    for step in range(3):
        xs = batches("renorm", step, unequal_rows, (3,), shift=0.5 * step)
        out = sync(tf.constant(mine(xs)), training=True).numpy()
        want = ref(tf.constant(np.concatenate(xs)), training=True).numpy()
        close(out, my_slice(want, [x.shape[0] for x in xs]), "float64", f"step {step}")
    check_moving(sync, ref, "float64")
    close(sync.renorm_stddev.numpy(), ref.renorm_stddev.numpy(), "float64", "renorm_stddev")


r.case("forward.renorm", renorm)


# --- moving statistics over several steps --------------------------------------------------
def moving_stats(graph):
    sync, ref = make_pair("moving", 3, 2, momentum=0.7)
    call = tf.function(lambda x: sync(x, training=True)) if graph else \
        (lambda x: sync(x, training=True))
    for step in range(4):
        xs = batches("moving", step, unequal_rows, (3,), shift=float(step))
        call(tf.constant(mine(xs)))
        ref(tf.constant(np.concatenate(xs)), training=True)
        check_moving(sync, ref, "float64", f"after step {step}")
    # and the moving statistics are what inference uses
    x = tf.constant(batches("moving", 9, unequal_rows, (3,))[RANK])
    close(sync(x, training=False), ref(x, training=False), "float64", "inference output")


r.case("moving_stats.eager", moving_stats, False)
r.case("moving_stats.graph", moving_stats, True)


# --- gradients -----------------------------------------------------------------------------
def grads_check(case, graph, trailing, axis=-1, rows_of=unequal_rows):
    """Input, gamma and beta gradients against the reference on the concatenated batch with
    loss = sum over ranks of sum(out * dy); gamma/beta gradients are summed over the ranks."""
    xs = batches(case, 0, rows_of, trailing)
    rows = [x.shape[0] for x in xs]
    sync, ref = make_pair(case, channels_of(trailing, axis), len(trailing) + 1, axis=axis)
    dy = rng(case, "dy").normal(size=(sum(rows),) + tuple(trailing))

    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = sync(x, training=True)
            loss = tf.reduce_sum(out * upstream)
        return [out] + tape.gradient(loss, [x, sync.gamma, sync.beta])

    fn = tf.function(step) if graph else step
    out, dx, dgamma, dbeta = fn(tf.constant(mine(xs)), tf.constant(my_slice(dy, rows)))
    whole = tf.constant(np.concatenate(xs))
    with tf.GradientTape() as tape:
        tape.watch(whole)
        want = ref(whole, training=True)
        ref_loss = tf.reduce_sum(want * dy)
    ref_dx, ref_dgamma, ref_dbeta = tape.gradient(ref_loss, [whole, ref.gamma, ref.beta])
    close(out, my_slice(want.numpy(), rows), "float64", "output")
    close(dx, my_slice(ref_dx.numpy(), rows), "float64", "input gradient")
    close(hvd.allreduce(dgamma, op=hvd.Sum), ref_dgamma, "float64", "gamma gradient (summed)")
    close(hvd.allreduce(dbeta, op=hvd.Sum), ref_dbeta, "float64", "beta gradient (summed)")
    check_moving(sync, ref, "float64")


r.case("grads.eager", grads_check, "ge", False, (3,))
r.case("grads.graph", grads_check, "gg", True, (3,))
r.case("conv4d.nhwc_axis_last", grads_check, "nhwc", True, (3, 4, 2), -1)
r.case("conv4d.nchw_axis1", grads_check, "nchw", False, (3, 2, 2), 1)


# --- collectives ---------------------------------------------------------------------------
class CountSubmits:
    """Records the name of every operation submitted to the core (eager or graph)."""

    def __enter__(self):
        self.names = []
        self._orig = core_ops.submit

        def counting(kind, array, *args, **kwargs):
            self.names.append(kwargs.get("name"))
            return self._orig(kind, array, *args, **kwargs)

        core_ops.submit = counting
        return self

    def __exit__(self, *exc):
        core_ops.submit = self._orig


def inference_no_collective():
    sync, ref = make_pair("infer", 3, 2)
    sync(tf.constant(batches("infer", 0, equal_rows, (3,))[RANK]), training=True)  # train once
    ref.set_weights(sync.get_weights())
    x = tf.constant(batches("infer", 1, unequal_rows, (3,))[RANK])
    frozen = tf.function(lambda t: sync(t, training=False))
    with CountSubmits() as count:
        out = sync(x, training=False)
        default = sync(x)                 # training defaults to inference
        traced = frozen(x)
        sync.trainable = False            # Keras: a frozen BN layer runs in inference mode
        frozen_out = sync(x, training=True)
        sync.trainable = True
    assert count.names == [], f"inference submitted collectives: {count.names}"
    want = ref(x, training=False)
    for got, what in [(out, "eager"), (default, "default"), (traced, "graph"),
                      (frozen_out, "trainable=False")]:
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=what)
    if RANK == 0:   # a collective here would stall (and fail after STALL_SAFETY_NET_ENV's 60 s)
        np.testing.assert_array_equal(sync(x, training=False).numpy(), want.numpy())


r.case("inference.no_collective", inference_no_collective)


def one_forward_one_backward():
    sync, _ = make_pair("count", 3, 2)
    x = tf.constant(batches("count", 0, unequal_rows, (3,))[RANK])
    dy = tf.ones_like(x) * tf.range(1.0, 4.0, dtype=tf.float64)
    with CountSubmits() as fwd, tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(sync(x, training=True) * dy)
    with CountSubmits() as bwd:
        tape.gradient(loss, [x, sync.gamma, sync.beta])
    if SIZE == 1:
        assert fwd.names == [] and bwd.names == [], (fwd.names, bwd.names)
        return
    assert len(fwd.names) == 1, fwd.names
    name = fwd.names[0]
    assert name.startswith("sync_batch_normalization.tf."), name
    assert bwd.names == [name + ".grad"], bwd.names

    @tf.function
    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(sync(t, training=True) * dy)
        return tape.gradient(loss, t)

    for _ in range(2):      # the same name in every call and in every traced graph
        with CountSubmits() as both:
            step(x)
        assert both.names == [name, name + ".grad"], both.names
    check_same_on_all_ranks([float(name.rsplit(".", 1)[1])], "collective names")


r.case("collectives.one_forward_one_backward", one_forward_one_backward)


# --- API -----------------------------------------------------------------------------------
def synchronized_argument():
    xs = batches("syncarg", 0, unequal_rows, (3,))
    rows = [x.shape[0] for x in xs]
    plain, ref = make_pair("syncarg", 3, 2)
    flagged, _ = make_pair("syncarg", 3, 2, synchronized=True)
    assert flagged.synchronized is False and flagged.get_config()["synchronized"] is False
    want = my_slice(ref(tf.constant(np.concatenate(xs)), training=True).numpy(), rows)
    for layer in (plain, flagged):
        close(layer(tf.constant(mine(xs)), training=True), want, "float64", "output")
    check_moving(flagged, ref, "float64")


r.case("api.synchronized_argument", synchronized_argument)


def fused_argument():
    for bad in (True, None):
        try:
            SyncBatchNormalization(fused=bad)
        except ValueError as exc:
            assert "fused" in str(exc), exc
        else:
            raise AssertionError(f"fused={bad} was accepted")
    layer = SyncBatchNormalization(fused=False, axis=1)
    assert layer.axis == 1 and "fused" not in layer.get_config()


r.case("api.fused_argument", fused_argument)


def keras_layer_config_save_load():
    assert hvd.SyncBatchNormalization is SyncBatchNormalization
    a, b = SyncBatchNormalization(), SyncBatchNormalization()
    assert isinstance(a, keras.layers.BatchNormalization)
    assert a.name.startswith("sync_batch_normalization") and a.name != b.name, (a.name, b.name)
    clone = SyncBatchNormalization.from_config(
        SyncBatchNormalization(momentum=0.5, epsilon=0.01, axis=1).get_config())
    assert (clone.momentum, clone.epsilon, clone.axis) == (0.5, 0.01, 1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              SyncBatchNormalization(momentum=0.5)])
    x = batches("save", 0, equal_rows, (4,), "float32")[RANK]
    model(x, training=True)   # moving statistics move away from their initial values
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path)   # no custom_objects: registered serializable
    assert type(loaded.layers[-1]) is SyncBatchNormalization, type(loaded.layers[-1])
    for w, v in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(w, v)
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())


r.case("api.keras_layer_config_save_load", keras_layer_config_save_load)


# --- model.fit -------------------------------------------------------------------------------
def fit_model(bn_class):
    keras.utils.set_random_seed(1234)    # the same initial weights for every model, every rank
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6), bn_class(momentum=0.8),
                             keras.layers.Activation("tanh"), keras.layers.Dense(1)])


def fit_distributed_optimizer():
    """model.fit on every rank's shard with DistributedOptimizer equals one process training
    plain BatchNormalization on the global batch (the concatenation of the ranks' batches): the
    synchronised statistics and their backward allreduce make each step's averaged gradient the
    gradient of the global mean loss."""
    batch, steps, epochs = 4, 3, 2
    g = rng("fit")
    data_x = g.normal(size=(SIZE, steps * batch, 4)).astype("float32") + 1.0
    data_y = (data_x.sum(-1, keepdims=True) ** 2 / 4).astype("float32")
    model = fit_model(SyncBatchNormalization)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5)),
                  loss="mse")
    model.fit(data_x[RANK], data_y[RANK], batch_size=batch, epochs=epochs, shuffle=False,
              verbose=0, callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    weights = model.get_weights()
    check_same_on_all_ranks(np.concatenate([w.ravel() for w in weights]),
                            "weights and moving statistics")

    # reference: step s sees the concatenation of every rank's s-th batch
    glob_x = data_x.reshape(SIZE, steps, batch, 4).transpose(1, 0, 2, 3).reshape(-1, 4)
    glob_y = data_y.reshape(SIZE, steps, batch, 1).transpose(1, 0, 2, 3).reshape(-1, 1)
    ref = fit_model(keras.layers.BatchNormalization)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    ref.fit(glob_x, glob_y, batch_size=batch * SIZE, epochs=epochs, shuffle=False, verbose=0)
    names = [w.path for w in model.weights]
    for name, got, want in zip(names, weights, ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    moving = [i for i, name in enumerate(names) if name.endswith("moving_mean")]
    assert len(moving) == 1 and not np.allclose(weights[moving[0]], 0.0), "moving_mean unused"


r.case("fit.distributed_optimizer", fit_distributed_optimizer)


# --- one rank: exactly Keras' layer ---------------------------------------------------------
def identical_to_keras():
    sync, ref = make_pair("single", 3, 3)
    for step in range(2):
        x = tf.constant(batches("single", step, unequal_rows, (2, 3))[0])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            got, want = sync(x, training=True), ref(x, training=True)
            a, b = tf.reduce_sum(got * got * x), tf.reduce_sum(want * want * x)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        np.testing.assert_array_equal(tape.gradient(a, x).numpy(), tape.gradient(b, x).numpy())
    for w, v in zip(sync.get_weights(), ref.get_weights()):
        np.testing.assert_array_equal(w, v)


if SIZE == 1:
    r.case("single_rank.identical_to_keras", identical_to_keras)

expected = cases_for(SIZE)
assert sorted(r.results) == sorted(expected), (sorted(set(expected) - set(r.results)),
                                               sorted(set(r.results) - set(expected)))
r.write()
