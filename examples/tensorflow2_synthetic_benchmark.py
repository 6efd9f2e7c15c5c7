"""TF2 training throughput on synthetic data (samples/sec per rank and in total).

    hvdlite run -np 2 python examples/tensorflow2_synthetic_benchmark.py --model mlp

Models need no download: ``mlp`` (~5.3M parameters, matmul-bound), ``convnet`` (a small CNN on
32x32 images) and ``resnet10`` (the ResNet of the PyTorch benchmark, 4.9M parameters). The step is
a ``tf.function`` with ``hvd.DistributedGradientTape``, as in Horovod's
``tensorflow2_synthetic_benchmark.py``; ``--no-distributed-tape`` measures the bare step (hvdlite's
overhead at one rank); with ``--lockstep`` too, one scalar allreduce per step keeps the ranks in
step without exchanging gradients (see benchmarks/training_scaling.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402


def build_model(name: str):
    import keras
    if name == "mlp":
        return keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048, activation="relu"),
                                 keras.layers.Dense(2048, activation="relu"),
                                 keras.layers.Dense(10)]), (512,)
    if name == "convnet":
        L = keras.layers
        return keras.Sequential([keras.Input((32, 32, 3)),
                                 L.Conv2D(32, 3, padding="same", activation="relu"),
                                 L.MaxPooling2D(),
                                 L.Conv2D(64, 3, padding="same", activation="relu"),
                                 L.MaxPooling2D(),
                                 L.Conv2D(128, 3, padding="same", activation="relu"),
                                 L.MaxPooling2D(), L.Flatten(),
                                 L.Dense(512, activation="relu"), L.Dense(10)]), (32, 32, 3)
    if name == "resnet10":
        return resnet10(keras), (32, 32, 3)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


MODELS = ["mlp", "convnet", "resnet10"]


def resnet10(keras):
    """The ResNet of examples/pytorch_synthetic_benchmark.py (ResNet-18's widths, one basic
    block per stage, 32x32 images; 4.9M trainable parameters), in Keras."""
    L = keras.layers

    def conv_bn(x, filters, kernel, stride):
        x = L.Conv2D(filters, kernel, stride, padding="same", use_bias=False)(x)
        return L.BatchNormalization(epsilon=1e-5, momentum=0.9)(x)

    def block(x, filters, stride):
        y = L.ReLU()(conv_bn(x, filters, 3, stride))
        y = conv_bn(y, filters, 3, 1)
        shortcut = x if stride == 1 and x.shape[-1] == filters else conv_bn(x, filters, 1, stride)
        return L.ReLU()(L.Add()([y, shortcut]))

    inputs = keras.Input((32, 32, 3))
    x = L.ReLU()(conv_bn(inputs, 64, 3, 1))
    for filters, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = block(x, filters, stride)
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=MODELS)
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--no-distributed-tape", action="store_true",
                   help="plain GradientTape (no gradient averaging)")
    p.add_argument("--lockstep", action="store_true",
                   help="with --no-distributed-tape: one scalar allreduce per step keeps the "
                        "ranks in step (no gradients exchanged)")
    p.add_argument("--json", help="write the results to this file (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.lockstep and not args.no_distributed_tape:
        print("tensorflow2_synthetic_benchmark: --lockstep goes with --no-distributed-tape",
              file=sys.stderr)
        return 2
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    import keras
    keras.utils.set_random_seed(1234)
    model, in_shape = build_model(args.model)
    opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    data = tf.random.normal((args.batch_size,) + in_shape)
    target = tf.random.uniform((args.batch_size,), 0, 10, dtype=tf.int64)

    @tf.function
    def benchmark_step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        if not args.no_distributed_tape:
            tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if args.lockstep:   # no rank starts its next step before every rank finished this one
            hvd.allreduce(tf.zeros([1]), name="lockstep")
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if hvd.rank() == 0:
        print(f"model {args.model} ({params / 1e6:.2f}M parameters), batch size "
              f"{args.batch_size}, {hvd.size()} rank(s), "
              f"{'plain tape' if args.no_distributed_tape else 'DistributedGradientTape'}"
              f"{' in lockstep' if args.lockstep else ''}",
              flush=True)
    benchmark_step(True)
    timeit.timeit(lambda: benchmark_step(False), number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(lambda: benchmark_step(False), number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        if hvd.rank() == 0:
            print(f"iter #{i}: {rates[-1]:.1f} samples/sec per rank", flush=True)
    per_rank = float(np.median(rates))
    # A job is as fast as its slowest rank.
    slowest = float(hvd.allreduce(tf.constant(per_rank, tf.float64), op=hvd.Min,
                                  name="sps.min").numpy())
    total = slowest * hvd.size()
    if hvd.rank() == 0:
        print(f"samples/sec per rank: {slowest:.1f} (median of {args.num_iters} iters, "
              f"slowest rank); total on {hvd.size()} rank(s): {total:.1f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "params": params, "ranks": hvd.size(),
                           "batch_size": args.batch_size, "per_rank": slowest, "total": total,
                           "distributed_tape": not args.no_distributed_tape,
                           "lockstep": args.lockstep}, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
