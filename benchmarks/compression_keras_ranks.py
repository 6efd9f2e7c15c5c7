#!/usr/bin/env python3
"""The ranks' side of ``compression_benchmark.py --framework keras``: the same bandwidth-bound
MLP as ``compression_ranks.py``, built with Keras (TensorFlow backend) and trained through
``hvdlite.tensorflow.keras.DistributedOptimizer(..., compression=X)`` for each compression X, in
one job.

Run it under MPI (``compression_benchmark.py`` does, on simulated hosts, or alone at 1 rank)::

    mpiexec -n 4 -hosts a:2,b:2 python benchmarks/compression_keras_ranks.py --json out.json

For each compression a fresh model (the same seed on every rank, so no broadcast crosses the
link) and optimizer run ``--warmup`` steps (at least ``start_iter + 1``) and then ``--steps``
timed ones; a step is one ``model.train_on_batch`` (Keras' compiled step: forward, backward,
the DistributedOptimizer's reduction, the update); its time is the slowest rank's, and a
configuration's is the median over its timed steps.  The JSON is ``compression_ranks.py``'s
(without the split of where the time went, which wraps torch's optimizer only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import hvdlite.tensorflow.keras as hvd  # noqa: E402
from compression_steps import (common_arguments, job_document, print_result,  # noqa: E402
                               run_ranks, step_result)   # (benchmarks/ is on sys.path)



def parse_args(argv=None) -> argparse.Namespace:
    p = common_arguments(__doc__.splitlines()[0])
    return p.parse_args(argv)


def mlp(widths: list[int], classes: int) -> keras.Model:
    """Dense layers of ``widths`` with ReLUs, then a ``classes``-way head (as the torch MLP)."""
    layers = [keras.Input((widths[0],))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths[1:]]
    return keras.Sequential(layers + [keras.layers.Dense(classes)])


def compression_of(name: str, start_iter: int):
    """``compression=`` for a configuration name (none, fp16, powersgd<rank>)."""
    if name.startswith("powersgd"):
        return hvd.Compression.powersgd(rank=int(name[len("powersgd"):]), start_iter=start_iter)
    return getattr(hvd.Compression, name)


def run_config(name: str, args, widths: list[int], data, comm) -> dict:
    """Warm-up and timed steps of one compression; the slowest rank's times per step."""
    keras.utils.set_random_seed(0)   # the same initial model on every rank
    model = mlp(widths, args.classes)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1e-3),
                                         compression=compression_of(name, args.start_iter))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data
    warmup = max(args.warmup, args.start_iter + 1)
    times = []
    for i in range(warmup + args.steps):
        t0 = time.perf_counter()
        model.train_on_batch(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    per_rank = comm.allgather(times)
    step_s = [max(r[i] for r in per_rank) for i in range(args.steps)]
    shapes = [tuple(int(d) for d in w.shape) for w in model.trainable_weights]
    del optimizer, model
    return step_result(name, step_s, args.batch_size, comm.Get_size(), shapes, {})


def main(argv=None) -> int:
    args = parse_args(argv)
    hvd.init()
    from mpi4py import MPI   # (after init: hvdlite initialised MPI)
    comm = MPI.COMM_WORLD
    hosts = len(set(comm.allgather(MPI.Get_processor_name())))
    widths = [int(w) for w in args.widths.split(",")]
    rng = np.random.default_rng(args.seed + hvd.rank())
    data = (rng.standard_normal((args.batch_size, widths[0])).astype(np.float32),
            rng.integers(0, args.classes, args.batch_size))
    params = sum(int(np.prod(w.shape)) for w in mlp(widths, args.classes).trainable_weights)
    results = []
    for name in [n for n in args.compressions.split(",") if n]:
        results.append(run_config(name, args, widths, data, comm))
        if hvd.rank() == 0:
            print_result(results[-1])
    if args.json and hvd.rank() == 0:
        model = {"widths": widths, "classes": args.classes}
        Path(args.json).write_text(json.dumps(job_document(
            args, hvd.size(), hosts, params, model, results, framework="keras"), indent=2)
            + "\n")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    run_ranks(main)
