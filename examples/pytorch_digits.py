"""Data-parallel training of a small classifier on scikit-learn's bundled digits data set.

Runs anywhere without a download:

    hvdlite run -np 2 python examples/pytorch_digits.py

What a Horovod user expects from a real training script, with hvdlite:
  * each rank trains on its own shard of the training set;
  * gradients are averaged by DistributedOptimizer while backward runs;
  * rank 0's initial weights and optimizer state are broadcast to every rank;
  * per-epoch loss/accuracy are averaged across ranks and printed by rank 0 only;
  * rank 0 writes a checkpoint each epoch (atomically: a job killed mid-write keeps the previous
    one); --resume continues from it, or starts afresh when there is none yet, so a job that
    is restarted after a failure (e.g. by Kubernetes, examples/kubernetes/) picks up where the
    last checkpoint left it;
  * test accuracy is computed over the whole test set (sharded, then summed) at the end.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvdlite.torch as hvd


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank "
                   "(scaled by the number of ranks, as Horovod recommends)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpoint", default="checkpoints/pytorch_digits.pt",
                   help="checkpoint path written by rank 0 ('' disables)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint if it exists (else start from epoch 0)")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
    p.add_argument("--compression", choices=["none", "fp16", "bf16", "powersgd"], default=None,
                   help="gradient compression (default none; --fp16-allreduce means fp16); "
                        "powersgd: low-rank gradients, see docs/compression.md")
    p.add_argument("--powersgd-rank", type=int, default=2,
                   help="rank of the PowerSGD factors (with --compression powersgd)")
    p.add_argument("--powersgd-start-iter", type=int, default=10,
                   help="plain allreduce steps before PowerSGD starts")
    p.add_argument("--cuda", action="store_true",
                   help="train on the GPU of this rank's local rank (gradients go through NCCL; "
                        "with HVDLITE_GPU_OPERATIONS=mpi several ranks may share one GPU)")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit non-zero if the final test accuracy is below this")
    return p.parse_args(argv)


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def load_data(seed: int):
    """Same split on every rank (fixed seed); the training part is then sharded by rank."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.from_numpy(x_train), torch.from_numpy(y_train),
            torch.from_numpy(x_test), torch.from_numpy(y_test))


def shard(n: int) -> slice:
    """This rank's contiguous slice of n samples (equal sizes; the remainder is dropped so every
    rank runs the same number of steps)."""
    per_rank = n // hvd.size()
    return slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name).item()


def save_checkpoint(path: str, state: dict) -> None:
    """Write ``state`` to ``path`` through a temporary file renamed over it: a job killed while
    writing (a lost node, a restart) leaves the previous checkpoint whole, not a truncated file
    that every restart would then fail to load."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = path + ".partial"
    torch.save(state, partial)
    os.replace(partial, path)


def choose_compression(args: argparse.Namespace):
    """The ``compression=`` for DistributedOptimizer that the flags ask for."""
    kind = args.compression or ("fp16" if args.fp16_allreduce else "none")
    if kind == "powersgd":
        # The PowerSGD state (Q, error feedback) is not in the checkpoint: after --resume it
        # starts over, with plain allreduces for --powersgd-start-iter steps.
        return hvd.Compression.powersgd(rank=args.powersgd_rank,
                                        start_iter=args.powersgd_start_iter)
    return getattr(hvd.Compression, kind)


def train_epoch(model, optimizer, x, y, batch_size: int, epoch: int) -> tuple[float, float]:
    model.train()
    generator = torch.Generator().manual_seed(1000 * epoch + hvd.rank())
    order = torch.randperm(len(x), generator=generator).to(x.device)
    total_loss, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        idx = order[start:start + batch_size]
        optimizer.zero_grad()
        logits = model(x[idx])
        loss = F.cross_entropy(logits, y[idx])
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(idx)
        correct += (logits.argmax(1) == y[idx]).sum().item()
    return (metric_average(total_loss / len(x), "train.loss"),
            metric_average(correct / len(x), "train.accuracy"))


def evaluate(model, x, y) -> float:
    """Accuracy over the whole test set: each rank scores its part, counts are summed."""
    model.eval()
    part = slice(hvd.rank() * len(x) // hvd.size(), (hvd.rank() + 1) * len(x) // hvd.size())
    with torch.no_grad():
        correct = (model(x[part]).argmax(1) == y[part]).sum()
    counts = hvd.allreduce(torch.tensor([correct.item(), len(y[part])], dtype=torch.int64,
                                        device=x.device), op=hvd.Sum, name="test.counts")
    return counts[0].item() / counts[1].item()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hvd.init()
    torch.manual_seed(args.seed + hvd.rank())  # different init per rank: broadcast fixes it

    x_train, y_train, x_test, y_test = load_data(args.seed)
    part = shard(len(x_train))
    x_train, y_train = x_train[part], y_train[part]

    device = torch.device("cpu")
    if args.cuda:   # one GPU per rank, picked from the local rank (as with Horovod)
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    x_train, y_train, x_test, y_test = (t.to(device) for t in (x_train, y_train, x_test, y_test))

    model = DigitsNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)
    start_epoch = 0
    if args.resume and hvd.rank() == 0 and args.checkpoint and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = choose_compression(args)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    if hvd.rank() == 0:
        print(f"training on {hvd.size()} ranks, {len(x_train)} samples per rank, "
              f"epochs {start_epoch}..{args.epochs - 1}", flush=True)
    t0 = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        loss, acc = train_epoch(model, optimizer, x_train, y_train, args.batch_size, epoch)
        if hvd.rank() == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}  train accuracy {acc:.4f}", flush=True)
            if args.checkpoint:
                save_checkpoint(args.checkpoint, {"model": model.state_dict(),
                                                  "optimizer": optimizer.state_dict(),
                                                  "epoch": epoch})
    accuracy = evaluate(model, x_test, y_test)
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} ({time.perf_counter() - t0:.1f} s of training)",
              flush=True)
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
