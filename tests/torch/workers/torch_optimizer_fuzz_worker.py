"""DistributedOptimizer in randomly drawn configurations against a single-process reference.

Each seed draws a configuration (backward_passes_per_step, groups, compression, op,
gradient_predivide_factor, SGD / SGD with momentum / Adam, named or positional parameters, an
embedding with sparse or sparse-as-dense gradients, step with a closure, gradient clipping
through synchronize/skip_synchronize, a frozen parameter) and trains a small model for a few
steps in which every rank uses a random subset of the model's branches: so parameters lack a
gradient on some ranks, on all of them, or (an embedding) the first time they are reduced.
The reference, built on every rank, computes every rank's gradients itself, combines them as
the optimizer should (zeros for a rank without a gradient), and steps a plain optimizer.
Parameters must be identical on every rank and match the reference.

argv: comma-separated seeds; each seed is one reported case, ``seed<k>``.
"""
from __future__ import annotations

import copy
import random
import sys
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)

import hvdlite.torch as hvd  # noqa: E402
import torch_cases as C  # noqa: E402

hvd.init()
from mpi4py import MPI  # noqa: E402

RANK, SIZE = hvd.rank(), hvd.size()
B, STEPS = 4, 4


def draw_config(seed: int) -> dict:
    g = random.Random(seed)
    cfg = dict(bpps=g.choice([1, 1, 2]), groups=g.choice([None, None, 2, "list"]),
               compression=g.choice(["none", "none", "fp16"]),
               op=g.choice(["Average", "Average", "Sum"]), predivide=1.0,
               optim=g.choice(["sgd", "adam"]), named=g.random() < 0.7,
               embedding=g.choice([None, None, "as_dense", "sparse"]), closure=False,
               clip=g.random() < 0.3, frozen=g.random() < 0.3)
    if cfg["op"] == "Average" and g.random() < 0.3:
        cfg["predivide"] = 2.0
    if cfg["embedding"] == "sparse":   # plain SGD: the optimizers that take sparse gradients
        cfg["optim"], cfg["clip"] = "sgd_plain", False
    if cfg["bpps"] == 1 and not cfg["clip"] and g.random() < 0.3:
        cfg["closure"] = True
    return cfg


class Net(nn.Module):
    """Every branch but ``a``/``b`` is used only where ``use`` says so."""

    def __init__(self, embedding):
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 3)
        self.side = nn.Linear(5, 3)
        self.gate = nn.Parameter(torch.ones(3))
        self.emb = nn.Embedding(10, 5, sparse=embedding == "sparse") if embedding else None

    def forward(self, x, idx, use):
        h = x + self.emb(idx) if self.emb is not None and use["emb"] else x
        y = self.b(torch.tanh(self.a(h)))
        if use["side"]:
            y = y + self.side(x)
        return y * self.gate if use["gate"] else y


def shard_data(seed, step, rank, micro):
    g = torch.Generator().manual_seed(C.seed_of("optfuzz", seed, step, rank, micro))
    return (torch.randn(B, 5, generator=g), torch.randint(0, 10, (B,), generator=g),
            torch.randn(B, 3, generator=g))


def usage(seed, step, rank):
    g = random.Random(zlib.crc32(repr(("use", seed, step, rank)).encode()))
    return {"emb": g.random() < 0.7, "side": g.random() < 0.5, "gate": g.random() < 0.6}


def make_opt(cfg, model):
    params = list(model.parameters())
    if cfg["optim"] == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if cfg["optim"] == "sgd_plain":
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.Adam(params, lr=0.01)


def local_grads(cfg, seed, model, step, rank):
    """The gradients rank ``rank`` accumulates in ``step`` (None where it used nothing)."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    use = usage(seed, step, rank)
    for micro in range(cfg["bpps"]):
        x, idx, y = shard_data(seed, step, rank, micro)
        (F.mse_loss(twin(x, idx, use), y) / cfg["bpps"]).backward()
    return [None if p.grad is None else p.grad.to_dense() for p in twin.parameters()]


def reference_step(cfg, seed, ref, ref_opt, step):
    per_rank = [local_grads(cfg, seed, ref, step, r) for r in range(SIZE)]
    for i, p in enumerate(ref.parameters()):
        if not p.requires_grad:
            p.grad = None
            continue
        total = sum(g[i] if g[i] is not None else torch.zeros_like(p) for g in per_rank)
        p.grad = total / SIZE if cfg["op"] == "Average" else total
        if cfg["embedding"] == "sparse" and p is ref.emb.weight:
            p.grad = p.grad.to_sparse()
    if cfg["clip"]:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()


def distributed_step(cfg, seed, model, opt, step):
    use = usage(seed, step, RANK)

    def backward():
        for micro in range(cfg["bpps"]):
            x, idx, y = shard_data(seed, step, RANK, micro)
            (F.mse_loss(model(x, idx, use), y) / cfg["bpps"]).backward()

    if cfg["closure"]:
        def closure():
            opt.zero_grad()
            backward()
            return torch.tensor(0.0)
        opt.step(closure)
        return
    opt.zero_grad()
    backward()
    if cfg["clip"]:
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()


def run_seed(seed):
    cfg = draw_config(seed)
    torch.manual_seed(seed)
    model = Net(cfg["embedding"])
    if cfg["frozen"]:
        model.a.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    kwargs = dict(backward_passes_per_step=cfg["bpps"], op=getattr(hvd, cfg["op"]),
                  gradient_predivide_factor=cfg["predivide"],
                  compression=getattr(hvd.Compression, cfg["compression"]),
                  sparse_as_dense=cfg["embedding"] == "as_dense")
    if cfg["groups"] == "list":
        kwargs["groups"] = [[model.a.weight, model.b.weight], [model.side.weight, model.gate]]
    elif cfg["groups"]:
        kwargs["groups"] = cfg["groups"]
    opt = hvd.DistributedOptimizer(make_opt(cfg, model), named_parameters=(
        model.named_parameters() if cfg["named"] else None), **kwargs)
    ref_opt = make_opt(cfg, ref)
    for step in range(STEPS):
        distributed_step(cfg, seed, model, opt, step)
        reference_step(cfg, seed, ref, ref_opt, step)
    blob = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes()
    assert all(b == blob for b in MPI.COMM_WORLD.allgather(blob)), \
        f"parameters differ between ranks; config {cfg}"
    tol = 2e-2 if cfg["compression"] == "fp16" else 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=tol,
                                   msg=lambda m, name=name: f"{name!r}, config {cfg}: {m}")


r = C.synced_reporter(RANK, MPI.COMM_WORLD)
for seed in [int(s) for s in sys.argv[1].split(",")]:
    r.case(f"seed{seed}", run_seed, seed)
r.write()
hvd.shutdown()
