"""DistributedOptimizer(compression=Compression.powersgd(...)) on every rank.

Each case trains a small float64 MLP with plain SGD, so the reduced gradient is what the
optimizer applies.  Every step the ranks' local gradients are gathered (mpi4py, independently of
hvdlite) and fed to the numpy reference (powersgd_reference.py), which keeps Q and every rank's
error feedback; the reduced ``.grad`` must match it, and parameters must be bitwise identical
across ranks after every step.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)

import hvdlite.torch as hvd  # noqa: E402
import torch_cases as C  # noqa: E402
from powersgd_reference import Reference  # noqa: E402

from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
SETS = {2: [[0], [1]], 3: [[0, 1], [2]]}
SETS_HERE = [hvd.ProcessSet(ranks) for ranks in SETS[SIZE]]
hvd.init(process_sets=SETS_HERE)
MINE = next(ps for ps in SETS_HERE if ps.included())
r = C.synced_reporter(RANK, COMM)
B, IN = 4, 12
COMPRESSED = ("0.weight", "2.weight")    # 10x12 and 8x10 compress at rank 2
UNCOMPRESSED = ("4.weight",)             # 3x8: rate 24/22 < 2, travels whole


def make_model(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(),
                         nn.Linear(8, 3)).to(dtype)


def data(case, step, rank, dtype=torch.float64):
    g = torch.Generator().manual_seed(C.seed_of("powersgd", case, step, rank))
    return (torch.randn(B, IN, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, 3, generator=g, dtype=torch.float64).to(dtype))


def bits(model):
    return b"".join(p.detach().float().numpy().tobytes() for p in model.parameters())


def local_grads(model, case, step, passes=1):
    """This rank's own gradient (summed over ``passes`` backward passes), without hvdlite."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for k in range(passes):
        x, y = data(case, (step, k), RANK, params[0].dtype)
        for t, g in zip(total, torch.autograd.grad(F.mse_loss(model(x), y), params)):
            t += g
    # (keyed by the names on the wire, which also seed the initial Q)
    return {f"allreduce.{name}": t.double().numpy()
            for (name, _), t in zip(model.named_parameters(), total)}


def train(case, steps, comm=COMM, op=hvd.Average, passes=1, dtype=None, process_set=None,
          atol=1e-12, **kw):
    model_dtype = torch.float32 if dtype is not None else torch.float64
    model = make_model(model_dtype)
    compression = hvd.Compression.powersgd(dtype=dtype, **kw)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=op,
                                   compression=compression, backward_passes_per_step=passes,
                                   process_set=process_set)
    ref = Reference(compression.config, comm.Get_size(), average=op == hvd.Average)
    named = {f"allreduce.{name}": p for name, p in model.named_parameters()}
    differs = set()
    for step in range(steps):
        expected = ref.step(comm.allgather(local_grads(model, case, step, passes)))
        opt.zero_grad()
        for k in range(passes):
            x, y = data(case, (step, k), RANK, model_dtype)
            F.mse_loss(model(x), y).backward()
        for name, want in expected.items():
            got = named[name].grad.double().numpy()
            np.testing.assert_allclose(got, want, rtol=0 if dtype is None else 2e-2,
                                       atol=atol, err_msg=f"{case} step {step} {name}")
            mean = sum(g[name] for g in comm.allgather(local_grads(model, case, step, passes)))
            if not np.allclose(got * (comm.Get_size() if op == hvd.Average else 1), mean):
                differs.add((step >= kw.get("start_iter", 10), name))
        opt.step()
        assert len(set(comm.allgather(bits(model)))) == 1, f"{case}: ranks differ at {step}"
    return differs


def average_exact():
    differs = train("avg", 6, rank=2, start_iter=2)
    # compressed matrices are approximated (so not the mean) only once compression started;
    # vectors and small matrices are always the exact mean
    assert {name for late, name in differs if not late} == set(), differs
    assert {name for late, name in differs} == {f"allreduce.{n}" for n in COMPRESSED}, differs


def sum_exact():
    train("sum", 4, op=hvd.Sum, rank=2, start_iter=1)


def no_warm_start_no_error_feedback():
    train("cold", 4, rank=1, start_iter=0, warm_start=False, error_feedback=False)


def passes_per_step():
    train("passes", 4, passes=2, rank=2, start_iter=1)


def process_set():
    """A set of two ranks, and sets of one (where every reduction is the identity and PowerSGD
    submits no collective at all, but its arithmetic is the same)."""
    import hvdlite.torch.powersgd_reducer as reducer_module
    submitted = []
    real = reducer_module.grouped_allreduce_async_

    def counting(tensors, *args, **kwargs):
        submitted.append(kwargs.get("name"))
        return real(tensors, *args, **kwargs)

    reducer_module.grouped_allreduce_async_ = counting
    try:
        comm = COMM.Split(SETS[SIZE].index(MINE.ranks))
        train("set", 4, comm=comm, process_set=MINE, rank=2, start_iter=1)
    finally:
        reducer_module.grouped_allreduce_async_ = real
    if MINE.size() == 1:
        assert submitted == [], f"a set of one rank submitted {submitted}"
    else:
        assert len(submitted) == 1 + 3 * 3, submitted   # plain, then 3 steps of 3 groups:
        # the uncompressed bucket, P and Q


def fp16_factors():
    # float32 model, fp16 on the wire: close to the float64 reference, identical across ranks
    train("fp16", 4, dtype=torch.float16, rank=2, start_iter=1, atol=2e-3)


def adasum_refused():
    model = make_model()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                 compression=hvd.Compression.powersgd())
    except ValueError as exc:
        assert "Average and op=Sum only" in str(exc), str(exc)
    else:
        raise AssertionError("op=Adasum accepted with PowerSGD")


def join_then_continue():
    """The last rank runs out of data a step early and joins: it stands in with zeros; after
    join() every rank restarts Q and error feedback and agrees on the step count."""
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=2, start_iter=1))
    steps = 3 if RANK == SIZE - 1 else 4
    for step in range(steps):
        opt.zero_grad()
        x, y = data("join", step, RANK)
        F.mse_loss(model(x), y).backward()
        opt.step()
    hvd.join()
    assert len(set(COMM.allgather(bits(model)))) > 1, "the joined rank should lag one step"
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(2):
        opt.zero_grad()
        x, y = data("join-after", step, RANK)
        F.mse_loss(model(x), y).backward()
        opt.step()
        assert len(set(COMM.allgather(bits(model)))) == 1, f"ranks differ after join {step}"
    counts = COMM.allgather(opt._reducer.state.counter.steps)
    assert len(set(counts)) == 1, f"step counts differ after join: {counts}"


CASES = {"average_exact": average_exact, "sum_exact": sum_exact,
         "no_warm_start_no_error_feedback": no_warm_start_no_error_feedback,
         "passes_per_step": passes_per_step, "process_set": process_set,
         "fp16_factors": fp16_factors, "adasum_refused": adasum_refused,
         "join_then_continue": join_then_continue}
for name, fn in CASES.items():
    r.case(name, fn)
r.write()
hvd.shutdown()
