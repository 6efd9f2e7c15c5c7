#!/usr/bin/env python3
"""One rank of benchmarks/keras_backends.py: the MLP of examples/pytorch_synthetic_benchmark.py
(512-2048-2048-10, ~5.3M parameters) trained by Keras 3 on the backend ``KERAS_BACKEND`` names,
through ``hvdlite.keras``'s DistributedOptimizer (or the plain optimizer with
``--no-distributed-optimizer``), with the compiled ``train_on_batch`` step; rank 0 writes the
slowest rank's samples/sec times the number of ranks to ``--json`` (as that example does).

``--jax`` trains the same MLP without Keras: ``hvdlite.jax``'s optax ``DistributedOptimizer``
(SGD with momentum) inside one ``jax.jit``-ed step (``--no-distributed-optimizer``: plain optax).

``--in-jit`` instead times one grouped allreduce of the MLP's six gradients three ways: numpy
arrays through hvdlite's engine (``hvdlite.grouped_allreduce``), jax arrays through
``hvdlite.jax`` eagerly, and the same inside ``jax.jit`` (the ordered ``io_callback`` that the
Keras-JAX step uses): what running the collective in the compiled step costs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One compute thread per rank on every backend (OMP_NUM_THREADS does not reach XLA's CPU pool).
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1")
import numpy as np  # noqa: E402

SHAPES = [(512, 2048), (2048,), (2048, 2048), (2048,), (2048, 10), (10,)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--in-jit", action="store_true", help="time the allreduce in jax.jit")
    p.add_argument("--jax", action="store_true", help="train with hvdlite.jax and optax")
    p.add_argument("--json", help="write the results to this file (rank 0)")
    return p.parse_args(argv)


def train(args: argparse.Namespace, hvd) -> dict:
    import keras
    keras.utils.set_random_seed(1234)
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    if not args.no_distributed_optimizer:
        opt = hvd.DistributedOptimizer(opt)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(args.batch_size, 512)).astype(np.float32)
    y = rng.integers(0, 10, args.batch_size)
    for _ in range(args.num_warmup_batches):
        model.train_on_batch(x, y)
    rates = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            model.train_on_batch(x, y)
        rates.append(args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start))
    per_rank = float(np.median(rates))
    slowest = float(hvd.allreduce(np.array(per_rank), op=hvd.Min, name="sps.min"))
    return {"backend": keras.backend.backend(), "per_rank": slowest,
            "total": slowest * hvd.size(), "ranks": hvd.size(),
            "distributed_optimizer": not args.no_distributed_optimizer}


def train_jax(args: argparse.Namespace, hvd) -> dict:
    """The MLP trained by a jitted jax + optax step, gradients averaged by hvdlite.jax."""
    import jax
    import jax.numpy as jnp
    import optax
    import hvdlite.jax as hvd_jax
    keys = jax.random.split(jax.random.PRNGKey(1234), 3)
    dims = [512, 2048, 2048, 10]
    params = [(jax.random.normal(k, (a, b), jnp.float32) * (2.0 / a) ** 0.5,
               jnp.zeros((b,), jnp.float32)) for k, a, b in zip(keys, dims, dims[1:])]
    params = hvd_jax.broadcast_parameters(params, root_rank=0)
    opt = optax.sgd(0.01 * hvd.size(), momentum=0.9)
    if not args.no_distributed_optimizer:
        opt = hvd_jax.DistributedOptimizer(opt)
    state = opt.init(params)

    def loss(params, x, y):
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(hvd.rank())
    x = jnp.asarray(rng.normal(size=(args.batch_size, 512)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, args.batch_size))
    for _ in range(args.num_warmup_batches):
        params, state = jax.block_until_ready(step(params, state, x, y))
    rates = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            params, state = step(params, state, x, y)
        jax.block_until_ready(params)
        rates.append(args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start))
    slowest = float(hvd.allreduce(np.array(float(np.median(rates))), op=hvd.Min,
                                  name="sps.min"))
    return {"backend": "hvdlite.jax", "per_rank": slowest, "total": slowest * hvd.size(),
            "ranks": hvd.size(), "distributed_optimizer": not args.no_distributed_optimizer}


def in_jit(args: argparse.Namespace, hvd) -> dict:
    import jax
    import jax.numpy as jnp
    import hvdlite
    import hvdlite.jax as hvd_jax
    arrays = [np.ones(s, np.float32) for s in SHAPES]
    jarrays = [jnp.asarray(a) for a in arrays]
    jitted = jax.jit(lambda xs: hvd_jax.grouped_allreduce(xs, name="jit"))
    ways = {"numpy": lambda: hvdlite.grouped_allreduce(arrays, name="numpy"),
            "jax_eager": lambda: jax.block_until_ready(
                hvd_jax.grouped_allreduce(jarrays, name="eager")),
            "jax_jit": lambda: jax.block_until_ready(jitted(jarrays))}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for k, fn in ways.items():
        fn()   # warm up (and compile)
    for _ in range(args.num_iters):
        for k, fn in ways.items():   # interleaved
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(args.num_batches_per_iter):
                fn()
            times[k].append((time.perf_counter() - start) / args.num_batches_per_iter)
    ms = {k: max(hvd.allgather_object(statistics.median(v))) * 1e3 for k, v in times.items()}
    return {"in_jit_ms": ms, "ranks": hvd.size(),
            "megabytes": sum(a.nbytes for a in arrays) / 1e6}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.jax:
        os.environ["KERAS_BACKEND"] = "jax"   # (hvdlite.keras's init and collectives below)
    if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    import hvdlite.keras as hvd
    hvd.init()
    result = (in_jit(args, hvd) if args.in_jit else train_jax(args, hvd) if args.jax
              else train(args, hvd))
    if hvd.rank() == 0:
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
