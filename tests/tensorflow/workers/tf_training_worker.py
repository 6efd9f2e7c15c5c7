"""TF / Keras training setups whose correctness depends on every rank taking the same decision.

Keras mixed precision: a LossScaleOptimizer skips a step when gradients overflow.  Rank 0's
data overflows float16 in the first steps while the other ranks' data never does, so a rank
that decided from its own gradients would skip different steps than the others (and, with
hvdlite's reduction inside the skipped update, leave them waiting).

Gradients that are None (or tf.IndexedSlices) on some ranks only: eagerly the ranks reconcile
them; inside tf.function a disagreement is a clear error on every rank.

Launched with a stall shutdown time (tests.mpi_harness.STALL_SAFETY_NET_ENV) so that a wait
for a rank that skipped a collective fails the case instead of the job.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import math  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.keras as hvdk  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402
from tf_training_cases import CASES  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)

BATCH, BATCHES = 8, 6
INITIAL_SCALE = 2.0 ** 15   # Keras's default initial loss scale


def data(rank):
    """Rank ``rank``'s regression data.  Rank 0's first two batches have targets so large that
    their scaled gradients overflow float16 for several loss scales; nobody else's ever do."""
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((BATCH * BATCHES, 4)).astype(np.float32)
    y = rng.standard_normal((BATCH * BATCHES, 1)).astype(np.float32)
    if rank == 0:
        y[:2 * BATCH] *= 3e4
    return x, y


def mixed_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1, dtype="float32")])


class mixed_policy:
    def __enter__(self):
        keras.mixed_precision.set_global_policy("mixed_float16")

    def __exit__(self, *exc):
        keras.mixed_precision.set_global_policy("float32")


def check_same_everywhere(model, lso, applied_updates):
    """Weights, loss scale and update count identical on every rank, and consistent with the
    scale having been halved once per skipped step."""
    weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    assert np.isfinite(weights).all(), "non-finite weights"
    scale = float(lso.dynamic_scale.numpy())
    mine = np.concatenate([weights, [scale, applied_updates]])[None]
    everyone = hvd.allgather(tf.constant(mine)).numpy()
    assert (everyone == everyone[0]).all(), (
        f"ranks disagree: loss scales {everyone[:, -2]}, applied updates {everyone[:, -1]}, "
        f"max weight difference {np.abs(everyone[:, :-2] - everyone[0, :-2]).max()}")
    skipped = BATCHES - applied_updates
    # Rank 0's overflows made every rank skip (rank 1's own gradients never overflow) ...
    assert skipped >= 2, f"only {skipped} steps skipped"
    # ... and each skip halved the scale (Keras grows it again only after 2000 good steps).
    assert scale == INITIAL_SCALE / 2 ** skipped, (scale, skipped)


def fit_case(wrap, run_eagerly=False):
    from hvdlite.tensorflow.keras import loss_scale
    assert loss_scale.installed(), "LossScaleOptimizer.check_finite is not patched"
    with mixed_policy():
        model = mixed_model()
        opt = wrap(keras.optimizers.SGD(0.01))
        model.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly)
        lso = model.optimizer
        assert isinstance(lso, keras.optimizers.LossScaleOptimizer), type(lso)
        x, y = data(RANK)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
        inner = lso.inner_optimizer if not isinstance(lso, hvdk._DistributedOptimizer) else lso
        check_same_everywhere(model, lso, int(inner.iterations.numpy()))


def hvd_only(sgd):
    # model.compile wraps it in a LossScaleOptimizer (the mixed_float16 policy)
    return hvdk.DistributedOptimizer(sgd)


def loss_scale_outside(sgd):
    return keras.optimizers.LossScaleOptimizer(hvdk.DistributedOptimizer(sgd))


def loss_scale_inside(sgd):
    return hvdk.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(sgd))


r.case("mixed_precision.compile_wraps", fit_case, hvd_only)
r.case("mixed_precision.compile_wraps_eager", fit_case, hvd_only, run_eagerly=True)
r.case("mixed_precision.loss_scale_outside", fit_case, loss_scale_outside)
r.case("mixed_precision.loss_scale_inside", fit_case, loss_scale_inside)


def backward_passes():
    """backward_passes_per_step=2 inside a LossScaleOptimizer, which checks every pass: a
    skipped pass is skipped everywhere, so the accumulation stays in step."""
    with mixed_policy():
        model = mixed_model()
        lso = keras.optimizers.LossScaleOptimizer(
            hvdk.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2))
        model.compile(optimizer=lso, loss="mse")
        x, y = data(RANK)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
        skipped = round(math.log2(INITIAL_SCALE / float(lso.dynamic_scale.numpy())))
        passes = int(lso.inner_optimizer._hvd_counter.numpy())   # passes not skipped
        updates = int(lso.inner_optimizer.iterations.numpy())
        assert passes == BATCHES - skipped and updates == passes // 2, (passes, updates, skipped)
        check_same_everywhere(model, lso, passes)


r.case("mixed_precision.backward_passes", backward_passes)


def custom_loop(distributed_tape):
    """A custom loop in tf.function: scale the loss, take gradients, apply.  Either the tape
    averages the (scaled) gradients before a plain LossScaleOptimizer checks them, or a plain
    tape feeds a LossScaleOptimizer around a DistributedOptimizer."""
    with mixed_policy():
        model = mixed_model()
        model.build((None, 4))
        inner = keras.optimizers.SGD(0.01)
        lso = keras.optimizers.LossScaleOptimizer(
            inner if distributed_tape else hvdk.DistributedOptimizer(inner))
        x, y = data(RANK)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
                scaled = lso.scale_loss(loss)
            if distributed_tape:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(scaled, model.trainable_variables)
            lso.apply(grads, model.trainable_variables)

        hvd.broadcast_variables(model.variables, root_rank=0)
        for b in range(BATCHES):
            step(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH])
        inner_opt = lso.inner_optimizer
        check_same_everywhere(model, lso, int(inner_opt.iterations.numpy()))


r.case("mixed_precision.custom_loop_tape", custom_loop, True)
r.case("mixed_precision.custom_loop_optimizer", custom_loop, False)



# --- gradients that are None or sparse on some ranks only -------------------------------------
def uses(rank, what):
    """Which parts of the model rank ``rank``'s loss reaches (the same table on every rank)."""
    table = {"b": rank % 2 == 0,            # ranks 0, 2
             "emb": rank != 1,              # sparse on ranks 0, 2 (int64 ids on 0, int32 on 2)
             "mixed_dense": rank == 0}      # mixed: dense on rank 0, sparse elsewhere
    return table[what]


def none_variables():
    a = tf.Variable(np.arange(3, dtype=np.float32) + 1, name="a")
    b = tf.Variable(np.full(2, 2.0, np.float32), name="b")
    never = tf.Variable(np.ones(4, np.float32), name="never")
    return a, b, never


def none_loss(rank, a, b, never):
    loss = tf.reduce_sum(a * a) * (rank + 1)
    if uses(rank, "b"):
        loss += tf.reduce_sum(b) * (rank + 1)
    return loss


def none_reference(a0, b0):
    """Averaged gradients: d/da of every rank, d/db of the ranks that use b (zeros elsewhere)."""
    ga = sum(2 * a0 * (q + 1) for q in range(SIZE)) / SIZE
    gb = sum(np.ones_like(b0) * (q + 1) for q in range(SIZE) if uses(q, "b")) / SIZE
    return ga, gb


def eager_tape():
    a, b, never = none_variables()
    for _ in range(2):   # twice: the second call reuses the cached negotiation
        with tf.GradientTape() as tape:
            loss = none_loss(RANK, a, b, never)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, [a, b, never])
        ga, gb = none_reference(a.numpy(), b.numpy())
        np.testing.assert_allclose(grads[0].numpy(), ga, rtol=1e-6)
        np.testing.assert_allclose(grads[1].numpy(), gb, rtol=1e-6)
        assert grads[2] is None, "a gradient no rank has must stay None"


r.case("none_gradients.eager_tape", eager_tape)


def eager_sparse():
    """An embedding reached by gathers on some ranks (int64 ids on one, int32 on another) and
    not at all on rank 1; a table reached densely on rank 0 and by a gather elsewhere."""
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    emb = tf.Variable(rows, name="emb")
    mixed = tf.Variable(rows, name="mixed")
    ids = {q: np.array([q % 6, (q + 2) % 6, q % 6]) for q in range(SIZE)}
    with tf.GradientTape() as tape:
        loss = tf.constant(0.0)
        if uses(RANK, "emb"):
            dtype = tf.int64 if RANK == 0 else tf.int32
            loss += tf.reduce_sum(tf.gather(emb, tf.constant(ids[RANK], dtype)))
        if uses(RANK, "mixed_dense"):
            loss += tf.reduce_sum(mixed * 3.0)
        else:
            loss += tf.reduce_sum(tf.gather(mixed, tf.constant(ids[RANK], tf.int32)))
    g_emb, g_mixed = hvd.DistributedGradientTape(tape).gradient(loss, [emb, mixed])
    want_emb = np.zeros_like(rows)
    want_mixed = np.zeros_like(rows)
    for q in range(SIZE):
        for i in ids[q]:
            if uses(q, "emb"):
                want_emb[i] += 1
            if not uses(q, "mixed_dense"):
                want_mixed[i] += 1
        if uses(q, "mixed_dense"):
            want_mixed += 3.0
    assert isinstance(g_emb, tf.IndexedSlices), type(g_emb)
    assert not isinstance(g_mixed, tf.IndexedSlices), "dense on one rank: dense everywhere"
    np.testing.assert_allclose(tf.convert_to_tensor(g_emb).numpy(), want_emb / SIZE, rtol=1e-6)
    np.testing.assert_allclose(g_mixed.numpy(), want_mixed / SIZE, rtol=1e-6)


r.case("none_gradients.eager_sparse", eager_sparse)


def eager_keras_optimizer():
    """apply_gradients eagerly with a gradient only some ranks have: every rank applies the
    same averaged update; the variable no rank has a gradient for is left alone."""
    a, b, never = none_variables()
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5))
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = none_loss(RANK, a, b, never)
        grads = tape.gradient(loss, [a, b, never])
        opt.apply_gradients(zip(grads, [a, b, never]))
    values = np.concatenate([a.numpy(), b.numpy(), never.numpy()])
    everyone = hvd.allgather(tf.constant(values[None])).numpy()
    assert (everyone == everyone[0]).all(), everyone
    np.testing.assert_array_equal(never.numpy(), np.ones(4, np.float32))
    assert not np.allclose(b.numpy(), 2.0) and not np.allclose(a.numpy(), [1, 2, 3])


r.case("none_gradients.eager_keras_optimizer", eager_keras_optimizer)


def traced_alike():
    """Inside tf.function, a gradient that is None on every rank stays None (an empty
    placeholder in the group), the others are averaged."""
    a, b, never = none_variables()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * a) * (RANK + 1) + tf.reduce_sum(b) * (RANK + 1)
        return hvd.DistributedGradientTape(tape).gradient(loss, [a, b, never])

    for _ in range(2):
        ga, gb, gn = step()
        assert gn is None
        want = sum(q + 1 for q in range(SIZE)) / SIZE
        np.testing.assert_allclose(ga.numpy(), 2 * a.numpy() * want, rtol=1e-6)
        np.testing.assert_allclose(gb.numpy(), np.full(2, want), rtol=1e-6)


r.case("none_gradients.traced_alike", traced_alike)


def traced_differently():
    """Ranks whose traced functions differ in which gradients are None: every rank gets an
    error naming the gradient (the ranks with the None one also name its variable), nobody
    hangs, and the next collective works."""
    a, b, never = none_variables()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = none_loss(RANK, a, b, never)
        return hvd.DistributedGradientTape(tape).gradient(loss, [a, b])

    try:
        step()
    except tf.errors.OpError as exc:
        msg = str(exc)
        assert "DistributedGradientTape.allreduce.1" in msg and "shape (0,)" in msg, msg
        assert "unconnected_gradients" in msg, msg
        if not uses(RANK, "b"):
            assert "DistributedGradientTape.allreduce.1 (b:0): None" in msg, msg
    else:
        raise AssertionError("different traced gradients did not raise")
    total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="after_mismatch")
    assert total.numpy().tolist() == [float(SIZE)]


r.case("none_gradients.traced_differently_is_an_error", traced_differently)

def xla_refused():
    """jit_compile=True (tf.function or model.compile): a clear error on every rank when the
    function is traced, before any collective, instead of TensorFlow's tf2xla failure."""
    @tf.function(jit_compile=True)
    def summed(x):
        return hvd.allreduce(x, op=hvd.Sum, name="xla.allreduce")

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=True)
    x, y = data(RANK)
    for run in (lambda: summed(tf.ones([2])),
                lambda: model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)):
        try:
            run()
        except NotImplementedError as exc:
            assert "XLA" in str(exc) and "jit_compile=False" in str(exc), str(exc)
        else:
            raise AssertionError("an XLA-compiled collective did not raise")
    total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="after_xla")
    assert total.numpy().tolist() == [float(SIZE)]


r.case("xla.refused_clearly", xla_refused)

missing = [c for c in CASES if c not in r.results]
assert not missing, missing
r.write()
