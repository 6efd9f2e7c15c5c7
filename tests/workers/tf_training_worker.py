"""TF / Keras training setups whose correctness depends on every rank taking the same decision:
Keras mixed precision (a LossScaleOptimizer skips a step when gradients overflow).

Rank 0's data overflows float16 in the first steps while the other ranks' data never does, so
a rank that decided from its own gradients would skip different steps than the others (and,
with hvdlite's reduction inside the skipped update, leave them waiting).  Launched with a short
HVDLITE_STALL_SHUTDOWN_TIME_SECONDS so that such a wait fails the case instead of the job.
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
from _report import Reporter  # noqa: E402
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

missing = [c for c in CASES if c not in r.results]
assert not missing, missing
r.write()
