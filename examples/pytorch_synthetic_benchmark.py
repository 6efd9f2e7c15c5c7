"""Training throughput on synthetic data (samples/sec per rank and in total).

    hvdlite run -np 2 python examples/pytorch_synthetic_benchmark.py --model mlp --batch-size 64
    hvdlite run -np 1 python examples/pytorch_synthetic_benchmark.py --cuda --batch-size 4096

Models need no download: ``mlp`` (~5.3M parameters in 6 tensors, matmul-bound, only ~2 FLOPs per
parameter and sample: the worst case for communication), ``convnet`` (a small CNN on 32x32 images,
~1.2M parameters), ``resnet10`` (a ResNet on 32x32 images, 4.9M parameters, with the compute per
gradient byte of ResNet-50 on ImageNet, the model of Horovod's own synthetic benchmark; ~0.65 s per
step of 32 samples on one core here) and ``deep`` (32 residual blocks of Linear(256, 256) and
LayerNorm, ~2.1M parameters in 130 small tensors: what DistributedOptimizer's gradient buckets are
for, see HVDLITE_GRADIENT_BUCKET_MB). ``--no-distributed-optimizer`` runs the bare optimizer (for
measuring hvdlite's overhead at one rank); adding ``--lockstep`` keeps the ranks in step with one
scalar allreduce per step but exchanges no gradients (the cost of synchronous steps alone, see
benchmarks/training_scaling.py). ``--cuda`` trains on ``cuda:<local_rank % device_count>``
(gradients go through NCCL, or through host memory with HVDLITE_GPU_OPERATIONS=mpi) and
synchronizes the device around every timed region, so the samples/sec count finished work, not
queued kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd


def build_model(name: str) -> tuple[nn.Module, tuple[int, ...], int]:
    """(model, per-sample input shape, number of classes)."""
    if name == "mlp":
        return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                             nn.Linear(2048, 10)), (512,), 10
    if name == "convnet":
        class ConvNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.c1 = nn.Conv2d(3, 32, 3, padding=1)
                self.c2 = nn.Conv2d(32, 64, 3, padding=1)
                self.c3 = nn.Conv2d(64, 128, 3, padding=1)
                self.fc = nn.Linear(128 * 4 * 4, 512)
                self.out = nn.Linear(512, 10)

            def forward(self, x):
                x = F.max_pool2d(F.relu(self.c1(x)), 2)
                x = F.max_pool2d(F.relu(self.c2(x)), 2)
                x = F.max_pool2d(F.relu(self.c3(x)), 2)
                return self.out(F.relu(self.fc(x.flatten(1))))
        return ConvNet(), (3, 32, 32), 10
    if name == "resnet10":
        return ResNet10(), (3, 32, 32), 10
    if name == "deep":
        class Block(nn.Module):
            def __init__(self, width: int) -> None:
                super().__init__()
                self.fc = nn.Linear(width, width)
                self.norm = nn.LayerNorm(width)

            def forward(self, x):
                return x + F.relu(self.norm(self.fc(x)))

        return nn.Sequential(*[Block(256) for _ in range(32)], nn.Linear(256, 10)), (256,), 10
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


MODELS = ["mlp", "convnet", "resnet10", "deep"]


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with batch norm and a shortcut (1x1 where the shape
    changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.n2(self.c2(F.relu(self.n1(self.c1(x)))))
        return F.relu(y + self.shortcut(x))


class ResNet10(nn.Module):
    """ResNet-18's widths with one block per stage, for 32x32 images: 4.9M parameters in 38
    tensors, ~0.5 GFLOP per sample forward.  That is ~100 FLOPs per parameter and sample, the
    ratio of compute to gradient bytes of ResNet-50 on ImageNet (~160), the model Horovod's
    own synthetic benchmark trains, at a size one CPU core steps through 32 samples of in
    well under a second."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU())
        self.stages = nn.Sequential(BasicBlock(64, 64, 1), BasicBlock(64, 128, 2),
                                    BasicBlock(128, 256, 2), BasicBlock(256, 512, 2))
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=MODELS)
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="use the bare optimizer (no gradient averaging)")
    p.add_argument("--lockstep", action="store_true",
                   help="with --no-distributed-optimizer: one scalar allreduce per step keeps "
                        "the ranks in step (no gradients exchanged)")
    p.add_argument("--cuda", action="store_true",
                   help="train on the GPU cuda:<local_rank %% device count> (default: CPU)")
    p.add_argument("--json", help="write the results to this file (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.lockstep and not args.no_distributed_optimizer:
        print("pytorch_synthetic_benchmark: --lockstep goes with --no-distributed-optimizer",
              file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.cuda and not torch.cuda.is_available():
        print("pytorch_synthetic_benchmark: --cuda needs a CUDA GPU, and torch.cuda.is_available() "
              "is False here (no GPU/driver, or a CPU-only PyTorch build).", file=sys.stderr)
        return 2
    hvd.init()
    device = torch.device("cpu")
    if args.cuda:   # one GPU per local rank, as in Horovod (ranks share one when GPUs are fewer)
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(1234)
    model, in_shape, classes = build_model(args.model)
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if not args.no_distributed_optimizer:
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression)
    data = torch.randn(args.batch_size, *in_shape).to(device)
    target = torch.randint(0, classes, (args.batch_size,)).to(device)
    step_token = torch.zeros(1, device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        if args.lockstep:   # no rank starts its next step before every rank finished this one
            hvd.allreduce(step_token, name="lockstep")

    def timed(steps: int) -> float:
        """Seconds for ``steps`` training steps.  On a GPU the device is synchronized before the
        clock starts and before it stops: kernels are asynchronous, and without the final
        synchronize the bare optimizer would be timed on queued, not finished, work."""
        if device.type != "cuda":
            return timeit.timeit(benchmark_step, number=steps)
        torch.cuda.synchronize(device)

        def run() -> None:
            for _ in range(steps):
                benchmark_step()
            torch.cuda.synchronize(device)
        return timeit.timeit(run, number=1)

    params = sum(p.numel() for p in model.parameters())
    if hvd.rank() == 0:
        where = "CPU"
        if device.type == "cuda":
            where = (f"{device} ({torch.cuda.get_device_name(device)}), GPU operations: "
                     f"{os.environ.get('HVDLITE_GPU_OPERATIONS') or 'nccl'}")
        print(f"model {args.model} ({params / 1e6:.2f}M parameters), batch size "
              f"{args.batch_size}, {hvd.size()} rank(s), "
              f"{'bare optimizer' if args.no_distributed_optimizer else 'DistributedOptimizer'}"
              f"{' in lockstep' if args.lockstep else ''}"
              f", on {where}", flush=True)
    timed(args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        seconds = timed(args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        if hvd.rank() == 0:
            print(f"iter #{i}: {rates[-1]:.1f} samples/sec per rank", flush=True)
    per_rank = float(np.median(rates))
    # A job is as fast as its slowest rank.
    slowest = hvd.allreduce(torch.tensor(per_rank, dtype=torch.float64), op=hvd.Min,
                            name="sps.min").item()
    total = slowest * hvd.size()
    if hvd.rank() == 0:
        print(f"samples/sec per rank: {slowest:.1f} (median of {args.num_iters} iters, "
              f"slowest rank); total on {hvd.size()} rank(s): {total:.1f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "params": params, "ranks": hvd.size(),
                           "batch_size": args.batch_size, "per_rank": slowest, "total": total,
                           "distributed_optimizer": not args.no_distributed_optimizer,
                           "lockstep": args.lockstep,
                           "device": device.type,
                           "gpu_operations": (os.environ.get("HVDLITE_GPU_OPERATIONS") or "nccl")
                           if device.type == "cuda" else None}, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
