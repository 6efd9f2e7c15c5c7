"""Custom TF2 training loop (``tf.function`` + ``DistributedGradientTape``) on scikit-learn's
bundled digits data set.

    hvdlite run -np 2 python examples/tensorflow2_digits.py

Horovod's TF2 recipe: wrap the tape in ``hvd.DistributedGradientTape`` so gradients are
averaged across ranks, and broadcast the variables from rank 0 after the first step (when the
optimizer's slots exist).  Test accuracy is computed over the whole test set.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit non-zero if the final test accuracy is below this")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    import keras
    keras.utils.set_random_seed(args.seed + hvd.rank())

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2,
                                                        random_state=args.seed, stratify=y)
    per_rank = len(x_train) // hvd.size()
    x_train = x_train[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]
    y_train = y_train[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]
    steps = per_rank // args.batch_size      # same number of steps on every rank

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=args.momentum)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = loss_fn(labels, logits)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Broadcast after the first step so the optimizer's variables exist (Horovod's recipe).
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} ranks, {per_rank} samples per rank", flush=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed + hvd.rank())
    for epoch in range(args.epochs):
        order = rng.permutation(per_rank)
        total = 0.0
        for b in range(steps):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            total += float(training_step(x_train[idx], y_train[idx],
                                         epoch == 0 and b == 0))
        loss = hvd.allreduce(tf.constant(total / steps), name="epoch.loss").numpy()
        if hvd.rank() == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}", flush=True)
    seconds = time.perf_counter() - t0

    part = slice(hvd.rank() * len(x_test) // hvd.size(),
                 (hvd.rank() + 1) * len(x_test) // hvd.size())
    pred = np.argmax(model(x_test[part]).numpy(), 1)
    counts = hvd.allreduce(tf.constant([int((pred == y_test[part]).sum()), len(pred)],
                                       tf.int64), op=hvd.Sum, name="test.counts").numpy()
    accuracy = counts[0] / counts[1]
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} ({seconds:.1f} s of training)", flush=True)
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
