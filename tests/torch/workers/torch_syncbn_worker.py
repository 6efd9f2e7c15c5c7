"""hvdlite.torch SyncBatchNorm on every rank, checked against nn.BatchNorm on the whole batch.

Every rank builds every rank's (differently sized) batch, so besides running SyncBatchNorm on its
own batch it can run a reference ``nn.BatchNorm*d`` on the concatenation and compare: its slice
of the output and of the input gradient, the running statistics, and the weight/bias gradients
summed over ranks.  The upstream gradient is random, as the gradient of ``out.sum()`` through
batch norm is zero.
"""
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

torch.set_num_threads(1)

import torch_cases as C

import hvdlite.torch as hvd
import hvdlite.torch.sync_batch_norm as sbn_module
from hvdlite.torch import autograd
from hvdlite.torch.sync_batch_norm import SyncBatchNorm
from tests.torch.test_syncbn import SYNCBN_CASES

hvd.init()
from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK, SIZE = hvd.rank(), hvd.size()
r = C.synced_reporter(RANK, COMM)
CH = 4
SPATIAL = {"1d": (), "1d_seq": (5,), "2d": (3, 4), "3d": (2, 3, 2)}
REF_CLASS = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 2e-5),
       torch.float16: (1e-2, 2e-2), torch.bfloat16: (3e-2, 8e-2)}   # (rtol, atol)


def default_rows(k: int) -> int:
    return 3 + k


def make_input(case, step, k, spatial, rows, shift=0.0, what="x"):
    g = torch.Generator().manual_seed(C.seed_of(case, what, step, k))
    return torch.randn((rows, CH) + spatial, generator=g, dtype=torch.float64) * 2.0 + 0.5 + shift


def all_sum(t: torch.Tensor) -> torch.Tensor:
    # hvdlite's allreduce, not mpi4py's: if another rank has already failed, the stall check
    # fails this rank's case instead of leaving it blocked in an mpi4py collective for good
    return hvd.allreduce(t.detach().double(), op=hvd.Sum)


def close(actual, expected, dtype, what):
    rtol, atol = TOL.get(dtype, dtype)   # a dtype, or an explicit (rtol, atol)
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(), rtol=rtol,
                               atol=atol, msg=lambda m: f"{what}: {m}")


def randomize_affine(*modules):
    g = torch.Generator().manual_seed(123)
    w, b = torch.rand(CH, generator=g) + 0.5, torch.randn(CH, generator=g)
    with torch.no_grad():
        for m in modules:
            if m.weight is not None:
                m.weight.copy_(w)
                m.bias.copy_(b)


class Counter:
    """Count the allreduces issued by SyncBatchNorm's forward and by allreduce's backward."""

    def __enter__(self):
        self.forward = self.backward = 0
        self._saved = sbn_module.allreduce, autograd.differentiable_allreduce

        def fwd(*args, **kwargs):
            self.forward += 1
            return self._saved[0](*args, **kwargs)

        def bwd(*args, **kwargs):
            self.backward += 1
            return self._saved[1](*args, **kwargs)

        sbn_module.allreduce, autograd.differentiable_allreduce = fwd, bwd
        return self

    def __exit__(self, *exc):
        sbn_module.allreduce, autograd.differentiable_allreduce = self._saved


def step_and_compare(case, step, sync, ref, shape, dtype, ref_dtype, rows, shift=0.0,
                     channels_last=False, grad=True, tol=None):
    dtype_tol = tol or dtype
    spatial = SPATIAL[shape]
    xs = [make_input(case, step, k, spatial, rows(k), shift) for k in range(SIZE)]
    gs = [make_input(case, step, k, spatial, rows(k), what="g") for k in range(SIZE)]
    offset = sum(rows(k) for k in range(RANK))
    mine = slice(offset, offset + rows(RANK))
    x = xs[RANK].to(dtype, copy=True)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(grad)
    xf = torch.cat(xs).to(dtype).to(ref_dtype).requires_grad_(grad)   # the same values as x
    for p in list(sync.parameters()) + list(ref.parameters()):
        p.grad = None
    if grad:
        out = sync(x)
        (out.double() * gs[RANK]).sum().backward()
        outf = ref(xf)
        (outf.double() * torch.cat(gs)).sum().backward()
    else:
        with torch.no_grad():
            out, outf = sync(x), ref(xf)
    assert out.dtype == dtype and out.shape == x.shape, (out.dtype, out.shape)
    close(out, outf[mine], dtype_tol, f"step {step} output")
    if grad:
        close(x.grad, xf.grad[mine], dtype_tol, f"step {step} input grad")
        for name in ("weight", "bias"):
            if getattr(ref, name) is not None:
                close(all_sum(getattr(sync, name).grad), getattr(ref, name).grad, dtype_tol,
                      f"step {step} {name} grad summed over ranks")
    if ref.running_mean is not None:
        close(sync.running_mean, ref.running_mean, dtype_tol, f"step {step} running_mean")
        close(sync.running_var, ref.running_var, dtype_tol, f"step {step} running_var")
        assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked)


def against_reference(case, shape="1d", dtype=torch.float64, ref_dtype=None, steps=3,
                      momentum=0.1, affine=True, track=True, rows=default_rows, shift=0.0,
                      channels_last=False, grad=True, tol=None):
    """Train ``steps`` steps with SyncBatchNorm and with the reference, then compare eval mode."""
    ref_dtype = ref_dtype or dtype
    kwargs = {"momentum": momentum, "affine": affine, "track_running_stats": track}
    sync = SyncBatchNorm(CH, **kwargs).to(dtype)
    ref = REF_CLASS[len(SPATIAL[shape])](CH, **kwargs).to(ref_dtype)
    randomize_affine(sync, ref)
    for step in range(steps):
        step_and_compare(case, step, sync, ref, shape, dtype, ref_dtype, rows, shift,
                         channels_last, grad, tol)
    sync.eval()
    ref.eval()
    step_and_compare(case, steps, sync, ref, shape, dtype, ref_dtype, rows, shift,
                     channels_last, grad, tol)


# --- cases -------------------------------------------------------------------------------------
def isinstance_and_state_dict(case):
    sync, ref = SyncBatchNorm(CH), nn.BatchNorm2d(CH)
    assert isinstance(sync, _BatchNorm)
    assert list(sync.state_dict()) == list(ref.state_dict())
    randomize_affine(ref)
    with torch.no_grad():
        ref.running_mean.fill_(0.25)
    sync.load_state_dict(ref.state_dict())
    assert torch.equal(sync.weight, ref.weight) and torch.equal(sync.running_mean,
                                                                ref.running_mean)
    assert sync.process_set is None
    frozen = SyncBatchNorm(CH, affine=False, track_running_stats=False)
    assert frozen.weight is None and frozen.running_mean is None


def bad_input_raises_locally(case):
    sync = SyncBatchNorm(CH)
    with Counter() as counter:
        for bad in (torch.zeros(CH), torch.zeros(3, CH + 1)):
            try:
                sync(bad)
            except ValueError:
                pass
            else:
                raise AssertionError(f"no ValueError for shape {tuple(bad.shape)}")
    assert counter.forward == 0, "communicated before validating the input"


def empty_rank(case):
    against_reference(case, rows=lambda k: 0 if k == 1 else default_rows(k))


def all_ranks_empty(case):
    sync = SyncBatchNorm(CH).double()
    x = torch.zeros(0, CH, 3, dtype=torch.float64, requires_grad=True)
    out = sync(x)
    assert out.shape == (0, CH, 3)
    out.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(sync.running_mean, torch.zeros(CH))
    assert torch.equal(sync.running_var, torch.ones(CH))
    assert int(sync.num_batches_tracked) == 1


def global_count_one_raises(case):
    sync = SyncBatchNorm(CH).double()
    x = torch.ones(1 if RANK == 0 else 0, CH, dtype=torch.float64)
    try:
        sync(x)
    except ValueError as exc:
        assert "more than 1 value per channel" in str(exc), exc
    else:
        raise AssertionError("no ValueError for one value per channel over all ranks")
    against_reference(case, steps=1)   # the job still works afterwards


def eval_without_communication(case):
    sync, ref = SyncBatchNorm(CH).double(), nn.BatchNorm1d(CH).double()
    randomize_affine(sync, ref)
    for step in range(2):
        step_and_compare(case, step, sync, ref, "1d_seq", torch.float64, torch.float64,
                         default_rows)
    sync.eval()
    ref.eval()
    with Counter() as counter:
        step_and_compare(case, 2, sync, ref, "1d_seq", torch.float64, torch.float64,
                         default_rows)
        if RANK == 0:   # rank 0 alone runs extra passes: they must not be collectives
            x = torch.ones(2, CH, 5, dtype=torch.float64, requires_grad=True)
            sync(x).sum().backward()
    assert counter.forward == counter.backward == 0, vars(counter)


def one_allreduce_each_way(case):
    sync = SyncBatchNorm(CH).double()
    x = make_input(case, 0, RANK, (3,), default_rows(RANK)).requires_grad_()
    with Counter() as counter:
        (sync(x) * x.detach()).sum().backward()
    expected = (1, 1) if SIZE > 1 else (0, 0)   # one rank: plain nn.BatchNorm
    assert (counter.forward, counter.backward) == expected, vars(counter)


class Net(nn.Module):
    def __init__(self, bn2d, bn1d):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)   # a bias before BN is inert
        self.bn1 = bn2d(3)
        self.fc1 = nn.Linear(3 * 4 * 4, 6, bias=False)
        self.bn2 = bn1d(6)
        self.fc2 = nn.Linear(6, 1)

    def forward(self, x):
        h = torch.tanh(self.bn1(self.conv(x))).flatten(1)
        return self.fc2(torch.tanh(self.bn2(self.fc1(h))))


def distributed_optimizer(case):
    torch.manual_seed(0)
    model = Net(SyncBatchNorm, SyncBatchNorm).double()
    ref = Net(nn.BatchNorm2d, nn.BatchNorm1d).double()
    ref.load_state_dict(model.state_dict())
    init = copy.deepcopy(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rows = [default_rows(k) for k in range(SIZE)]
    for step in range(4):
        g = torch.Generator().manual_seed(C.seed_of(case, step))
        xs = [torch.randn(n, 2, 4, 4, generator=g, dtype=torch.float64) for n in rows]
        ys = [torch.randn(n, 1, generator=g, dtype=torch.float64) for n in rows]
        opt.zero_grad()
        F.mse_loss(model(xs[RANK]), ys[RANK]).backward()
        opt.step()
        ref_opt.zero_grad()   # DistributedOptimizer averages: the mean of the per-rank losses
        outs = ref(torch.cat(xs)).split(rows)
        (sum(F.mse_loss(o, y) for o, y in zip(outs, ys)) / SIZE).backward()
        ref_opt.step()
    for (name, t), (_, t_ref) in zip(model.state_dict().items(), ref.state_dict().items()):
        gathered = hvd.allgather(t.reshape(1, -1))
        assert all(torch.equal(row, gathered[0]) for row in gathered), f"{name!r} differs"
        torch.testing.assert_close(t.double(), t_ref.double(), rtol=1e-9, atol=1e-10,
                                   msg=lambda m, name=name: f"{name!r}: {m}")
    for (name, p), p0 in zip(model.named_parameters(), init.parameters()):
        assert not torch.equal(p, p0), f"{name!r} never changed"


CASES = {
    "api.isinstance_and_state_dict": isinstance_and_state_dict,
    "api.bad_input_raises_locally": bad_input_raises_locally,
    **{f"train.{shape}.{dt}": (lambda c, shape=shape, dt=dt: against_reference(
        c, shape, getattr(torch, dt))) for shape in SPATIAL for dt in ("float64", "float32")},
    "train.2d_channels_last.float64": lambda c: against_reference(c, "2d", channels_last=True),
    "train.momentum_none.float64": lambda c: against_reference(c, "1d_seq", momentum=None,
                                                                steps=4),
    "train.affine_false.float64": lambda c: against_reference(c, "2d", affine=False),
    "train.no_running_stats.float64": lambda c: against_reference(c, "1d_seq", track=False),
    "train.empty_rank.float64": empty_rank,
    # float32 data around 1000, std 2: a float32 sum-of-squares variance would be off by ~1e-2;
    # rounding the mean to float32 shifts x_hat by ~2e-5 (as in nn.BatchNorm1d in float32)
    "train.large_mean.float32": lambda c: against_reference(c, "1d_seq", torch.float32,
                                                             torch.float64, shift=1000.0,
                                                             tol=(1e-4, 1e-3)),
    "train.float16": lambda c: against_reference(c, "2d", torch.float16, torch.float64),
    "train.bfloat16": lambda c: against_reference(c, "2d", torch.bfloat16, torch.float64),
    "train.no_grad_forward": lambda c: against_reference(c, "1d", grad=False),
    "edge.all_ranks_empty": all_ranks_empty,
    "edge.global_count_one_raises": global_count_one_raises,
    "eval.uses_running_stats_without_communication": eval_without_communication,
    "collectives.one_allreduce_forward_one_backward": one_allreduce_each_way,
    "model.distributed_optimizer": distributed_optimizer,
}
assert list(CASES) == SYNCBN_CASES, sorted(set(CASES) ^ set(SYNCBN_CASES))
for case, fn in CASES.items():
    r.case(case, fn, case)
r.write()
hvd.shutdown()
