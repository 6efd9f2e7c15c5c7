"""Elastic Keras ``model.fit`` training on the digits data set: workers may fail, hosts may come
and go, and training goes on from the last commit.

    hvdlite run -np 4 --min-np 2 --max-np 4 -H host1:2,host2:2,host3:2 \\
        python examples/keras_elastic_digits.py

The Horovod elastic Keras recipe (docs/elastic.md), unchanged but for the import:
  * a ``KerasState`` holds the model, its optimizer and the epoch; ``@hvd.elastic.run`` wraps
    the training, which starts from the state synchronized from rank 0;
  * ``CommitStateCallback`` commits every ``--batches-per-commit`` batches and at the end of each
    epoch, ``UpdateEpochStateCallback`` counts the epochs across resets;
  * a reset callback scales the learning rate with the new number of ranks.

Keras 3 fixes an epoch's length when ``fit`` starts, so Horovod's way of cutting short the first
epoch after a reset (``UpdateBatchStateCallback``) has no effect there.  This example therefore
runs one ``fit`` per epoch on the samples of the epoch not yet trained on, dealt out over the
current ranks as ``ElasticSampler`` does for PyTorch: every rank shuffles the epoch the same way,
``state.processed`` counts the samples done (committed with the rest), and rank ``r`` of ``R``
takes every ``R``-th of the rest.  Within an epoch no sample is trained on twice after a commit
and none is skipped.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hvdlite.tensorflow.keras as hvd  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank "
                   "(scaled by the number of ranks, as Horovod recommends)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batches-per-commit", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--epoch-seconds", type=float, default=0.0,
                   help="make each epoch last at least this long (to watch a job react to a "
                        "failure or a new host)")
    p.add_argument("--compression", choices=["none", "fp16", "bf16", "powersgd"],
                   default="none", help="gradient compression; powersgd (rank 2, 10 plain "
                   "steps first) starts its factors and error feedback over in every world")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit non-zero if the final test accuracy is below this")
    return p.parse_args(argv)


def this_ranks_part(n: int, seed: int, epoch: int, processed: int) -> np.ndarray:
    """The indices this rank trains on for what remains of ``epoch``: ElasticSampler's deal."""
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    remaining = order[processed:]
    per_rank = math.ceil(len(remaining) / hvd.size())
    padded = remaining + remaining[:per_rank * hvd.size() - len(remaining)]
    return np.array(padded[hvd.rank()::hvd.size()], dtype=np.int64)


class CountSamples(tf.keras.callbacks.Callback):
    """``state.processed``: the samples of this epoch that every rank together has trained on."""

    def __init__(self, state, batch_size: int) -> None:
        super().__init__()
        self.state, self.batch_size = state, batch_size

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.state.processed += self.batch_size * hvd.size()

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.processed = 0


def main(argv=None) -> int:
    args = parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    import keras
    keras.utils.set_random_seed(args.seed)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2,
                                                        random_state=args.seed, stratify=y)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                   "bf16": hvd.Compression.bf16,
                   "powersgd": hvd.Compression.powersgd(rank=2, start_iter=10)}[args.compression]
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=args.lr * hvd.size(),
                                                              momentum=args.momentum),
                                         compression=compression)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    state = hvd.elastic.KerasState(model, optimizer, epoch=0, processed=0)

    def on_reset() -> None:   # after a reset, before the state is synchronized
        optimizer.learning_rate.assign(args.lr * hvd.size())

    state.register_reset_callbacks([on_reset])
    callbacks = [CountSamples(state, args.batch_size),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit)]

    @hvd.elastic.run
    def train(state) -> None:
        if hvd.rank() == 0:
            print(f"training on {hvd.size()} ranks from epoch {state.epoch}, "
                  f"{state.processed} samples of it done", flush=True)
        while state.epoch < args.epochs:
            started = time.perf_counter()
            part = this_ranks_part(len(x_train), args.seed, state.epoch, state.processed)
            epoch = state.epoch
            history = model.fit(x_train[part], y_train[part], batch_size=args.batch_size,
                                epochs=1, shuffle=False, callbacks=callbacks, verbose=0)
            time.sleep(max(0.0, args.epoch_seconds - (time.perf_counter() - started)))
            loss = hvd.allreduce(np.array(history.history["loss"][-1]), name="train.loss")
            if hvd.rank() == 0:
                print(f"epoch {epoch:3d}  loss {float(loss):.4f}  ({hvd.size()} ranks)",
                      flush=True)

    t0 = time.perf_counter()
    train(state)
    part = slice(hvd.rank() * len(x_test) // hvd.size(),
                 (hvd.rank() + 1) * len(x_test) // hvd.size())
    logits = model.predict(x_test[part], verbose=0)
    correct = int((np.argmax(logits, 1) == y_test[part]).sum())
    counts = hvd.allreduce(np.array([correct, len(y_test[part])], dtype=np.int64),
                           op=hvd.Sum, name="test.counts")
    accuracy = counts[0] / counts[1]
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} ({time.perf_counter() - t0:.1f} s of training)",
              flush=True)
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
