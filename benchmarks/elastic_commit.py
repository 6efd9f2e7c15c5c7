"""What ``state.commit()`` costs in an elastic job: a commit per step against no commit.

Run under the elastic driver, so that commits travel to it as they do in a real job::

    hvdlite run -np 2 --min-np 2 -H localhost:2 python benchmarks/elastic_commit.py --model digits
    hvdlite run -np 2 --min-np 2 -H localhost:2 python benchmarks/elastic_commit.py --model mlp

Models: ``digits`` (examples/pytorch_digits.py's 64-128-64-10 network, 17k parameters, batch
32 per rank) and ``mlp`` (examples/pytorch_synthetic_benchmark.py's 5.3M-parameter MLP, batch
64).  Both train with SGD and momentum through ``hvd.DistributedOptimizer`` inside
``hvd.elastic.run``, with a ``TorchState`` holding the model, the optimizer and an
``ElasticSampler``.  Rounds alternate "step" and "step + commit" blocks so that machine noise
hits both alike; medians.  Reported (rank 0's view; rank 1's commit time too):

  step_ms          a training step without commit
  step_commit_ms   a training step followed by ``state.commit()``
  overhead         step_commit_ms / step_ms - 1
  commit_ms        ``state.commit()`` alone, timed around the call, per rank
  ship_ms          rank 0: from a commit until the driver holds it (the background transfer)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd
from hvdlite.common.api.elastic import _session


def digits_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def mlp_model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1536), nn.ReLU(),
                         nn.Linear(1536, 256), nn.ReLU(), nn.Linear(256, 10))


MODELS = {"digits": (digits_model, (64,), 32), "mlp": (mlp_model, (3, 32, 32), 64)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="digits")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=30, help="steps per block")
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    make, shape, batch = MODELS[args.model]
    torch.manual_seed(0)
    model = make()
    params = sum(p.numel() for p in model.parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())
    data = torch.randn(batch * 8, *shape)
    target = torch.randint(0, 10, (batch * 8,))
    sampler = hvd.elastic.ElasticSampler(range(10_000), seed=1)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def step(i: int) -> None:
        rows = slice((i % 8) * batch, (i % 8 + 1) * batch)
        optimizer.zero_grad()
        F.cross_entropy(model(data[rows]), target[rows]).backward()
        optimizer.step()
        state.batch += 1
        sampler.record_batch(state.batch, batch)

    @hvd.elastic.run
    def bench(state):
        session = _session()   # (the driver's connection, to time the shipping)
        for i in range(10):   # warm up, commits included
            step(i)
            state.commit()
        plain, committed, commits, ships = [], [], [], []
        for _ in range(args.rounds):
            hvd.barrier()
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(i)
            plain.append((time.perf_counter() - t0) / args.steps)
            hvd.barrier()
            spent = 0.0
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(i)
                c0 = time.perf_counter()
                state.commit()
                spent += time.perf_counter() - c0
            committed.append((time.perf_counter() - t0) / args.steps)
            commits.append(spent / args.steps)
            s0 = time.perf_counter()
            state.commit()
            if session is not None and session.shipper is not None:   # rank 0 ships
                session.shipper.flush(60)
                ships.append(time.perf_counter() - s0)
        return plain, committed, commits, ships

    plain, committed, commits, ships = bench(state)
    commit_ms = hvd.allgather_object(statistics.median(commits) * 1e3)
    if hvd.rank() == 0:
        result = {"model": args.model, "parameters": params, "ranks": hvd.size(),
                  "step_ms": statistics.median(plain) * 1e3,
                  "step_commit_ms": statistics.median(committed) * 1e3,
                  "overhead": statistics.median(committed) / statistics.median(plain) - 1,
                  "commit_ms": commit_ms,
                  "ship_ms": statistics.median(ships) * 1e3 if ships else None}
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
