"""hvdlite.torch.DistributedOptimizer end to end on every rank.

Each case trains a small MLP on this rank's shard of a global batch and compares the result with
(a) every other rank's parameters, bit for bit (via mpi4py, independently of hvdlite), and
(b) a single-process reference trained inside this worker on the whole global batch (the mean loss
over the full batch equals the average of the per-rank mean losses, the shards having equal size).
"""
import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)

import hvdlite.torch as hvd  # noqa: E402
import torch_cases as C  # noqa: E402

hvd.init()
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = hvd.rank(), hvd.size()
r = C.synced_reporter(RANK, COMM)
B = 4                      # rows per rank per step
IN, HID, OUT = 6, 8, 3
STEPS = 5


class MLP(nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, OUT)
        if extra:
            self.extra = nn.Linear(IN, OUT)          # used only where use_extra=True
            self.never = nn.Parameter(torch.ones(2))  # used nowhere

    def forward(self, x, use_extra=False):
        y = self.fc2(torch.tanh(self.fc1(x)))
        if use_extra:
            y = y + self.extra(x)
        return y


def make_model(seed=0, dtype=torch.float32, extra=False):
    torch.manual_seed(seed)
    return MLP(extra).to(dtype)


def batch(case, step, dtype=torch.float32, rows=None):
    g = torch.Generator().manual_seed(C.seed_of(case, "batch", step))
    rows = SIZE * B if rows is None else rows
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(rows, OUT, generator=g, dtype=torch.float64).to(dtype)
    return x, y


def shard(t, k=None):
    k = RANK if k is None else k
    return t[k * B:(k + 1) * B]


bits, close_to, moved = C.bits, C.close_to, C.moved


def same_on_all_ranks(model):
    C.same_on_all_ranks(model, COMM)


def started_by_hooks(opt):
    """A list that records each parameter whose reduction its gradient hook starts, on its own
    or as part of its gradient bucket (whose last member's hook submits it); the end of the
    backward pass then waits for them all, so nothing is in flight when ``backward()``
    returns."""
    started = []
    on_grad_ready = opt._reducer.on_grad_ready

    def spy(p):
        on_grad_ready(p)
        bucket = opt._reducer.bucket_of.get(p)
        if (opt._reducer.handles.get(p, (None,))[0] is not None
                or (bucket is not None and bucket.busy)):
            started.append(p)

    opt._reducer.on_grad_ready = spy
    return started


def sgd(model, lr=0.1, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def one_process_step(ref, ref_opt, x, y):
    """The single-process reference: one step on the whole (unsharded) batch."""
    ref_opt.zero_grad()
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()


def train_dist(case, model, opt, steps=STEPS, micro=1, dtype=torch.float32, clip=None,
               sched=None, use_extra=False, lrs=None, check_grads=None):
    for step in range(steps):
        x, y = batch(case, step, dtype)
        xs, ys = shard(x), shard(y)
        opt.zero_grad()
        for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):
            loss = F.mse_loss(model(xm, use_extra) if use_extra else model(xm), ym) / micro
            loss.backward()
        if clip is not None or check_grads is not None:
            opt.synchronize()
            if check_grads is not None:
                check_grads(model)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        if lrs is not None:
            lrs.append(opt.param_groups[0]["lr"])
        if sched is not None:
            sched.step()


def train_ref(case, model, opt, steps=STEPS, dtype=torch.float32, loss_mul=1.0, clip=None,
              sched=None, lrs=None, loss_fn=None):
    for step in range(steps):
        x, y = batch(case, step, dtype)
        opt.zero_grad()
        loss = (loss_fn(model, x, y) if loss_fn else F.mse_loss(model(x), y)) * loss_mul
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if step == 0:
                assert norm > clip, "test set-up: clipping would not be active"
        opt.step()
        if lrs is not None:
            lrs.append(opt.param_groups[0]["lr"])
        if sched is not None:
            sched.step()


def standard(case, make_opt=sgd, dist_kwargs=None, tol=1e-5, dtype=torch.float32,
             loss_mul=1.0, micro=1, named=True, check_grads=None):
    model = make_model(dtype=dtype)
    init = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(make_opt(model),
                                   named_parameters=model.named_parameters() if named else None,
                                   **(dist_kwargs or {}))
    train_dist(case, model, opt, micro=micro, dtype=dtype, check_grads=check_grads)
    train_ref(case, ref, make_opt(ref), dtype=dtype, loss_mul=loss_mul)
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, tol)


# --- cases -------------------------------------------------------------------------------------
def isinstance_and_api(case):
    model = make_model()
    base = sgd(model)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, torch.optim.Optimizer)
    assert type(opt).__name__ == "SGD", type(opt).__name__
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9
    assert opt.defaults["lr"] == base.defaults["lr"]
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    assert callable(opt.synchronize) and callable(opt.skip_synchronize)
    train_dist(case, model, opt, steps=2)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"} and len(sd["state"]) == 4
    opt.load_state_dict(sd)
    same_on_all_ranks(model)


def parameter_names(case):
    """Horovod's optimizer._parameter_names: {parameter: name} as given (all of
    named_parameters, in name order), or allreduce.noname.<group>.<index> without names; the
    names on the wire stay hvdlite's business (training still works)."""
    model = make_model(extra=True)
    named = list(model.named_parameters())   # also parameters the optimizer does not update
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([{"params": list(model.fc1.parameters())},
                         {"params": list(model.fc2.parameters())}], lr=0.1),
        named_parameters=model.named_parameters())
    assert isinstance(opt._parameter_names, dict)
    assert opt._parameter_names == {p: n for n, p in named}
    assert list(opt._parameter_names.values()) == sorted(n for n, _ in named)
    train_dist(case, model, opt, steps=1)
    plain = make_model(extra=True)
    params = list(plain.parameters())
    opt2 = hvd.DistributedOptimizer(
        torch.optim.SGD([{"params": params[:2]}, {"params": params[2:3]}], lr=0.1))
    expected = {params[0]: "allreduce.noname.0.0", params[1]: "allreduce.noname.0.1",
                params[2]: "allreduce.noname.1.0"}
    assert opt2._parameter_names == expected, list(opt2._parameter_names.values())
    opt2.add_param_group({"params": params[3:]})   # (named like the others, by position)
    assert opt2._parameter_names[params[3]] == "allreduce.noname.2.0"
    train_dist(case + ".unnamed", plain, opt2, steps=1)
    same_on_all_ranks(plain)


def bpps2_partial(case):
    model = make_model()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    half = B // 2
    for step in range(3):
        x, y = batch(case, step)
        opt.zero_grad()
        # only one of the two micro-batches: step() reduces what was accumulated so far
        (F.mse_loss(model(shard(x)[:half]), shard(y)[:half]) / 2).backward()
        opt.step()
    ref_opt = sgd(ref)
    for step in range(3):
        x, y = batch(case, step)
        xf = torch.cat([shard(x, k)[:half] for k in range(SIZE)])
        yf = torch.cat([shard(y, k)[:half] for k in range(SIZE)])
        ref_opt.zero_grad()
        (F.mse_loss(ref(xf), yf) / 2).backward()
        ref_opt.step()
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


def compression(case):
    comp = case.split(".")[1]
    wire = torch.float16 if comp == "fp16" else torch.bfloat16

    def check_grads(model):
        for name, p in model.named_parameters():
            assert p.grad.dtype == torch.float32
            assert torch.equal(p.grad, p.grad.to(wire).float()), \
                f"averaged gradient of {name!r} did not travel as {comp}"
    standard(case, dist_kwargs={"compression": getattr(hvd.Compression, comp)},
             tol=1e-3 if comp == "fp16" else 5e-3, check_grads=check_grads)


def groups_list(case):
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    groups = [[model.fc1.weight, model.fc2.weight], [model.fc1.bias]]   # fc2.bias on its own
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   groups=groups)
    train_dist(case, model, opt)
    train_ref(case, ref, sgd(ref))
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def unused_rank0_only(case):
    model = make_model(extra=True)
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    train_dist(case, model, opt, use_extra=(RANK == 0))

    def loss_fn(m, x, y):   # average over ranks of each rank's loss; only rank 0 uses `extra`
        return sum(F.mse_loss(m(shard(x, k), k == 0), shard(y, k)) for k in range(SIZE)) / SIZE
    train_ref(case, ref, sgd(ref), loss_fn=loss_fn)
    same_on_all_ranks(model)
    moved(model, init, names={"fc1.weight", "fc2.weight", "extra.weight", "extra.bias"})
    assert torch.equal(model.never, init.never), "a parameter used nowhere moved"
    close_to(model, ref, 1e-5)


def unused_everywhere(case):
    model = make_model(extra=True)
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    train_dist(case, model, opt, use_extra=False)
    train_ref(case, ref, sgd(ref))
    same_on_all_ranks(model)
    for name in ("extra.weight", "extra.bias", "never"):
        assert torch.equal(dict(model.named_parameters())[name],
                           dict(init.named_parameters())[name]), f"unused {name!r} moved"
    close_to(model, ref, 1e-5)


def unused_in_group(case):
    model = make_model(extra=True)
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    # a group whose member `extra.weight` gets a gradient on rank 0 only
    groups = [[model.extra.weight, model.fc1.weight], [model.fc2.weight, model.extra.bias]]
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   groups=groups)
    train_dist(case, model, opt, use_extra=(RANK == 0))

    def loss_fn(m, x, y):
        return sum(F.mse_loss(m(shard(x, k), k == 0), shard(y, k)) for k in range(SIZE)) / SIZE
    train_ref(case, ref, sgd(ref), loss_fn=loss_fn)
    same_on_all_ranks(model)
    moved(model, init, names={"fc1.weight", "extra.weight"})
    close_to(model, ref, 1e-5)


class TransposedLinear(nn.Module):
    """A layer whose weight parameter is a non-contiguous (transposed) tensor, so its gradient
    is non-contiguous too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.w = nn.Parameter(torch.randn(OUT, IN).t())      # (IN, OUT), strides (1, IN)
        self.b = nn.Parameter(torch.randn(OUT))

    def forward(self, x, use_extra=False):
        return torch.tanh(x @ self.w) + self.b


def noncontiguous_parameter(case):
    for compression in (hvd.Compression.none, hvd.Compression.fp16):
        model = TransposedLinear()
        assert not model.w.is_contiguous()
        init, ref = copy.deepcopy(model), copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                       compression=compression)
        train_dist(case, model, opt)
        train_ref(case, ref, sgd(ref))
        same_on_all_ranks(model)
        moved(model, init)
        close_to(model, ref, 1e-5 if compression is hvd.Compression.none else 1e-3)


def frozen_parameter(case):
    model = make_model()
    model.fc1.weight.requires_grad_(False)
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   groups=2)
    train_dist(case, model, opt)
    train_ref(case, ref, sgd(ref))
    same_on_all_ranks(model)
    assert torch.equal(model.fc1.weight, init.fc1.weight), "a frozen parameter moved"
    moved(model, init, names={"fc1.bias", "fc2.weight", "fc2.bias"})
    close_to(model, ref, 1e-5)


def clip_grad_norm(case):
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_dist(case, model, opt, clip=0.05)
    assert not [w for w in caught if "synchron" in str(w.message)], \
        [str(w.message) for w in caught]
    train_ref(case, ref, sgd(ref), clip=0.05)
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def steplr(case):
    model = make_model()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_opt = sgd(ref)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    lrs, ref_lrs = [], []
    train_dist(case, model, opt, steps=6, sched=sched, lrs=lrs)
    train_ref(case, ref, ref_opt, steps=6, sched=ref_sched, lrs=ref_lrs)
    assert lrs == ref_lrs == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025], (lrs, ref_lrs)
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


def broadcast_then_train(case):
    model = make_model(seed=100 + RANK)          # different initial parameters on every rank
    ref = make_model(seed=100)                   # rank 0's
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    close_to(model, ref, 0.0, "broadcast parameter")
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    train_dist(case, model, opt)
    train_ref(case, ref, sgd(ref))
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


def wrap_existing_state(case):
    model = make_model()
    ref = copy.deepcopy(model)
    base, ref_opt = sgd(model), sgd(ref)
    for m, o in ((model, base), (ref, ref_opt)):     # two identical local steps everywhere
        for step in range(2):
            x, y = batch(case, 100 + step)
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert len(opt.state_dict()["state"]) == 4, "existing momentum buffers were dropped"
    for p in model.parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], base.state[p]["momentum_buffer"])
    train_dist(case, model, opt)
    train_ref(case, ref, ref_opt)
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


def synchronize_then_step(case):
    """Horovod reduces twice when step() follows synchronize() without skip_synchronize();
    here the gradients, already reduced, are not reduced again: with op=Sum a second
    reduction would multiply them by the number of ranks."""
    model = make_model()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   op=hvd.Sum)
    ref_opt = sgd(ref)
    for step in range(3):
        x, y = batch(case, step)
        opt.zero_grad()
        (F.mse_loss(model(shard(x)), shard(y)) / SIZE).backward()
        opt.synchronize()
        opt.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        one_process_step(ref, ref_opt, x, y)
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


def zero_grad_then_train(case):
    model = make_model()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    train_dist(case, model, opt, steps=2)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    train_dist(case, model, opt, steps=2)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    ref_opt = sgd(ref)
    train_ref(case, ref, ref_opt, steps=2)
    train_ref(case, ref, ref_opt, steps=2)
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


def gradients_take_fast_path(case):
    """After the first step (which registers the dtype/op pair with the core), every dense
    gradient goes through the adapter's fast path: with the general path disabled, training
    goes on (an integer predivide factor and the default process_set=None included) and
    matches the reference."""
    from hvdlite.torch import async_ops
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   gradient_predivide_factor=2)
    train_dist(case, model, opt, steps=1)
    general = async_ops._submit

    def general_path(*args, **kwargs):
        raise AssertionError("a gradient took the general path, not the fast one")

    async_ops._submit = general_path
    try:
        for step in range(1, STEPS):
            x, y = batch(case, step)
            opt.zero_grad()
            F.mse_loss(model(shard(x)), shard(y)).backward()
            opt.step()
    finally:
        async_ops._submit = general
    train_ref(case, ref, sgd(ref))
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def add_param_group(case, named=True):
    """Fine-tuning that unfreezes a layer mid-training: the group added to the wrapped
    optimizer is averaged like the others (from its gradient hooks, during backward)."""
    model = make_model()
    model.fc1.requires_grad_(False)
    init, ref = copy.deepcopy(model), copy.deepcopy(model)

    def head_sgd(m):
        return torch.optim.SGD(m.fc2.parameters(), lr=0.1, momentum=0.9)

    opt = hvd.DistributedOptimizer(head_sgd(model), named_parameters=(
        model.named_parameters() if named else None))
    ref_opt = head_sgd(ref)
    train_dist(case, model, opt, steps=2)
    train_ref(case, ref, ref_opt, steps=2)
    assert torch.equal(model.fc1.weight, init.fc1.weight)
    for m, o in ((model, opt), (ref, ref_opt)):
        m.fc1.requires_grad_(True)
        o.add_param_group({"params": m.fc1.parameters(), "lr": 0.05})

    started = started_by_hooks(opt)
    for step in range(3):
        x, y = batch(case, 10 + step)
        opt.zero_grad()
        started.clear()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        ids = {id(p) for p in started}
        assert id(model.fc1.weight) in ids and id(model.fc1.bias) in ids, \
            "the added group's gradients were not started from their hooks"
        opt.step()
        one_process_step(ref, ref_opt, x, y)
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def add_param_group_unnamed(case):
    """named_parameters covered only the first group: adding parameters it does not name is
    refused up front (no name to match across ranks), and the optimizer is left as it was."""
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.fc2.parameters(), lr=0.1),
                                   named_parameters=model.fc2.named_parameters())
    try:
        opt.add_param_group({"params": model.fc1.parameters()})
    except ValueError as exc:
        assert "named_parameters" in str(exc) and "positions [0, 1]" in str(exc), str(exc)
    else:
        raise AssertionError("adding parameters without names did not raise")
    assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == 2
    train_dist(case, model, opt, steps=2)
    same_on_all_ranks(model)


def set_bpps(case):
    """Horovod's set_backward_passes_per_step: 1 pass per step, then 2 (accumulated locally,
    one reduction per step); matches the reference either way."""
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    train_dist(case, model, opt, steps=2)
    train_ref(case, ref, ref_opt, steps=2)
    for bad in (0, -1):
        try:
            opt.set_backward_passes_per_step(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"set_backward_passes_per_step({bad}) did not raise")
    opt.set_backward_passes_per_step(2)
    train_dist(case, model, opt, steps=3, micro=2)
    train_ref(case, ref, ref_opt, steps=3)
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def load_state_dict_restarts(case):
    """A checkpoint restored after a partial accumulation (one backward pass of two, no step)
    starts a fresh accumulation, as in Horovod; with reductions in flight (a backward pass
    that failed half-way) it is refused."""
    model = make_model()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    ref_opt = sgd(ref)
    train_dist(case, model, opt, steps=2, micro=2)
    train_ref(case, ref, ref_opt, steps=2)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    x, y = batch(case, 50)
    F.mse_loss(model(shard(x)), shard(y)).backward()   # one pass of two: nothing sent yet
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    train_dist(case, model, opt, steps=2, micro=2)
    train_ref(case, ref, ref_opt, steps=2)
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)
    # the second pass fails after fc2's reductions started: they stay in flight
    F.mse_loss(model(shard(x)), shard(y)).backward()
    failing_backward(model, shard(x), shard(y))
    try:
        opt.load_state_dict(saved_opt)
    except hvd.HvdliteError as exc:
        assert "load_state_dict()" in str(exc) and "synchronize()" in str(exc), str(exc)
    else:
        raise AssertionError("load_state_dict() with reductions in flight did not raise")
    opt.synchronize()
    opt.load_state_dict(saved_opt)
    same_on_all_ranks(model)


def failing_backward(model, x, y):
    """A backward pass that raises between fc2's gradients and fc1's."""
    def fail(grad):
        raise RuntimeError("boom in backward")

    hidden = torch.tanh(model.fc1(x))
    hidden.register_hook(fail)
    try:
        F.mse_loss(model.fc2(hidden), y).backward()
    except RuntimeError as exc:
        assert "boom in backward" in str(exc), str(exc)
    else:
        raise AssertionError("the failing backward did not fail")


def rewrap_same_parameters(case):
    """A new DistributedOptimizer over parameters wrapped before (the next phase of training)
    takes their gradient hooks over: the old optimizer's hooks would otherwise fire too and
    send every name twice."""
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    first = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    train_dist(case, model, first, steps=2)
    second = hvd.DistributedOptimizer(sgd(model, lr=0.05),
                                      named_parameters=model.named_parameters())
    assert not first._reducer.hook_handles, "the first optimizer kept its gradient hooks"
    assert set(second._reducer.names.values()) == set(first._reducer.names.values()), \
        "re-wrapping the same parameters changed their names"
    train_dist(case, model, second, steps=3)
    train_ref(case, ref, sgd(ref), steps=2)
    train_ref(case, ref, sgd(ref, lr=0.05), steps=3)
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def dropped_optimizer_is_freed(case):
    """A model and DistributedOptimizer nobody refers to any more are freed (the gradient
    hooks used to make a cycle that torch hides from the garbage collector: every model
    trained in a process stayed in memory, with its optimizer state)."""
    import gc
    import weakref
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    train_dist(case, model, opt, steps=1)
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(model.fc1.weight)]
    del model, opt
    gc.collect()
    alive = [i for i, ref in enumerate(refs) if ref() is not None]
    assert not alive, f"still alive after gc.collect(): {alive} (0 model, 1 optimizer, 2 param)"


def _gan(seed):
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, IN))
    disc = nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, 1))
    return gen, disc


def _gan_data(case, step):
    g = torch.Generator().manual_seed(C.seed_of(case, "gan", step))
    return torch.randn(SIZE * B, IN, generator=g), torch.randn(SIZE * B, 3, generator=g)


def _gan_step(gen, disc, opt_g, opt_d, real, z, freeze=True):
    bce = F.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    opt_d.zero_grad()
    (bce(disc(real), ones) + bce(disc(gen(z).detach()), zeros)).backward()
    opt_d.step()
    opt_g.zero_grad()
    disc.requires_grad_(not freeze)
    bce(disc(gen(z)), ones).backward()
    disc.requires_grad_(True)
    opt_g.step()


def two_models_named_alike(case):
    """A GAN: generator and discriminator are both nn.Sequential, so their parameter names
    ('0.weight', ...) are the same; the second optimizer's gradients get their own prefix and
    both models train as on one process."""
    gen, disc = _gan(1)
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    init = copy.deepcopy(disc)

    def adam(m):
        return torch.optim.Adam(m.parameters(), lr=0.01)

    opt_g = hvd.DistributedOptimizer(adam(gen), named_parameters=gen.named_parameters())
    opt_d = hvd.DistributedOptimizer(adam(disc), named_parameters=disc.named_parameters())
    names_g, names_d = set(opt_g._reducer.names.values()), set(opt_d._reducer.names.values())
    assert "allreduce.0.weight" in names_g and not names_g & names_d, (names_g, names_d)
    assert all(n.startswith(f"allreduce.opt{opt_d._index}.") for n in names_d), names_d
    _gan_matches_one_process(case, (gen, disc, opt_g, opt_d),
                             (ref_gen, ref_disc, adam(ref_gen), adam(ref_disc)), init, steps=4)


def _gan_matches_one_process(case, dist, ref, init_disc, steps, freeze=True):
    """Train ``dist`` = (gen, disc, opt_g, opt_d) on this rank's shards and ``ref`` (the same,
    plain) on the whole batches; the results agree on every rank and with the reference."""
    gen, disc, opt_g, opt_d = dist
    ref_gen, ref_disc, ref_g, ref_d = ref
    for step in range(steps):
        real, z = _gan_data(case, step)
        _gan_step(gen, disc, opt_g, opt_d, shard(real), shard(z), freeze)
        _gan_step(ref_gen, ref_disc, ref_g, ref_d, real, z, freeze)
    same_on_all_ranks(gen)
    same_on_all_ranks(disc)
    moved(disc, init_disc)
    close_to(gen, ref_gen, 2e-5)
    close_to(disc, ref_disc, 2e-5)


def gan_without_freezing(case):
    """The generator's backward also reaches the discriminator's parameters: their reductions
    finish with that backward pass, so the discriminator's next zero_grad() just discards
    them, and both models train as on one process without freezing anything."""
    gen, disc = _gan(2)
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    init = copy.deepcopy(disc)
    opt_g = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.05),
                                     named_parameters=gen.named_parameters(prefix="gen"))
    opt_d = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.05),
                                     named_parameters=disc.named_parameters(prefix="disc"))
    assert opt_d._reducer.prefix is None, "distinct names were prefixed anyway"
    ref_g = torch.optim.SGD(ref_gen.parameters(), lr=0.05)
    ref_d = torch.optim.SGD(ref_disc.parameters(), lr=0.05)
    _gan_matches_one_process(case, (gen, disc, opt_g, opt_d), (ref_gen, ref_disc, ref_g, ref_d),
                             init, steps=3, freeze=False)


def grads_reduced_when_backward_returns(case):
    """``.grad`` holds the averaged gradients as soon as backward() returns (nothing left in
    flight); with backward_passes_per_step=2 only after the second pass."""
    for passes in (1, 2):
        model = make_model()
        ref = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                       backward_passes_per_step=passes)
        started = started_by_hooks(opt)
        x, y = batch(case, passes)
        local = copy.deepcopy(model)
        F.mse_loss(local(shard(x)), shard(y)).backward()
        F.mse_loss(ref(x), y).backward()
        for k in range(passes):
            F.mse_loss(model(shard(x)), shard(y)).backward()
            done = k == passes - 1
            want = ref if done else local
            for (name, p), q in zip(model.named_parameters(), want.parameters()):
                torch.testing.assert_close(p.grad, q.grad * (passes if done else 1), rtol=0,
                                           atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            assert len(started) == (4 if done else 0), len(started)
            in_flight = [p for p, h in opt._reducer.handles.items() if h[0] is not None]
            in_flight += [b for b in opt._reducer.buckets if b.busy]
            assert not in_flight, f"{len(in_flight)} reductions still in flight"
        opt.step()
        same_on_all_ranks(model)


def grad_scaler_recipe(case):
    """torch.amp's recipe unchanged (scaler.scale(loss).backward(); scaler.step(opt);
    scaler.update()).  Rank 0's first two batches overflow; the scaler's overflow check reads
    the averaged gradients, so every rank skips those steps and backs its scale off alike,
    as one process on the whole batch does."""
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
    for step in range(6):
        x, y = batch(case, step)
        if step < 2:
            y[:B] *= 1e20      # rank 0's rows: the loss overflows float32
        for m, o, sc, xs, ys in ((model, opt, scaler, shard(x), shard(y)),
                                 (ref, ref_opt, ref_scaler, x, y)):
            o.zero_grad()
            sc.scale(F.mse_loss(m(xs), ys)).backward()
            sc.step(o)
            sc.update()
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** 98, \
        (scaler.get_scale(), ref_scaler.get_scale())
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def clip_without_synchronize(case):
    """clip_grad_norm_ straight after backward, without Horovod's synchronize() /
    skip_synchronize() dance: it clips the averaged gradients, as on one process."""
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    for step in range(STEPS):
        x, y = batch(case, step)
        for m, o, xs, ys in ((model, opt, shard(x), shard(y)), (ref, ref_opt, x, y)):
            o.zero_grad()
            F.mse_loss(m(xs), ys).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            assert norm > 0.05, f"nothing clipped (norm {norm})"
            o.step()
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


class Checkpointed(nn.Module):
    """fc1 -> (checkpointed fc2) [-> head]: reentrant activation checkpointing runs a nested
    backward pass for the checkpointed part.  Without a head, the first gradients to complete
    are inside that nested pass."""

    def __init__(self, head: bool):
        super().__init__()
        torch.manual_seed(3)
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, HID if head else OUT)
        self.head = nn.Linear(HID, OUT) if head else None

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(lambda t: torch.tanh(self.fc2(t)), torch.tanh(self.fc1(x)),
                       use_reentrant=True)
        return self.head(h) if self.head is not None else h


def reentrant_checkpoint(case):
    """Reentrant checkpointing with op=Sum (a gradient reduced twice would be off by a factor
    of the number of ranks): training matches one process; with the head outside the
    checkpoint the reductions are finished once per backward pass, at its very end."""
    for head in (True, False):
        model = Checkpointed(head)
        init, ref = copy.deepcopy(model), copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                       op=hvd.Sum)
        ref_opt = sgd(ref)
        finishes = []
        reduce_gradients = opt._reducer.reduce_gradients

        def counted():
            finishes.append(1)
            reduce_gradients()

        opt._reducer.reduce_gradients = counted
        for step in range(3):
            x, y = batch(case, step)
            opt.zero_grad()
            (F.mse_loss(model(shard(x)), shard(y)) / SIZE).backward()
            opt.step()
            one_process_step(ref, ref_opt, x, y)
        if head:
            assert len(finishes) == 3, f"{len(finishes)} finishes in 3 backward passes"
        same_on_all_ranks(model)
        moved(model, init)
        close_to(model, ref, 1e-5)


def backward_failure(case):
    """A backward pass that raises half-way leaves the reductions its hooks started in
    flight: zero_grad() refuses (pointing at synchronize()), synchronize() finishes them, and
    training goes on identically on every rank."""
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    x, y = batch(case, 0)
    failing_backward(model, shard(x), shard(y))
    try:
        opt.zero_grad()
    except hvd.HvdliteError as exc:
        assert "synchronize()" in str(exc) and "'allreduce.fc2." in str(exc), str(exc)
    else:
        raise AssertionError("zero_grad() with reductions in flight did not raise")
    opt.synchronize()
    opt.zero_grad()
    train_dist(case, model, opt, steps=2)
    same_on_all_ranks(model)


def names_of_a_dropped_optimizer(case):
    """An optimizer nobody can reach any more, but not yet freed (here the garbage collector
    is off; in general a user's own reference cycle, freed at different times on different
    ranks) does not make a new one over a model named alike take a prefix."""
    import gc
    gc.disable()
    try:
        old = make_model()
        old_opt = hvd.DistributedOptimizer(sgd(old), named_parameters=old.named_parameters())
        old_opt.cycle = old_opt   # only the cyclic collector can free it
        del old, old_opt
        model = make_model(seed=3)
        opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    finally:
        gc.enable()
    assert opt._reducer.prefix is None, sorted(opt._reducer.names.values())
    train_dist(case, model, opt, steps=2)
    same_on_all_ranks(model)


def step_with_closure(case, make_opt, tol):
    """optimizer.step(closure): the gradients the closure computes are averaged before the
    optimizer reads them (LBFGS evaluates it several times per step), and so is the returned
    loss, so every rank takes the same decisions; matches one process on the whole batch."""
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters())
    ref_opt = make_opt(ref)
    for step in range(3):
        x, y = batch(case, step)

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(shard(x)), shard(y))
            loss.backward()
            return loss

        def ref_closure():
            ref_opt.zero_grad()
            loss = F.mse_loss(ref(x), y)
            loss.backward()
            return loss

        loss, ref_loss = opt.step(closure), ref_opt.step(ref_closure)
        torch.testing.assert_close(loss.double(), ref_loss.detach().double(), rtol=0,
                                   atol=tol)
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, tol)


def compiled_model(case):
    """torch.compile (AOTAutograd, without a C++ toolchain: backend="aot_eager"): the compiled
    backward still accumulates into the parameters, so the gradient hooks fire and training
    matches eager training on one process."""
    model = make_model()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    started = started_by_hooks(opt)
    for step in range(STEPS):
        x, y = batch(case, step)
        opt.zero_grad()
        started.clear()
        F.mse_loss(compiled(shard(x)), shard(y)).backward()
        assert len(started) == 4, "gradients were not started from their hooks"
        opt.step()
    train_ref(case, ref, sgd(ref))
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


CASES = {
    "isinstance_and_api": isinstance_and_api,
    "sgd_momentum.basic": standard,
    "sgd_momentum.no_named_parameters": lambda c: standard(c, named=False),
    "sgd_momentum.float64": lambda c: standard(c, dtype=torch.float64, tol=1e-12),
    "bpps2": lambda c: standard(c, dist_kwargs={"backward_passes_per_step": 2}, micro=2),
    "bpps2_partial_step": bpps2_partial,
    "compression.fp16": compression,
    "compression.bf16": compression,
    "op_sum": lambda c: standard(c, dist_kwargs={"op": hvd.Sum}, loss_mul=SIZE),
    "predivide_factor": lambda c: standard(c, dist_kwargs={"gradient_predivide_factor": 2.0}),
    "groups_int": lambda c: standard(c, dist_kwargs={"groups": 2}),
    "groups_list": groups_list,
    "num_groups": lambda c: standard(c, dist_kwargs={"num_groups": 3}),
    "unused_param_rank0_only": unused_rank0_only,
    "unused_param_everywhere": unused_everywhere,
    "unused_param_in_group": unused_in_group,
    "noncontiguous_parameter": noncontiguous_parameter,
    "frozen_parameter_with_groups": frozen_parameter,
    "clip_grad_norm": clip_grad_norm,
    "steplr_scheduler": steplr,
    "adam": lambda c: standard(c, make_opt=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                               tol=2e-5),
    "broadcast_parameters_then_train": broadcast_then_train,
    "wrap_optimizer_with_existing_state": wrap_existing_state,
    "synchronize_then_step_reduces_once": synchronize_then_step,
    "zero_grad_after_step_then_train": zero_grad_then_train,
    "gradients_take_fast_path": gradients_take_fast_path,
    "add_param_group.named": add_param_group,
    "add_param_group.positional": lambda c: add_param_group(c, named=False),
    "add_param_group.parameters_without_names": add_param_group_unnamed,
    "set_backward_passes_per_step": set_bpps,
    "load_state_dict_restarts_accumulation": load_state_dict_restarts,
    "rewrap_same_parameters": rewrap_same_parameters,
    "dropped_optimizer_is_freed": dropped_optimizer_is_freed,
    "two_models_named_alike": two_models_named_alike,
    "gan_without_freezing": gan_without_freezing,
    "grads_reduced_when_backward_returns": grads_reduced_when_backward_returns,
    "grad_scaler_recipe": grad_scaler_recipe,
    "clip_grad_norm_without_synchronize": clip_without_synchronize,
    "backward_failure_then_synchronize": backward_failure,
    "reentrant_checkpoint": reentrant_checkpoint,
    "names_of_a_dropped_optimizer": names_of_a_dropped_optimizer,
    "step_with_closure.sgd": lambda c: step_with_closure(c, sgd, 1e-5),
    "step_with_closure.lbfgs": lambda c: step_with_closure(
        c, lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4), 1e-4),
    "torch_compile": compiled_model,
    "parameter_names": parameter_names,
}
assert list(CASES) == C.OPTIMIZER_CASES
for case, fn in CASES.items():
    r.case(case, fn, case)
r.write()
hvd.shutdown()
