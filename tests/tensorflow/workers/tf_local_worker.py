"""Model-parallel local variables, object collectives and BestModelCheckpoint in one launch.

Every rank rebuilds every rank's model and data locally (seeded by rank) and computes the plain
single-process gradients itself, so the references do not depend on hvdlite.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.keras as hvdk  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402
from tf_local_cases import CASES  # noqa: E402

hvd.init(process_sets="dynamic")
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)


def build(rank):
    """A shared layer (same weights on every rank) feeding a local one (weights per rank)."""
    shared = keras.layers.Dense(3, name="shared")
    local = keras.layers.Dense(2, name="local")
    shared.build((None, 5))
    local.build((None, 3))
    for layer, seed in ((shared, 7), (local, 100 + rank)):
        rng = np.random.default_rng(seed)
        for v in layer.trainable_weights:
            v.assign(rng.standard_normal(v.shape).astype(np.float32))
    return shared, local


def data(rank):
    rng = np.random.default_rng(rank)
    return rng.standard_normal((4, 5)).astype(np.float32)


def loss_of(shared, local, x):
    return tf.reduce_sum(tf.square(local(shared(x))))


def plain_grads(rank):
    shared, local = build(rank)
    with tf.GradientTape() as tape:
        loss = loss_of(shared, local, data(rank))
    variables = shared.trainable_weights + local.trainable_weights
    return [g.numpy() for g in tape.gradient(loss, variables)]


def expected_grads(scale_local=True):
    every = [plain_grads(q) for q in range(SIZE)]
    shared = [np.mean([every[q][i] for q in range(SIZE)], axis=0) for i in range(2)]
    own_local = every[RANK][2:]
    return shared + [g / SIZE if scale_local else g for g in own_local]


def check_grads(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"gradient {i}")


def tape_partial(graph):
    shared, local = build(RANK)
    x = tf.constant(data(RANK))
    variables = shared.trainable_weights + local.trainable_weights

    def step():
        with tf.GradientTape() as tape:
            loss = loss_of(shared, local, x)
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
        return tape.gradient(loss, variables)

    got = tf.function(step)() if graph else step()
    check_grads(got, expected_grads())


r.case("tape.partial_eager", tape_partial, False)
r.case("tape.partial_graph", tape_partial, True)


def register_local_source_unscaled():
    shared, local = build(RANK)
    x = tf.constant(data(RANK))
    with tf.GradientTape() as tape:
        loss = loss_of(shared, local, x)
    tape = hvd.DistributedGradientTape(tape, scale_local_gradients=False)
    for v in local.trainable_weights:
        tape.register_local_source(v)
    # A nested structure of sources comes back in the same structure.
    got = tape.gradient(loss, {"shared": shared.trainable_weights,
                               "local": local.trainable_weights}, use_generic_names=True)
    check_grads(got["shared"] + got["local"], expected_grads(scale_local=False))


r.case("tape.register_local_source_unscaled", register_local_source_unscaled)


def partial_without_local_layers():
    shared, local = build(RANK)
    with tf.GradientTape() as tape:
        loss = loss_of(shared, local, tf.constant(data(RANK)))
    tape = hvd.PartialDistributedGradientTape(tape)
    got = tape.gradient(loss, shared.trainable_weights + local.trainable_weights)
    every = [plain_grads(q) for q in range(SIZE)]
    check_grads(got, [np.mean([every[q][i] for q in range(SIZE)], axis=0) for i in range(4)])


r.case("tape.partial_without_local_layers", partial_without_local_layers)


def local_layers_rejected():
    with tf.GradientTape() as tape:
        pass
    for bad in ([object()], [keras.layers.Dense(1), "layer"]):
        try:
            hvd.PartialDistributedGradientTape(tape, local_layers=bad)
        except ValueError as exc:
            assert "local_layers must be Keras layers" in str(exc), exc
        else:
            raise AssertionError(f"local_layers={bad!r} accepted")
    try:
        hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(), local_layers=[1])
    except ValueError as exc:
        assert "local_layers must be Keras layers" in str(exc), exc
    else:
        raise AssertionError("PartialDistributedOptimizer accepted local_layers=[1]")


r.case("tape.local_layers_rejected", local_layers_rejected)


def grads_for(rank, step, variables):
    rng = np.random.default_rng(1000 * rank + step)
    return [rng.standard_normal(v.shape).astype(np.float32) for v in variables]


def partial_apply():
    shared, local = build(RANK)
    variables = shared.trainable_weights + local.trainable_weights
    before = [v.numpy().copy() for v in variables]
    opt = hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0),
                                           local_layers=local)
    opt.apply_gradients(zip([tf.constant(g) for g in grads_for(RANK, 0, variables)], variables))
    every = [grads_for(q, 0, variables) for q in range(SIZE)]
    own = every[RANK]
    for i, v in enumerate(variables):
        step = own[i] / SIZE if i >= 2 else np.mean([e[i] for e in every], axis=0)
        np.testing.assert_allclose(v.numpy(), before[i] - step, rtol=1e-5, atol=1e-6,
                                   err_msg=v.path)


r.case("keras.partial_apply", partial_apply)


def partial_backward_passes():
    shared, local = build(RANK)
    variables = shared.trainable_weights + local.trainable_weights
    before = [v.numpy().copy() for v in variables]
    opt = hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0),
                                           local_layers=[local], backward_passes_per_step=2)
    opt.apply_gradients(zip([tf.constant(g) for g in grads_for(RANK, 0, variables)], variables))
    for v, b in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), b)   # first pass: aggregated only
    opt.apply_gradients(zip([tf.constant(g) for g in grads_for(RANK, 1, variables)], variables))
    summed = [[a + b for a, b in zip(grads_for(q, 0, variables), grads_for(q, 1, variables))]
              for q in range(SIZE)]
    for i, v in enumerate(variables):
        step = (summed[RANK][i] / SIZE if i >= 2
                else np.mean([s[i] for s in summed], axis=0))
        np.testing.assert_allclose(v.numpy(), before[i] - step, rtol=1e-5, atol=1e-5,
                                   err_msg=v.path)


r.case("keras.partial_backward_passes", partial_backward_passes)


def two_part_model(rank):
    keras.utils.set_random_seed(11 + rank)   # every weight starts different per rank
    local = keras.layers.Dense(1, name="local_head")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="trunk"), local])
    return model, local


def gathered(arrays):
    flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
    return hvd.allgather(tf.constant(flat[None])).numpy()


def partial_fit():
    model, local = two_part_model(RANK)
    opt = hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05,
                                                                momentum=0.5),
                                           local_layers=[local])
    model.compile(optimizer=opt, loss="mse")
    x = data(RANK)
    y = np.full((4, 1), float(RANK), np.float32)
    cb = hvdk.callbacks.BroadcastGlobalVariablesCallback(0,
                                                         local_variables=local.trainable_weights)
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    trunk = gathered(model.get_layer("trunk").get_weights())
    assert all(np.array_equal(trunk[0], row) for row in trunk), "shared weights differ"
    head = gathered(local.get_weights())
    assert all(not np.array_equal(head[0], row) for row in head[1:]), \
        "local weights were made equal across ranks"


r.case("keras.partial_fit", partial_fit)


def broadcast_skips_local():
    model, local = two_part_model(RANK)
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1, momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    owners = {}
    for k, v in enumerate(list(model.variables) + list(opt.variables)):
        v.assign(np.full(v.shape, 100 * RANK + k).astype(v.dtype))
        owners[id(v)] = k
    kernel, bias = local.trainable_weights
    cb = hvdk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[kernel])
    cb.register_local_var(bias)
    cb.set_model(model)
    cb.on_train_begin()
    local_ids = {id(kernel), id(bias)}
    slot_of = {id(s): ref for s, ref in _slot_pairs(opt)}
    checked_local_slots = 0
    for v in list(model.variables) + list(opt.variables):
        k = owners[id(v)]
        own = id(v) in local_ids or (id(v) in slot_of and id(slot_of[id(v)]) in local_ids)
        checked_local_slots += own and id(v) in slot_of
        want = 100 * RANK + k if own else k
        assert np.all(np.asarray(v.numpy()) == want), (v.path, v.numpy(), want)
    assert checked_local_slots == 2, checked_local_slots   # the momenta of kernel and bias


def _slot_pairs(opt):
    """(momentum slot, model variable) pairs of a Keras 3 SGD, from Keras's own bookkeeping."""
    return [(opt.momentums[opt._get_variable_index(v)], v) for v in opt._trainable_variables]


r.case("keras.broadcast_skips_local", broadcast_skips_local)


def broadcast_object_fn():
    fn = hvd.broadcast_object_fn(root_rank=SIZE - 1, name="objfn")
    assert fn({"rank": RANK, "tag": [RANK] * 2}) == {"rank": SIZE - 1, "tag": [SIZE - 1] * 2}
    # Horovod's TF signatures take a TF1 session (third argument of the object helpers);
    # hvdlite needs none and accepts one
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        fn = hvd.broadcast_object_fn(SIZE - 1, sess, "objfn.sess")
        assert fn(RANK) == SIZE - 1
        assert hvd.broadcast_object(RANK, 0, sess, "obj.sess") == 0
        assert hvd.allgather_object(RANK, sess, "gather.sess") == list(range(SIZE))


r.case("objects.broadcast_object_fn", broadcast_object_fn)


def objects_process_set():
    members = list(range(1, SIZE))   # not the global set, and rank 0 stays out
    ps = hvd.add_process_set(members)
    try:
        if RANK in members:
            got = hvd.broadcast_object(("x", RANK), root_rank=SIZE - 1, process_set=ps)
            assert got == ("x", SIZE - 1), got
            every = hvd.allgather_object({"r": RANK}, name="set", process_set=ps)
            assert every == [{"r": q} for q in members], every
            fn = hvd.broadcast_object_fn(root_rank=members[0], process_set=ps)
            assert fn(RANK * 3) == members[0] * 3
        else:
            try:
                hvd.broadcast_object(RANK, root_rank=SIZE - 1, process_set=ps)
            except Exception as exc:   # noqa: BLE001 - the core's error for non-members
                assert "not a member" in str(exc) or "process set" in str(exc), exc
            else:
                raise AssertionError("a non-member took part in a process set's broadcast")
    finally:
        hvd.remove_process_set(ps)


r.case("objects.process_set", objects_process_set)


class _Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.val_losses, self.weights = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.val_losses.append(logs["val_loss"])
        self.weights.append([w.copy() for w in self.model.get_weights()])


def best_model_checkpoint():
    out = os.environ["HVDLITE_TEST_OUT"]
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.3)), loss="mse")
    rng = np.random.default_rng(RANK)
    x = rng.standard_normal((16, 5)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    xv, yv = x[:4] + 0.5, y[:4] + 2.5     # validation loss goes down, then up again
    try:
        model.fit(x, y, epochs=1, verbose=0, callbacks=[hvdk.callbacks.BestModelCheckpoint()])
    except ValueError as exc:
        assert "filepath" in str(exc), exc
    else:
        raise AssertionError("BestModelCheckpoint without a filepath was accepted")
    path = os.path.join(out, f"best.rank{RANK}.keras")
    rec = _Recorder()
    model.fit(x, y, batch_size=4, epochs=6, verbose=0, shuffle=False, validation_data=(xv, yv),
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvdk.callbacks.MetricAverageCallback(),
                         hvdk.callbacks.BestModelCheckpoint(filepath=path), rec])
    hvd.barrier()
    if RANK != 0:
        assert not os.path.exists(path), f"rank {RANK} wrote {path}"
        return
    best = int(np.argmin(rec.val_losses))
    saved = keras.models.load_model(path).get_weights()
    for got, want in zip(saved, rec.weights[best]):
        np.testing.assert_array_equal(got, want)
    assert best < 5 or rec.val_losses[best] < rec.val_losses[0], rec.val_losses


r.case("keras.best_model_checkpoint", best_model_checkpoint)

missing = [c for c in CASES if c not in r.results]
assert not missing, missing
r.write()
