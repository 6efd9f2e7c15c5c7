"""DistributedOptimizer with process_set= and with op=Adasum, on every rank.

* process sets: ranks are split into sets (static, via hvd.init(process_sets=...)); each set
  trains its own copy of a small model.  Parameters must be bitwise identical within a set and
  match a single-process reference trained on the concatenation of that set's shards; sets do
  not mix (a set's result differs from the other set's).
* Adasum (power-of-two jobs): plain SGD, so the update is lr * Adasum(per-rank gradients) per
  parameter tensor; the reference recomputes every rank's gradient locally and combines them
  with the numpy Adasum tree (tests/core/workers/core_adasum_kernel_worker.py).
* At a non-power-of-two size, op=Adasum is refused when the optimizer is built.
"""
import copy

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd
from tests.core.workers import core_adasum_kernel_worker as ada
import torch_cases as C

torch.set_num_threads(1)
SETS = {2: [[0], [1]], 3: [[0, 1], [2]], 4: [[0, 2], [1, 3]]}


def mpi_world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


COMM = mpi_world()
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
SETS_HERE = [hvd.ProcessSet(ranks) for ranks in SETS[SIZE]]
hvd.init(process_sets=SETS_HERE)
MINE = next(ps for ps in SETS_HERE if ps.included())
r = C.synced_reporter(RANK, COMM)
B, IN, OUT, STEPS = 4, 5, 3, 4


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 6), nn.Tanh(), nn.Linear(6, OUT)).double()


def data(step, rank):
    g = torch.Generator().manual_seed(C.seed_of("opt_sets", step, rank))
    return (torch.randn(B, IN, generator=g, dtype=torch.float64),
            torch.randn(B, OUT, generator=g, dtype=torch.float64))


def bits(model):
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def process_set_training():
    model = make_model()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=MINE)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = data(step, RANK)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        # reference: the mean loss over the set = mean of members' mean losses (equal shards)
        ref_opt.zero_grad()
        parts = [data(step, m) for m in MINE.ranks]
        loss = sum(F.mse_loss(ref(px), py) for px, py in parts) / len(parts)
        loss.backward()
        ref_opt.step()
    everyone = COMM.allgather(bits(model))
    for other in MINE.ranks:
        assert everyone[other] == everyone[RANK], f"rank {other} differs within {MINE}"
    others = [k for k in range(SIZE) if k not in MINE.ranks]
    assert all(everyone[k] != everyone[RANK] for k in others), "sets were mixed"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def non_member_local_optimizer():
    """On a rank outside its process set, DistributedOptimizer is (as in Horovod) the plain
    local optimizer: it trains on this rank's data alone, bit for bit like the unwrapped
    optimizer, with step(), synchronize() + skip_synchronize() and step(closure), and reduces
    nothing (a reduction over any set would change the numbers or wait for ever)."""
    other = next(ps for ps in SETS_HERE if not ps.included())
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                   named_parameters=model.named_parameters(), process_set=other)
    assert isinstance(opt, torch.optim.SGD)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    for step in range(STEPS):
        x, y = data(step, RANK)
        for m, o in ((model, opt), (ref, ref_opt)):
            def closure(m=m, o=o):
                o.zero_grad()
                loss = F.mse_loss(m(x), y)
                loss.backward()
                return loss

            if step == 3:   # the optimizer calls the closure (LBFGS-style)
                o.step(closure)
                continue
            closure()
            if step == 2 and o is opt:
                opt.synchronize()
                with opt.skip_synchronize():
                    opt.step()
            else:
                o.step()
    assert bits(model) == bits(ref), "the non-member's local training differs"
    assert bits(model) != bits(make_model()), "never trained"
    assert opt._parameter_names == {p: n for n, p in sorted(model.named_parameters())}


def adasum_training():
    model = make_model()
    ref = copy.deepcopy(model)
    if SIZE & (SIZE - 1):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), op=hvd.Adasum)
        except NotImplementedError as exc:   # (as Horovod's; also a ValueError)
            assert isinstance(exc, ValueError) and "power-of-two" in str(exc), str(exc)
            return
        raise AssertionError("op=Adasum accepted on a non-power-of-two job")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    for step in range(STEPS):
        x, y = data(step, RANK)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        grads = []   # every rank's gradient at the reference's current parameters
        for k in range(SIZE):
            ref.zero_grad()
            kx, ky = data(step, k)
            F.mse_loss(ref(kx), ky).backward()
            grads.append([p.grad.detach().numpy().copy() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                combined = ada.adasum_tree([g[i].reshape(-1) for g in grads])
                p -= 0.1 * torch.from_numpy(combined.reshape(p.shape))
    assert all(b == bits(model) for b in COMM.allgather(bits(model))), "ranks differ"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
    assert not torch.equal(model[0].weight, make_model()[0].weight), "never trained"


CASES = {"process_set_training": process_set_training,
         "non_member_local_optimizer": non_member_local_optimizer,
         "adasum_training": adasum_training}
for name, fn in CASES.items():
    r.case(name, fn)
r.write()
hvd.shutdown()
