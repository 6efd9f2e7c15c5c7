"""The synthetic benchmarks' training step, data parallel without hvdlite: the references that
benchmarks/training_scaling.py measures hvdlite against.

  --via mpi   the loop anyone can write with mpi4py: after backward, every gradient is averaged
              with a blocking in-place ``MPI.Allreduce`` on its numpy view (PyTorch), or on the
              numpy arrays the tape returned (TensorFlow), then the optimizer steps
  --via ddp   PyTorch only: ``torch.nn.parallel.DistributedDataParallel`` over the gloo backend
              (torch's own CPU data parallelism: gradient buckets reduced during backward)

Same models, batch, optimizer, warm-up and timing as examples/pytorch_synthetic_benchmark.py and
examples/tensorflow2_synthetic_benchmark.py, and the same JSON result (samples/sec of the
slowest rank), so the numbers compare one to one.  Launch it like them:

    mpiexec -n 2 python benchmarks/reference_training.py --framework torch --via ddp
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import timeit
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
COMM = MPI.COMM_WORLD


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=["torch", "tf"], default="torch")
    p.add_argument("--via", choices=["mpi", "ddp"], default="mpi")
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--json", help="write the results to this file (rank 0)")
    args = p.parse_args(argv)
    if args.via == "ddp" and args.framework != "torch":
        p.error("--via ddp is PyTorch's DistributedDataParallel: use it with --framework torch")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_step(args):
    """(step function, number of parameters) for PyTorch."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(EXAMPLES))
    from pytorch_synthetic_benchmark import build_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(1234)
    model, in_shape, classes = build_model(args.model)
    params = list(model.parameters())
    if args.via == "ddp":
        import torch.distributed as dist
        port = COMM.bcast(_free_port() if COMM.rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=COMM.rank, world_size=COMM.size)
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * COMM.size, momentum=0.9)
    data = torch.randn(args.batch_size, *in_shape)
    target = torch.randint(0, classes, (args.batch_size,))
    scale = 1.0 / COMM.size

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        if args.via == "mpi":
            for p in reversed(params):   # (the order backward produced them in)
                COMM.Allreduce(MPI.IN_PLACE, p.grad.numpy())
                p.grad.mul_(scale)
        optimizer.step()

    return step, sum(p.numel() for p in params)


def tf_step(args):
    """(step function, number of parameters) for TensorFlow."""
    import tensorflow as tf
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    sys.path.insert(0, str(EXAMPLES))
    from tensorflow2_synthetic_benchmark import build_model

    keras.utils.set_random_seed(1234)
    model, in_shape = build_model(args.model)
    opt = keras.optimizers.SGD(0.01 * COMM.size, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.random.normal((args.batch_size,) + in_shape)
    target = tf.random.uniform((args.batch_size,), 0, 10, dtype=tf.int64)
    variables = model.trainable_variables
    scale = 1.0 / COMM.size

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        return tape.gradient(loss, variables)

    @tf.function
    def apply(grads):
        opt.apply_gradients(zip(grads, variables))

    def step() -> None:
        grads = [g.numpy() for g in gradients()]
        for g in grads:
            COMM.Allreduce(MPI.IN_PLACE, g)
            g *= scale
        apply(grads)

    return step, sum(int(np.prod(v.shape)) for v in variables)


def main(argv=None) -> int:
    args = parse_args(argv)
    step, params = (torch_step if args.framework == "torch" else tf_step)(args)
    if COMM.rank == 0:
        print(f"{args.framework} model {args.model} ({params / 1e6:.2f}M parameters), batch size "
              f"{args.batch_size}, {COMM.size} rank(s), data parallel via "
              f"{'mpi4py Allreduce' if args.via == 'mpi' else 'DDP over gloo'}", flush=True)
    timeit.timeit(step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        rates.append(args.batch_size * args.num_batches_per_iter
                     / timeit.timeit(step, number=args.num_batches_per_iter))
        if COMM.rank == 0:
            print(f"iter #{i}: {rates[-1]:.1f} samples/sec per rank", flush=True)
    slowest = COMM.allreduce(float(np.median(rates)), op=MPI.MIN)   # a job is as fast as that
    total = slowest * COMM.size
    if COMM.rank == 0:
        print(f"samples/sec per rank: {slowest:.1f} (median of {args.num_iters} iters, "
              f"slowest rank); total on {COMM.size} rank(s): {total:.1f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"framework": args.framework, "via": args.via, "model": args.model,
                           "params": params, "ranks": COMM.size,
                           "batch_size": args.batch_size, "per_rank": slowest,
                           "total": total}, f)
    if args.via == "ddp":
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
