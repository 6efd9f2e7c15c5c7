"""Keras ``model.fit`` data-parallel training on scikit-learn's bundled digits data set.

Runs anywhere without a download, on any Keras 3 backend:

    hvdlite run -np 2 python examples/keras_digits.py                   # TensorFlow
    hvdlite run -np 2 python examples/keras_digits.py --backend jax     # jax.jit-ed step
    hvdlite run -np 2 python examples/keras_digits.py --backend torch

The Horovod Keras recipe, unchanged but for the import:
  * each rank fits on its own shard of the training set;
  * ``hvd.DistributedOptimizer`` averages gradients across ranks before they are applied;
  * ``BroadcastGlobalVariablesCallback(0)`` starts every rank from rank 0's weights;
  * ``MetricAverageCallback`` averages the epoch metrics over ranks; the learning rate is
    scaled by the number of ranks and warmed up with ``LearningRateWarmupCallback``;
  * rank 0 alone prints progress; test accuracy is computed over the whole test set.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

BACKENDS = ["tensorflow", "jax", "torch"]
hvd = None   # hvdlite.keras, imported once --backend has chosen Keras's backend


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=BACKENDS,
                   default=os.environ.get("KERAS_BACKEND", "tensorflow"),
                   help="Keras 3 backend (sets KERAS_BACKEND; default: it, or tensorflow)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank "
                   "(scaled by the number of ranks, as Horovod recommends)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
    p.add_argument("--compression", choices=["none", "fp16", "bf16", "powersgd"], default=None,
                   help="gradient compression (default none; --fp16-allreduce means fp16); "
                        "powersgd: low-rank gradients, see docs/compression.md")
    p.add_argument("--powersgd-rank", type=int, default=2,
                   help="rank of the PowerSGD factors (with --compression powersgd)")
    p.add_argument("--powersgd-start-iter", type=int, default=10,
                   help="plain allreduce steps before PowerSGD starts")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit non-zero if the final test accuracy is below this")
    return p.parse_args(argv)


def load_data(seed: int):
    """Same split on every rank (fixed seed); the training part is then sharded by rank."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def choose_compression(args: argparse.Namespace):
    """The ``compression=`` for DistributedOptimizer that the flags ask for."""
    kind = args.compression or ("fp16" if args.fp16_allreduce else "none")
    if kind == "powersgd":
        if args.backend != "tensorflow":
            raise SystemExit("keras_digits: --compression powersgd needs --backend tensorflow")
        return hvd.Compression.powersgd(rank=args.powersgd_rank,
                                        start_iter=args.powersgd_start_iter)
    return getattr(hvd.Compression, kind)


def main(argv=None) -> int:
    global hvd
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend   # before Keras is imported
    if args.backend == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import hvdlite.keras
    hvd = hvdlite.keras   # hvdlite.tensorflow.keras's objects on TensorFlow
    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())   # different init: the broadcast fixes it

    x_train, x_test, y_train, y_test = load_data(args.seed)
    per_rank = len(x_train) // hvd.size()
    part = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    x_train, y_train = x_train[part], y_train[part]

    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    scaled_lr = args.lr * hvd.size()
    compression = choose_compression(args)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=scaled_lr,
                                                        momentum=args.momentum),
                                   compression=compression)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:
        print(f"training on {hvd.size()} ranks ({keras.backend.backend()} backend), "
              f"{len(x_train)} samples per rank, "
              f"{args.epochs} epochs", flush=True)
    t0 = time.perf_counter()
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    seconds = time.perf_counter() - t0

    # Accuracy over the whole test set: each rank scores its part, counts are summed.
    part = slice(hvd.rank() * len(x_test) // hvd.size(),
                 (hvd.rank() + 1) * len(x_test) // hvd.size())
    logits = model.predict(x_test[part], verbose=0)
    correct = int((np.argmax(logits, 1) == y_test[part]).sum())
    counts = hvd.allreduce(np.array([correct, len(y_test[part])], dtype=np.int64),
                           op=hvd.Sum, name="test.counts")
    accuracy = counts[0] / counts[1]
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} ({seconds:.1f} s of training)", flush=True)
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
