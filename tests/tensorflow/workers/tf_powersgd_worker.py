"""compression=hvd.Compression.powersgd(...) with TensorFlow on every rank: the
DistributedGradientTape and the Keras DistributedOptimizer, eagerly and in tf.function.

A small float64 MLP (12-10-8-3: the 12x10 and 10x8 kernels compress at rank 2, the 8x3 one and
the biases travel uncompressed).  Every step the ranks' local gradients are gathered (mpi4py,
independently of hvdlite) and fed to the numpy reference of tests/torch/workers/
powersgd_reference.py, whose torch-drawn initial Q is swapped for the numpy draw TensorFlow's
PowerSGD uses; the reduced gradients (or the SGD update) must match it, and be bitwise
identical across the ranks of the set.
"""
import os
import sys
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402
from mpi4py import MPI  # noqa: E402

keras.config.set_floatx("float64")   # (Keras's losses and data adapter compute in floatx)

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.keras as hvdk  # noqa: E402
# The reference draws its initial Q with torch, and only that: the draw is replaced below by
# TensorFlow PowerSGD's numpy one, so a stand-in module spares each rank importing torch.
_torch = sys.modules.setdefault("torch", types.ModuleType("torch"))
from tests.torch.workers import powersgd_reference as reference  # noqa: E402
if not hasattr(_torch, "Tensor"):
    del sys.modules["torch"]
from tests.workers._report import Reporter  # noqa: E402

COMM = MPI.COMM_WORLD
SETS = {2: [[0], [1]], 3: [[0, 1], [2]]}
SETS_HERE = [hvd.ProcessSet(ranks) for ranks in SETS[COMM.Get_size()]]
hvd.init(process_sets=SETS_HERE)
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)
B, IN, SHAPES = 4, 12, [(12, 10), (10,), (10, 8), (8,), (8, 3), (3,)]
COMPRESSED = (0, 2)   # positions of the kernels that compress at rank 2
LR = 0.25             # (exact in float32 too: Keras keeps the learning rate as float32)
TAPE, KERAS = "DistributedGradientTape.allreduce", "DistributedOptimizer.DistributedSGD"


def numpy_initial_q(config, name, m, r_, step=0):
    draw = np.random.default_rng(reference.policy.factor_seed(config, name, step))
    return reference.gram_schmidt(draw.standard_normal((m, r_), dtype=np.float32))


reference.initial_q = numpy_initial_q


def data(case, step, rank):
    rng = np.random.default_rng([sum(map(ord, case)), step, rank])
    return rng.standard_normal((B, IN)), rng.standard_normal((B, 3))


def initial_weights():
    rng = np.random.default_rng(7)
    return [rng.standard_normal(s) * 0.5 for s in SHAPES]


def forward(ws, x):
    h = tf.tanh(x @ ws[0] + ws[1])
    h = tf.tanh(h @ ws[2] + ws[3])
    return h @ ws[4] + ws[5]


def loss_of(ws, x, y):
    return tf.reduce_mean(tf.square(forward(ws, x) - y))


def local_grads(ws, case, step, name, passes=1):
    """This rank's own gradient (summed over ``passes``), keyed by the names PowerSGD uses."""
    total = [0.0] * len(ws)
    for k in range(passes):
        x, y = data(case, step * passes + k, RANK)
        with tf.GradientTape() as tape:
            loss = loss_of(ws, tf.constant(x), tf.constant(y))
        total = [t + g.numpy() for t, g in zip(total, tape.gradient(loss, ws))]
    return {f"{name}.{i}": g for i, g in enumerate(total)}


def set_ranks(process_set):
    return list(range(SIZE)) if process_set is None else process_set.ranks


def reduced_by_reference(ref, local, process_set, average):
    """(the reference's reduction of the set's gradients, their plain reduction); a one-rank
    set keeps the local ones.  Every rank gathers (mpi4py) alike, in or out of the set."""
    gathered, ranks = COMM.allgather(local), set_ranks(process_set)
    if len(ranks) == 1:
        return local, local
    plain = {k: sum(gathered[i][k] for i in ranks) / (len(ranks) if average else 1)
             for k in local}
    return ref.step([gathered[i] for i in ranks]), plain


def same_in_set(arrays, process_set):
    """Bitwise identical across the ranks of the set."""
    gathered = COMM.allgather(b"".join(np.asarray(a).tobytes() for a in arrays))
    assert len({gathered[i] for i in set_ranks(process_set)}) == 1, "differ across ranks"


def check_compressed(got, local_names, ref_steps, config, plain):
    """From ``start_iter`` on, the compressed kernels are not the plain average."""
    if ref_steps > config.start_iter:
        for i in COMPRESSED:
            assert not np.allclose(got[i], plain[local_names[i]]), "not compressed"


def tape_case(case, traced, op=hvd.Average, steps=5, process_set=None, **kw):
    ps = process_set or hvd.global_process_set
    compression = hvd.Compression.powersgd(rank=2, start_iter=2, seed=len(case), **kw)
    ranks = set_ranks(process_set)
    ref = reference.Reference(compression.config, len(ranks), average=op == hvd.Average)
    ws = [tf.Variable(w) for w in initial_weights()]

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(ws, x, y)
        tape = hvd.DistributedGradientTape(tape, compression=compression, op=op,
                                           process_set=ps)
        grads = tape.gradient(loss, ws)
        for w, g in zip(ws, grads):
            w.assign_sub(LR * g)
        return grads

    run = tf.function(step) if traced else step
    for s in range(steps):
        expected, plain = reduced_by_reference(ref, local_grads(ws, case, s, TAPE), process_set,
                                               op == hvd.Average)
        x, y = data(case, s, RANK)
        got = [g.numpy() for g in run(tf.constant(x), tf.constant(y))]
        for i, g in enumerate(got):
            np.testing.assert_allclose(g, expected[f"{TAPE}.{i}"], rtol=0, atol=1e-12,
                                       err_msg=f"step {s} grad {i}")
        same_in_set([w.numpy() for w in ws], process_set)
        if len(ranks) > 1:
            check_compressed(got, [f"{TAPE}.{i}" for i in range(6)], ref.steps,
                             compression.config, plain)
            # error feedback: none in the plain steps, then kept for the compressed kernels
            assert sorted(ref.error[0]) == ([] if s < 2 else [f"{TAPE}.{i}" for i in COMPRESSED])


r.case("tape_eager_average", tape_case, "tape_eager_average", False)


def join_then_continue():
    """The last rank runs out of data a step early and joins: the others' step runs with its
    zeros standing in; after join() every rank restarts Q and error feedback, agrees on the
    step count (the others reduced 4 plain steps, it 3: without agreeing, its next step would
    be plain while theirs is compressed), and the ranks train on identically."""
    compression = hvd.Compression.powersgd(rank=2, start_iter=4, seed=99)
    ws = [tf.Variable(w) for w in initial_weights()]

    def step(case, s):
        x, y = data(case, s, RANK)
        with tf.GradientTape() as tape:
            loss = loss_of(ws, tf.constant(x), tf.constant(y))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(LR * g)

    for s in range(3 if RANK == SIZE - 1 else 4):
        step("join", s)
    hvd.join()
    bits = COMM.allgather(b"".join(w.numpy().tobytes() for w in ws))
    assert len(set(bits)) > 1, "the joined rank should lag one step"
    hvd.broadcast_variables(ws, root_rank=0)
    for s in range(2):
        step("join.after", s)
        same_in_set([w.numpy() for w in ws], None)


r.case("join_then_continue", join_then_continue)
r.case("tape_function_sum", tape_case, "tape_function_sum", True, op=hvd.Sum)


def tape_process_set():
    """A set of two ranks, and sets of one (every reduction there is the identity: PowerSGD
    submits no collective at all, and its numbers are the reference's for one rank)."""
    from hvdlite.common import core
    mine = next(p for p in SETS_HERE if p.included())
    submitted = []
    real = core.submit_group

    def counting(kind, arrays, *args, **kwargs):
        if ".powersgd." in (kwargs.get("name") or ""):
            submitted.append(kwargs["name"])
        return real(kind, arrays, *args, **kwargs)

    core.submit_group = counting
    try:
        tape_case("tape_process_set", True, process_set=mine)
    finally:
        core.submit_group = real
    if mine.size() == 1:
        assert submitted == [], f"a set of one rank submitted {submitted}"
    else:   # 2 plain steps, then 3 of the uncompressed bucket, P and Q
        assert len(submitted) == 2 + 3 * 3, submitted


r.case("tape_process_set", tape_process_set)


def keras_model():
    model = keras.Sequential([keras.Input((IN,), dtype="float64"),
                              keras.layers.Dense(10, activation="tanh", dtype="float64"),
                              keras.layers.Dense(8, activation="tanh", dtype="float64"),
                              keras.layers.Dense(3, dtype="float64")])
    model.set_weights(initial_weights())
    return model


def keras_case(case, run_eagerly, op=hvd.Average, passes=1, steps=5):
    compression = hvdk.Compression.powersgd(rank=2, start_iter=2, seed=len(case))
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(LR), compression=compression, op=op,
                                    backward_passes_per_step=passes)
    model = keras_model()
    model.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly)
    ref = reference.Reference(compression.config, SIZE, average=op == hvd.Average)
    for s in range(steps):
        before = model.get_weights()
        ws = [tf.Variable(w) for w in before]
        expected = reduced_by_reference(ref, local_grads(ws, case, s, KERAS, passes), None,
                                        op == hvd.Average)[0]
        for k in range(passes):
            model.train_on_batch(*data(case, s * passes + k, RANK))
        after = model.get_weights()
        for i, (b, a) in enumerate(zip(before, after)):
            np.testing.assert_allclose(a, b - LR * expected[f"{KERAS}.{i}"], rtol=0,
                                       atol=1e-12, err_msg=f"step {s} weight {i}")
        same_in_set(after, None)


r.case("keras_function", keras_case, "keras_function", False)
r.case("keras_eager_sum", keras_case, "keras_eager_sum", True, op=hvd.Sum)
r.case("keras_backward_passes", keras_case, "keras_backward_passes", False, passes=2)


def legacy_optimizer():
    """The TF1 DistributedOptimizer, eagerly: compute_gradients returns the reference's."""
    name, case = "DistributedOptimizer.DistributedGradientDescentOptimizer", "legacy"
    compression = hvd.Compression.powersgd(rank=2, start_iter=1)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                   compression=compression)
    ref = reference.Reference(compression.config, SIZE)
    ws = [tf.Variable(w) for w in initial_weights()]
    for s in range(3):
        expected = reduced_by_reference(ref, local_grads(ws, case, s, name), None, True)[0]
        x, y = (tf.constant(a) for a in data(case, s, RANK))
        pairs = opt.compute_gradients(lambda: loss_of(ws, x, y), ws)
        for i, (g, _) in enumerate(pairs):
            np.testing.assert_allclose(g.numpy(), expected[f"{name}.{i}"], rtol=0, atol=1e-12)
        opt.apply_gradients(pairs)
        same_in_set([w.numpy() for w in ws], None)


r.case("legacy_optimizer_eager", legacy_optimizer)


def wire_dtypes():
    """fp16 / bf16 factors: the variables stay identical across ranks, near the exact step."""
    for dtype in (tf.float16, "bfloat16"):
        case = f"wire_{dtype}"
        compression = hvd.Compression.powersgd(rank=2, start_iter=1, seed=11, dtype=dtype)
        ws = [tf.Variable(w) for w in initial_weights()]
        for s in range(3):
            x, y = data(case, s, RANK)
            with tf.GradientTape() as tape:
                loss = loss_of(ws, tf.constant(x), tf.constant(y))
            tape = hvd.DistributedGradientTape(tape, compression=compression)
            grads = tape.gradient(loss, ws)
            assert all(np.isfinite(g.numpy()).all() for g in grads)
            same_in_set([g.numpy() for g in grads], None)


r.case("wire_fp16_bf16", wire_dtypes)


def refused():
    """Adasum (and Min/Max) are refused when the tape or optimizer is made; per-tensor use is
    a TypeError."""
    compression = hvd.Compression.powersgd()
    for op in (hvd.Adasum, hvd.Max):
        for make in (lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=op,
                                                         compression=compression),
                     lambda: hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), op=op,
                                                       compression=compression)):
            try:
                make()
            except ValueError as exc:
                assert "PowerSGD supports op=Average and op=Sum only" in str(exc), exc
            else:
                raise AssertionError(f"{op} accepted")
    try:
        hvd.allreduce(tf.ones(3), compression=compression)
    except TypeError:
        pass
    else:
        raise AssertionError("per-tensor powersgd accepted")
    try:
        hvd.Compression.powersgd(dtype=tf.int32)
    except ValueError:
        pass
    else:
        raise AssertionError("dtype=tf.int32 accepted")


r.case("adasum_refused", refused)
r.write()
