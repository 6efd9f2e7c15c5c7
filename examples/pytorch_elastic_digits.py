"""Elastic data-parallel training of the digits classifier: workers may fail, hosts may come and
go, and training goes on from the last commit.

    hvdlite run -np 4 --min-np 2 --max-np 4 -H host1:2,host2:2,host3:2 \\
        python examples/pytorch_elastic_digits.py
    hvdlite run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        python examples/pytorch_elastic_digits.py

The Horovod elastic recipe (docs/elastic.md), unchanged but for the import:
  * everything that must survive a reset is in a ``TorchState``: the model, the optimizer, the
    ``ElasticSampler`` (which samples of the epoch are done) and the epoch;
  * the training loop is wrapped in ``@hvd.elastic.run``: the state is synchronized from rank 0
    before it starts, and after a failure or a change of hosts the new workers pick up from the
    last commit;
  * ``state.commit()`` every few batches (``--batches-per-commit``): a failure rolls back at most
    that many batches; hosts added or removed take effect at a commit, with nothing rolled back;
  * ``sampler.record_batch`` after each batch and ``sampler.set_epoch`` at the end of each epoch:
    after a reset the samples not yet trained on this epoch are dealt out over the new ranks;
  * a reset callback scales the learning rate with the new number of ranks.
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
    p.add_argument("--batches-per-commit", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--epoch-seconds", type=float, default=0.0,
                   help="make each epoch last at least this long (to watch a job react to a "
                        "failure or a new host)")
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
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def load_data(seed: int):
    """Same split on every rank; the sampler gives each rank its part of the training set."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
            torch.from_numpy(x_test), torch.from_numpy(y_test))


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name).item()


def evaluate(model, x, y) -> float:
    """Accuracy over the whole test set: each rank scores its part, counts are summed."""
    model.eval()
    part = slice(hvd.rank() * len(x) // hvd.size(), (hvd.rank() + 1) * len(x) // hvd.size())
    with torch.no_grad():
        correct = (model(x[part]).argmax(1) == y[part]).sum()
    counts = hvd.allreduce(torch.tensor([correct.item(), len(y[part])], dtype=torch.int64),
                           op=hvd.Sum, name="test.counts")
    return counts[0].item() / counts[1].item()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hvd.init()
    torch.manual_seed(args.seed)
    train_set, x_test, y_test = load_data(args.seed)
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def on_reset() -> None:   # after a reset, before the state is synchronized
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state) -> None:
        if hvd.rank() == 0:
            print(f"training on {hvd.size()} ranks from epoch {state.epoch}, "
                  f"{sampler.processed_num} samples of it done", flush=True)
        while state.epoch < args.epochs:
            started = time.perf_counter()
            model.train()
            total_loss, correct, seen = 0.0, 0, 0
            for state.batch, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                loss.backward()
                optimizer.step()
                total_loss += loss.item() * len(y)
                correct += (logits.argmax(1) == y).sum().item()
                seen += len(y)
                sampler.record_batch(state.batch, args.batch_size)
                if (state.batch + 1) % args.batches_per_commit == 0:
                    state.commit()
            time.sleep(max(0.0, args.epoch_seconds - (time.perf_counter() - started)))
            loss = metric_average(total_loss / max(seen, 1), "train.loss")
            accuracy = metric_average(correct / max(seen, 1), "train.accuracy")
            if hvd.rank() == 0:
                print(f"epoch {state.epoch:3d}  loss {loss:.4f}  train accuracy "
                      f"{accuracy:.4f}  ({hvd.size()} ranks)", flush=True)
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)   # at the end of the epoch, not the start
            state.commit()

    t0 = time.perf_counter()
    train(state)
    accuracy = evaluate(model, x_test, y_test)
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} ({time.perf_counter() - t0:.1f} s of training)",
              flush=True)
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
