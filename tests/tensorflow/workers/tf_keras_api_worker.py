"""Horovod's Keras API on every rank of a real MPI job, under the Keras that ``tf.keras`` is:
Keras 2 through tf-keras when the test sets ``TF_USE_LEGACY_KERAS=1`` (issue 54), Keras 3
otherwise (the cases that exist in both: custom-loop steps, backward passes, fit with the
callbacks, LR schedule, local variables, elastic callbacks, load_model, KerasState).  Each case
is checked against numbers computed here from every rank's inputs (gathered with hvdlite's
allgather, checked on its own by the core tests)."""
import os
import tempfile

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow.keras as hvd  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
keras = tf.keras
KERAS2 = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
# The optimizer whose momentum is a variable in Keras 2 (the legacy one); Keras 3 has one SGD.
SGD = keras.optimizers.legacy.SGD if KERAS2 else keras.optimizers.SGD
r = Reporter(RANK)
LR = 0.5


def data(rank, n=8):
    rng = np.random.default_rng(100 + rank)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def linear(w0):
    model = keras.Sequential([keras.layers.Dense(1, use_bias=False, input_shape=(3,))])
    model.layers[0].set_weights([w0])
    return model


def local_grad(w, x, y):
    """d/dw of mean((x @ w - y)^2)."""
    return 2.0 * x.T @ (x @ w - y) / len(x)


W0 = np.arange(3, dtype="float32").reshape(3, 1) / 10


def mean_grad(w):
    return np.mean([local_grad(w, *data(q)) for q in range(SIZE)], axis=0)


def check_keras_is(package):
    assert keras.__name__.startswith(package), keras.__name__
    for cls in (hvd.callbacks.BroadcastGlobalVariablesCallback, hvd.elastic.CommitStateCallback):
        assert cls.__mro__[1].__module__.startswith(package), cls.__mro__
    assert hvd.keras2.is_keras2_class(type(SGD(1.0))) == KERAS2
    import hvdlite.keras as hvd_keras   # horovod.keras's name: the same objects
    assert hvd_keras.callbacks.MetricAverageCallback is hvd.callbacks.MetricAverageCallback
    assert hvd_keras.elastic.KerasState is hvd.elastic.KerasState


def train_step(opt, loss, variables):
    """One step as a Keras 2 script takes it (minimize), or a Keras 3 one (no minimize)."""
    if KERAS2:
        return opt.minimize(loss, variables)
    with tf.GradientTape() as tape:
        value = loss()
    return opt.apply_gradients(zip(tape.gradient(value, variables), variables))


def step_with(opt_factory, how):
    model = linear(W0)
    opt = hvd.DistributedOptimizer(opt_factory(LR))
    x, y = data(RANK)
    loss = lambda: tf.reduce_mean((model(x) - y) ** 2)  # noqa: E731
    if how == "minimize":
        opt.minimize(loss, model.trainable_variables)
    elif how == "_compute_gradients":
        with tf.GradientTape() as tape:
            value = loss()
        pairs = opt._compute_gradients(value, model.trainable_variables, tape=tape)
        np.testing.assert_allclose(pairs[0][0].numpy(), mean_grad(W0), rtol=1e-5)
        opt.apply_gradients(pairs)
    elif how == "tape":   # a custom loop: the tape's own gradients to apply_gradients
        with tf.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    elif how == "tf.function":
        @tf.function
        def step():
            opt.minimize(loss, model.trainable_variables)   # (legacy: returns an op)
        step()
    np.testing.assert_allclose(model.layers[0].get_weights()[0], W0 - LR * mean_grad(W0),
                               rtol=1e-5, atol=1e-6)


def backward_passes(opt_factory, compiled):
    model = linear(W0)
    opt = hvd.DistributedOptimizer(opt_factory(LR), backward_passes_per_step=2)
    x, y = data(RANK)
    loss = lambda: tf.reduce_mean((model(x) - y) ** 2)  # noqa: E731
    def step():
        train_step(opt, loss, model.trainable_variables)
    if compiled:
        step = tf.function(step)
    step()
    np.testing.assert_allclose(model.layers[0].get_weights()[0], W0)   # nothing applied yet
    step()   # two passes of the same gradient, summed, then averaged over the ranks
    np.testing.assert_allclose(model.layers[0].get_weights()[0], W0 - LR * 2 * mean_grad(W0),
                               rtol=1e-5, atol=1e-6)
    if KERAS2:   # as Horovod's aggregation helper counts (hvdlite's Keras 3 wrapper: applied)
        assert int(opt.iterations.numpy()) == 2, int(opt.iterations.numpy())


def graph_mode():
    """Keras 2 built in a TF1 graph: get_gradients averages (Horovod's graph-mode hook) and
    broadcast_global_variables runs in Keras's session; eagerly the latter raises."""
    try:
        hvd.broadcast_global_variables(0)
        raise AssertionError("broadcast_global_variables ran eagerly")
    except RuntimeError as e:
        assert "eager" in str(e), e
    x, y = data(RANK)
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(W0 + RANK))
        loss = tf.reduce_mean((tf.matmul(x, w) - y) ** 2)
        opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(LR))
        grads = opt.get_gradients(loss, [w])
        sess = tf.compat.v1.keras.backend.get_session()
        sess.run(tf.compat.v1.global_variables_initializer())
        hvd.broadcast_global_variables(0)
        np.testing.assert_array_equal(sess.run(w), W0)   # rank 0's
        np.testing.assert_allclose(sess.run(grads)[0], mean_grad(W0), rtol=1e-5)


def lr_schedule_momentum_correction():
    """LearningRateScheduleCallback on a legacy SGD (momentum in a variable): the momentum is
    scaled by new_lr / old_lr for the batch where the rate changes, then restored (Keras 3's
    momentum is a Python float compiled into the step: left alone)."""
    model = linear(W0)
    opt = hvd.DistributedOptimizer(SGD(0.1, momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            seen.append(round(float(np.asarray(self.model.optimizer.momentum)), 6))

    x, y = data(RANK, 16)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1,
                                                   multiplier=lambda epoch: 0.5 ** epoch),
        Probe()])
    assert seen == ([0.9, 0.9, 0.45, 0.9, 0.45, 0.9] if KERAS2 else [0.9] * 6), seen
    np.testing.assert_allclose(history.history["lr"], [0.1, 0.05, 0.025], rtol=1e-6)
    assert abs(float(np.asarray(opt.momentum)) - 0.9) < 1e-7


def local_variables():
    """PartialDistributedOptimizer: the local layer's gradient is this rank's own, divided by
    the number of ranks (scale_local_gradients, as in Horovod); the other one is averaged."""
    shared = keras.layers.Dense(1, use_bias=False)
    local = keras.layers.Dense(1, use_bias=False)
    shared.build((None, 3))
    local.build((None, 3))
    shared.set_weights([W0])
    local.set_weights([np.zeros_like(W0)])
    opt = hvd.PartialDistributedOptimizer(SGD(LR), local_layers=[local])
    x, y = data(RANK)
    variables = shared.trainable_variables + local.trainable_variables
    train_step(opt, lambda: tf.reduce_mean((shared(x) + local(x) - y) ** 2), variables)
    np.testing.assert_allclose(shared.get_weights()[0], W0 - LR * mean_grad(W0), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(local.get_weights()[0], -LR * local_grad(W0, x, y) / SIZE,
                               rtol=1e-5, atol=1e-6)


def elastic_callbacks():
    """KerasState with Horovod's elastic callbacks in model.fit: commits every 2 batches and at
    every epoch's end; epoch and batch kept in the state."""
    model = linear(W0)
    model.compile(optimizer=hvd.DistributedOptimizer(SGD(LR)), loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    commits = []
    commit = state.commit
    state.commit = lambda: (commits.append(state.batch), commit())
    x, y = data(RANK, 32)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])
    assert (state.epoch, state.batch) == (2, 0), (state.epoch, state.batch)
    assert len(commits) == 6, commits   # 8 batches / 2 + 2 epoch ends
    trained = model.layers[0].get_weights()[0]
    model.layers[0].set_weights([W0])
    state.restore()
    np.testing.assert_array_equal(model.layers[0].get_weights()[0], trained)


def horovod_keras_mnist_script():
    """Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py as written (small random
    images instead of MNIST): tf.optimizers.Adam, average_aggregated_gradients,
    experimental_run_tf_function=False, the warmup callback finding the steps itself,
    ModelCheckpoint to .h5 on rank 0."""
    rng = np.random.default_rng(RANK)
    images = rng.random((64, 8, 8)).astype("float32")
    labels = rng.integers(0, 10, 64)
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis], tf.float32), tf.cast(labels, tf.int64)))
    dataset = dataset.repeat().shuffle(64).batch(16)
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(4, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10, activation='softmax')])
    scaled_lr = 0.001 * SIZE
    opt = hvd.DistributedOptimizer(tf.optimizers.Adam(scaled_lr), backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=['accuracy'], experimental_run_tf_function=False)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                          warmup_epochs=2, verbose=1)]
    folder = tempfile.mkdtemp()
    if RANK == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(folder + '/checkpoint-{epoch}.h5'))
    history = model.fit(dataset, steps_per_epoch=6 // SIZE, callbacks=callbacks, epochs=3,
                        verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    gathered = hvd.allgather(weights[None, :])
    for q in range(SIZE):
        np.testing.assert_array_equal(gathered[q], weights)
    np.testing.assert_allclose(history.history["lr"][-1], scaled_lr, rtol=1e-6)
    if RANK == 0:
        assert sorted(os.listdir(folder)) == [f"checkpoint-{e}.h5" for e in (1, 2, 3)]


def sparse_as_dense():
    emb = keras.layers.Embedding(10, 2)
    emb.build((None,))
    emb.set_weights([np.ones((10, 2), dtype="float32")])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), sparse_as_dense=True)
    ids = tf.constant([RANK % 10])
    with tf.GradientTape() as tape:
        value = tf.reduce_sum(emb(ids))
    pairs = list(zip(tape.gradient(value, emb.trainable_variables), emb.trainable_variables))
    opt.apply_gradients(pairs)
    want = np.ones((10, 2), dtype="float32")
    for q in range(SIZE):
        want[q % 10] -= 1.0 / SIZE
    np.testing.assert_allclose(emb.get_weights()[0], want, rtol=1e-6)


def fit_with_callbacks():
    keras.utils.set_random_seed(RANK)   # different initial weights on every rank
    model = keras.Sequential([keras.layers.Dense(4, activation="relu", input_shape=(3,)),
                              keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    x, y = data(RANK, 32)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=2,
                                                 steps_per_epoch=4)])
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    gathered = hvd.allgather(weights[None, :])
    for q in range(SIZE):
        np.testing.assert_array_equal(gathered[q], weights)   # identical on every rank
    losses = hvd.allgather(np.array([history.history["loss"]]))
    np.testing.assert_array_equal(losses, np.repeat(losses[:1], SIZE, axis=0))   # averaged
    assert abs(history.history["lr"][-1] - 0.05) < 1e-7, history.history["lr"]


def load_model_keeps_the_optimizer():
    model = linear(W0)
    model.compile(optimizer=SGD(LR, momentum=0.5), loss="mse")
    x, y = data(0)
    model.fit(x, y, epochs=1, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), f"m{RANK}.h5" if KERAS2 else f"m{RANK}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, hvd.DistributedSetup), type(loaded.optimizer).__mro__
    assert type(loaded.optimizer).__name__ == "SGD"
    before = loaded.layers[0].get_weights()[0]
    xr, yr = data(RANK)
    loaded.fit(xr, yr, batch_size=8, epochs=1, verbose=0)   # the same step on every rank
    after = hvd.allgather(loaded.layers[0].get_weights()[0].T)
    assert not np.allclose(after[0], before.T[0])
    for q in range(SIZE):
        np.testing.assert_allclose(after[q], after[0], rtol=1e-6)


def keras_state_commit_restore():
    model = linear(W0)
    opt = hvd.DistributedOptimizer(SGD(LR))
    model.compile(optimizer=opt, loss="mse")
    state = hvd.elastic.KerasState(model, epoch=2)
    state.commit()
    model.layers[0].set_weights([W0 + 1])
    state.epoch = 7
    state.restore()
    np.testing.assert_array_equal(model.layers[0].get_weights()[0], W0)
    assert state.epoch == 2


def tensorflow_state_commit_restore():
    """TensorFlowState (plain variables): restore() brings back the committed values and
    attributes; sync() takes rank 0's variables on every rank."""
    v = tf.Variable(np.full(3, float(RANK), np.float32))
    state = hvd.elastic.TensorFlowState([v], epoch=1)
    state.sync()   # rank 0's values everywhere
    np.testing.assert_array_equal(v.numpy(), np.zeros(3, np.float32))
    v.assign(np.full(3, 5.0, np.float32))
    state.commit()
    v.assign(np.full(3, 9.0, np.float32))
    state.epoch = 4
    state.restore()
    np.testing.assert_array_equal(v.numpy(), np.full(3, 5.0, np.float32))
    assert state.epoch == 1


if KERAS2:
    r.case("keras_is_2", check_keras_is, "tf_keras")
    for name, factory in (("current", keras.optimizers.SGD),
                          ("legacy", keras.optimizers.legacy.SGD)):
        for how in ("minimize", "tape", "tf.function"):
            r.case(f"step.{name}.{how}", step_with, factory, how)
    r.case("step.legacy._compute_gradients", step_with, keras.optimizers.legacy.SGD,
           "_compute_gradients")
    for name, factory in (("current", keras.optimizers.SGD),
                          ("legacy", keras.optimizers.legacy.SGD)):
        r.case(f"backward_passes.{name}.eager", backward_passes, factory, False)
        r.case(f"backward_passes.{name}.tf.function", backward_passes, factory, True)
    r.case("graph_mode", graph_mode)
    r.case("sparse_as_dense", sparse_as_dense)
    r.case("horovod_keras_mnist_script", horovod_keras_mnist_script)
else:
    r.case("keras_is_3", check_keras_is, "keras")
    r.case("step.current.tape", step_with, keras.optimizers.SGD, "tape")
    r.case("backward_passes.current.eager", backward_passes, keras.optimizers.SGD, False)
    r.case("backward_passes.current.tf.function", backward_passes, keras.optimizers.SGD, True)
r.case("lr_schedule_momentum_correction", lr_schedule_momentum_correction)
r.case("local_variables", local_variables)
r.case("elastic_callbacks", elastic_callbacks)
r.case("fit_with_callbacks", fit_with_callbacks)
r.case("load_model", load_model_keeps_the_optimizer)
r.case("keras_state", keras_state_commit_restore)
r.case("tensorflow_state", tensorflow_state_commit_restore)
r.write()
hvd.shutdown()
