"""DistributedOptimizer's gradient buckets on every rank (launched with a small
HVDLITE_GRADIENT_BUCKET_MB so that small models fill several buckets; see
tests/torch/test_buckets.py).

Every case trains with DistributedOptimizer on this rank's shard of a global batch and checks the
parameters against every other rank's (bit for bit, via mpi4py) and against a single-process
reference trained on the whole batch, plus what the case is about: which gradients share
buckets, how many reductions a step submits, what happens to unused, frozen, sparse and
reshaped parameters, and ranks whose models list the parameters in different orders.
"""
import copy
import gc

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)

import hvdlite.torch as hvd  # noqa: E402
import torch_cases as C  # noqa: E402
from hvdlite.common.runtime.registry import process_set_engine  # noqa: E402
from hvdlite.torch import reducer as reducer_module  # noqa: E402

hvd.init()
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = hvd.rank(), hvd.size()
r = C.synced_reporter(RANK, COMM)
CAP = process_set_engine(None, "test")[0].config.gradient_bucket_bytes
B, IN, OUT = 4, 6, 3
STEPS = 5


class Deep(nn.Module):
    """Many small layers, one weight too large for a bucket, an optional extra layer, and a
    free-standing scale vector."""

    def __init__(self, depth=10, wide=100, extra=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(IN, IN) for _ in range(depth))
        self.wide = nn.Linear(IN, wide)           # weight: wide * IN floats, over the cap
        self.head = nn.Linear(wide, OUT)
        self.scale = nn.Parameter(torch.ones(IN))
        self.extra = nn.Linear(IN, IN) if extra else None

    def forward(self, x, use_extra=False):
        x = x * self.scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if use_extra:
            x = x + self.extra(x)
        return self.head(torch.tanh(self.wide(x)))


def batch(case, step, rows=None):
    g = torch.Generator().manual_seed(C.seed_of(case, "batch", step))
    rows = SIZE * B if rows is None else rows
    return torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)


def shard(t, k=None):
    k = RANK if k is None else k
    return t[k * B:(k + 1) * B]


bits, close_to, moved = C.bits, C.close_to, C.moved


def same_on_all_ranks(model):
    C.same_on_all_ranks(model, COMM)


def sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                           momentum=0.9)


def wrap(model, **kwargs):
    return hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                    **kwargs)


def rank_loss(model, x, y, k, use_extra):
    return F.mse_loss(model(shard(x, k), use_extra(k)), shard(y, k))


def dist_step(case, step, model, opt, use_extra=lambda k: False):
    x, y = batch(case, step)
    opt.zero_grad()
    rank_loss(model, x, y, RANK, use_extra).backward()
    opt.step()


def ref_step(case, step, ref, ref_opt, use_extra=lambda k: False):
    """The average of every rank's loss, on one process: its gradient is the average of the
    ranks' gradients, which is what DistributedOptimizer applies."""
    x, y = batch(case, step)
    ref_opt.zero_grad()
    (sum(rank_loss(ref, x, y, k, use_extra) for k in range(SIZE)) / SIZE).backward()
    ref_opt.step()


def count_submissions():
    """Count DistributedOptimizer's in-place allreduce submissions (buckets and gradients on
    their own); returns (counter list, restore function)."""
    from hvdlite.torch.buckets import GradientBucket
    calls = []
    real, real_bucket = reducer_module.allreduce_async_, GradientBucket.submit

    def counting(tensor, *args, **kwargs):
        calls.append(kwargs.get("name"))
        return real(tensor, *args, **kwargs)

    def counting_bucket(bucket, *args, **kwargs):
        calls.append(bucket.name)
        return real_bucket(bucket, *args, **kwargs)

    def restore():
        reducer_module.allreduce_async_ = real
        GradientBucket.submit = real_bucket

    reducer_module.allreduce_async_ = counting
    GradientBucket.submit = counting_bucket
    return calls, restore


def plan_names(opt):
    return [[opt._reducer.names[p] for p in b.params] for b in opt._reducer.buckets]


def bucketed_in_hook_order(opt):
    """Names of the bucketed parameters, in the order their gradients are expected."""
    reducer = opt._reducer
    return [reducer.names[p] for p in reversed(list(reducer.names)) if p in reducer.bucket_of]


def check_bucket_sizes(opt):
    for b in opt._reducer.buckets:
        assert len(b.params) >= 2, f"bucket {b.name} holds a single gradient"
        assert b.flat.numel() * b.flat.element_size() <= CAP, f"bucket {b.name} over the cap"
        assert len({(p.dtype, p.device) for p in b.params}) == 1, f"{b.name} mixes dtypes"


# --- cases -------------------------------------------------------------------------------------
def small_gradients_share_buckets(case):
    """After the first step every small gradient travels in a bucket (the weight over the cap
    on its own); a step then submits one reduction per bucket plus the large gradient, in the
    reverse order of the parameters; training matches one process."""
    torch.manual_seed(0)
    model = Deep()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = wrap(model), sgd(ref)
    assert model.wide.weight.numel() * 4 >= CAP > 2 * IN * IN * 4, "test set-up: cap"
    dist_step(case, 0, model, opt)
    ref_step(case, 0, ref, ref_opt)
    check_bucket_sizes(opt)
    assert len(opt._reducer.buckets) >= 2, f"test set-up: {len(opt._reducer.buckets)} buckets"
    alone = [n for p, n in opt._reducer.names.items() if p not in opt._reducer.bucket_of]
    assert "allreduce.wide.weight" in alone, alone
    assert len(alone) <= 2, f"too many gradients outside the buckets: {alone}"
    order = bucketed_in_hook_order(opt)
    assert [n for names in plan_names(opt) for n in names] == order, plan_names(opt)
    calls, restore = count_submissions()
    try:
        for step in range(1, STEPS):
            calls.clear()
            dist_step(case, step, model, opt)
            assert len(calls) == len(opt._reducer.buckets) + len(alone), calls
            ref_step(case, step, ref, ref_opt)
    finally:
        restore()
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def plans_agree(case):
    """Every rank planned the same buckets under the same names."""
    torch.manual_seed(0)
    model = Deep()
    opt = wrap(model)
    for step in range(2):
        dist_step(case, step, model, opt)
    mine = [(b.name, names) for b, names in zip(opt._reducer.buckets, plan_names(opt))]
    assert all(other == mine for other in COMM.allgather(mine)), "plans differ between ranks"


class Mixed(nn.Module):
    """Float64 and float32 layers interleaved."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN, IN).double()
        self.b = nn.Linear(IN, IN)
        self.c = nn.Linear(IN, IN).double()
        self.d = nn.Linear(IN, OUT)

    def forward(self, x, use_extra=False):
        x = torch.tanh(self.a(x.double()))
        x = torch.tanh(self.b(x.float()))
        x = torch.tanh(self.c(x.double()))
        return self.d(x.float())


def mixed_dtypes(case):
    """Gradients of different dtypes never share a bucket, and each is reduced in its own."""
    torch.manual_seed(0)
    model = Mixed()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = wrap(model), sgd(ref)
    for step in range(STEPS):
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
    check_bucket_sizes(opt)
    dtypes = sorted(str(b.flat.dtype) for b in opt._reducer.buckets)
    assert dtypes == ["torch.float32", "torch.float64"], dtypes
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def unused_on_some_ranks(case):
    """A layer used on rank 0 only shares a bucket with used ones: the other ranks send zeros
    for it at the end of their backward pass, and every rank applies the average."""
    torch.manual_seed(0)
    model = Deep(extra=True)
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = wrap(model), sgd(ref)

    def use_extra(k):
        return k == 0

    for step in range(STEPS):
        dist_step(case, step, model, opt, use_extra)
        ref_step(case, step, ref, ref_opt, use_extra)
        if step == 0:
            assert model.extra.weight in opt._reducer.bucket_of, \
                "test set-up: extra not in a bucket"
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def planned(case, steps=2):
    """A Deep model and its one-process reference after ``steps`` steps (the buckets are
    planned after the first): (model, ref, opt, ref_opt)."""
    torch.manual_seed(0)
    model = Deep()
    ref = copy.deepcopy(model)
    opt, ref_opt = wrap(model), sgd(ref)
    for step in range(steps):
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
    return model, ref, opt, ref_opt


def frozen_after_planning(case):
    """Freezing a layer whose gradients are in a bucket: it gets no gradient (not even zeros,
    which weight decay or momentum would turn into updates) and stays as it was; the others
    go on training, and the next plan leaves it out."""
    model, ref, opt, ref_opt = planned(case)
    frozen = model.layers[3]
    assert frozen.weight in opt._reducer.bucket_of, "test set-up: the layer is not in a bucket"
    for m in (model, ref):
        m.layers[3].requires_grad_(False)
    before = copy.deepcopy(frozen)
    for step in range(2, STEPS):
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
        assert frozen.weight.grad is None and frozen.bias.grad is None, "a frozen layer got a grad"
    assert torch.equal(frozen.weight, before.weight) and torch.equal(frozen.bias, before.bias)
    assert frozen.weight not in opt._reducer.bucket_of and frozen.bias not in opt._reducer.bucket_of
    check_bucket_sizes(opt)
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


def compressed(case, compression, wire, tol):
    """fp16 / bf16 compression: buckets carry the compressed dtype, and results match."""
    torch.manual_seed(0)
    model = Deep()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = wrap(model, compression=compression), sgd(ref)
    for step in range(STEPS):
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
    assert opt._reducer.buckets and all(b.flat.dtype == wire for b in opt._reducer.buckets), \
        [b.flat.dtype for b in opt._reducer.buckets]
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, tol)


def custom_compressor_goes_alone(case):
    """A compressor of the user's own sees every gradient by itself: no buckets."""
    seen = []

    class Spy(hvd.Compression.none):
        @staticmethod
        def compress(tensor):
            seen.append(tensor.shape)
            return tensor, None

    torch.manual_seed(0)
    model = Deep()
    ref = copy.deepcopy(model)
    opt, ref_opt = wrap(model, compression=Spy), sgd(ref)
    for step in range(3):
        seen.clear()
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
        assert len(seen) == len(list(model.parameters())), len(seen)
    assert not opt._reducer.buckets
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


class Named(nn.Module):
    """The same layers under the same names, registered in an order that depends on the rank
    (as a ModuleDict built from a set would be under hash randomization)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        made = {k: nn.Linear(IN, IN) for k in "abcdef"}
        order = "abcdef" if RANK % 2 == 0 else "fedcba"
        self.blocks = nn.ModuleDict({k: made[k] for k in order})
        self.out = nn.Linear(IN, OUT)

    def forward(self, x, use_extra=False):
        for k in "abcdef":
            x = torch.tanh(self.blocks[k](x))
        return self.out(x)


def registration_order_differs(case):
    """Ranks that register the parameters in different orders still plan the same buckets (by
    name, once they notice) and train in step."""
    model, ref = Named(), Named()   # (seeded: the same values under each name everywhere)
    opt = wrap(model)
    ref_opt = sgd(ref)
    for step in range(STEPS):
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
    assert opt._reducer.buckets, "test set-up: no buckets"
    mine = plan_names(opt)
    assert all(other == mine for other in COMM.allgather(mine)), "plans differ between ranks"
    # Compare by name: the ranks' parameter lists are in different orders.
    for name, p in sorted(model.named_parameters()):
        gathered = COMM.allgather(bits(p))
        assert all(g == gathered[0] for g in gathered), f"parameter {name!r} differs"
        torch.testing.assert_close(p.detach(), dict(ref.named_parameters())[name].detach(),
                                   rtol=0, atol=1e-5)


def reshaped_parameter(case):
    """A parameter in a bucket that changes shape on every rank (model surgery) is reduced on
    its own that step, and the buckets are planned again for its new shape."""
    model, ref, opt, ref_opt = planned(case)
    assert model.scale in opt._reducer.bucket_of, "test set-up: scale is not in a bucket"
    for m, o in ((model, opt), (ref, ref_opt)):
        with torch.no_grad():
            m.scale.data = m.scale.data[:1].clone()   # broadcasts like the full vector did
        o.state[m.scale].clear()   # momentum of the old shape
    members = list(opt._reducer.bucket_of[model.scale].params)
    x, y = batch(case, 2)
    opt.zero_grad()
    rank_loss(model, x, y, RANK, lambda k: False).backward()
    # The members went on their own: backward waited for every one of them.
    assert all(any(p is q for q in opt._reducer.reduced) for p in members), \
        "a member was not waited for"
    opt.step()
    ref_step(case, 2, ref, ref_opt)
    for step in range(3, STEPS):
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
    bucket = opt._reducer.bucket_of.get(model.scale)
    assert bucket is not None, "scale left its bucket for good"
    position = [p is model.scale for p in bucket.params].index(True)
    assert bucket.views[position].shape == (1,), bucket.views[position].shape
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


def reshaped_on_one_rank(case, reshape):
    """A bucket member that changed shape on the last rank only (a bug in the user's script):
    every rank raises a shape mismatch naming the bucket and the rank (that rank names the
    parameter too) at the end of backward, with nothing applied or left in flight; once the
    shape is restored, training goes on in step.  ``reshape`` keeps the number of elements or
    not: either way the bucket's flat tensor must not be combined with the other ranks'."""
    model, ref, opt, ref_opt = planned(case)
    bucket = opt._reducer.bucket_of.get(model.scale)
    assert bucket is not None, "test set-up: scale is not in a bucket"
    original = model.scale.data
    if RANK == SIZE - 1:
        model.scale.data = reshape(original.clone())
    before = copy.deepcopy(model.state_dict())
    x, y = batch(case, 2)
    opt.zero_grad()
    try:
        rank_loss(model, x, y, RANK, lambda k: False).backward()
    except hvd.TensorMismatchError as exc:
        text = str(exc)
    else:
        raise AssertionError("no error for a parameter reshaped on one rank only")
    expected = [bucket.name, "Mismatched shape", f"ranks [{SIZE - 1}]",
                "changed shape on some ranks only"]
    if RANK == SIZE - 1:   # (the others cannot tell which member it was)
        expected.append(f"'scale' is {tuple(model.scale.shape)} instead of ({IN},)")
    for part in expected:
        assert part in text, f"{part!r} not in the error: {text}"
    assert not opt._reducer.in_flight(), "reductions left in flight"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "applied"
    gc.collect()   # (the traceback kept the graph, and scale's old accumulator, alive)
    model.scale.data = original
    for step in range(3, STEPS):   # the reference skips the failed step
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
    assert opt._reducer.bucket_of.get(model.scale) is bucket, "the plan changed"
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


class WithEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, IN, sparse=True)
        self.fc1 = nn.Linear(IN, IN)
        self.fc2 = nn.Linear(IN, OUT)

    def forward(self, x, use_extra=False):
        ids = (x[:, 0].abs() * 3).long().clamp(max=9)
        return self.fc2(torch.tanh(self.fc1(x + self.emb(ids))))


def sparse_stays_out(case):
    """A sparse gradient keeps its own (allgather-based) reduction; dense ones share a bucket."""
    torch.manual_seed(0)
    model = WithEmbedding()
    init, ref = copy.deepcopy(model), copy.deepcopy(model)

    def plain_sgd(m):   # (no momentum: the same update for sparse and dense gradients)
        return torch.optim.SGD(m.parameters(), lr=0.1)

    opt = hvd.DistributedOptimizer(plain_sgd(model), named_parameters=model.named_parameters())
    ref_opt = plain_sgd(ref)
    for step in range(STEPS):
        dist_step(case, step, model, opt)
        ref_step(case, step, ref, ref_opt)
        assert model.emb.weight.grad.is_sparse
    assert model.emb.weight not in opt._reducer.bucket_of
    assert model.fc1.weight in opt._reducer.bucket_of and model.fc2.bias in opt._reducer.bucket_of
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def bpps_with_unused(case):
    """backward_passes_per_step=2 with a layer unused on rank 0's second pass."""
    torch.manual_seed(0)
    model = Deep(extra=True)
    init, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = wrap(model, backward_passes_per_step=2), sgd(ref)
    for step in range(STEPS):
        x, y = batch(case, step)
        opt.zero_grad()
        for micro in range(2):
            xs, ys = shard(x).chunk(2)[micro], shard(y).chunk(2)[micro]
            use = not (RANK == 0 and micro == 1)
            (F.mse_loss(model(xs, use), ys) / 2).backward()
        opt.step()
        ref_opt.zero_grad()
        total = 0
        for k in range(SIZE):
            for micro in range(2):
                xs, ys = shard(x, k).chunk(2)[micro], shard(y, k).chunk(2)[micro]
                total = total + F.mse_loss(ref(xs, not (k == 0 and micro == 1)), ys) / 2
        (total / SIZE).backward()
        ref_opt.step()
    assert opt._reducer.buckets, "test set-up: no buckets"
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def replan_while_a_rank_has_joined(case):
    """The last rank joins once the buckets are planned; the others freeze a layer, which
    re-plans their buckets while the joined rank answers their plan check with zeros.  That
    must not read as plans that differ (they would then be made in name order)."""
    model, _, opt, _ = planned(case)
    if RANK != SIZE - 1:
        for m in model.layers[3], model.layers[4]:
            m.requires_grad_(False)
        for step in range(2, 4):
            dist_step(case, step, model, opt)
        assert model.layers[3].weight not in opt._reducer.bucket_of, "test set-up: no new plan"
        order = bucketed_in_hook_order(opt)
        assert [n for names in plan_names(opt) for n in names] == order, plan_names(opt)
    hvd.join()


def failing_backward(model, x, y):
    """A backward pass of ``Deep`` that raises once layers 9..5 have their gradients."""
    def fail(grad):
        raise RuntimeError("boom in backward")

    h = x * model.scale
    for i, layer in enumerate(model.layers):
        h = torch.tanh(layer(h))
        if i == 4:
            h.register_hook(fail)
    try:
        F.mse_loss(model.head(torch.tanh(model.wide(h))), y).backward()
    except RuntimeError as exc:
        assert "boom in backward" in str(exc), str(exc)
    else:
        raise AssertionError("the failing backward did not fail")


def join_with_reductions_in_flight(case):
    """hvd.join() makes every optimizer forget its first-step agreements (layouts, buckets),
    but not while buckets are in flight (a backward pass that failed half-way): those are
    finished by synchronize() first, and only then forgotten.  The next step agrees afresh,
    gradient by gradient, and plans the buckets again; training matches one process."""
    model, ref, opt, ref_opt = planned(case)
    x, y = batch(case, 2)
    opt.zero_grad()
    failing_backward(model, shard(x), shard(y))
    busy = [b for b in opt._reducer.buckets if b.busy]
    assert busy, "test set-up: no bucket in flight"
    hvd.join()
    assert all(b in opt._reducer.buckets for b in busy), "join() dropped buckets in flight"
    opt.synchronize()
    assert all(b.handle is None for b in busy), "buckets in flight were not waited for"
    assert not opt._reducer.buckets and not opt._reducer.layouts, \
        "first-step agreements not forgotten"
    opt.zero_grad()   # (the failed step is not applied; the reference skips it)
    calls, restore = count_submissions()
    try:
        dist_step(case, 3, model, opt)
    finally:
        restore()
    ref_step(case, 3, ref, ref_opt)
    assert len(calls) == len(opt._reducer.names), f"first step after join() submitted {calls}"
    assert opt._reducer.buckets, "no buckets planned after the first step after join()"
    dist_step(case, 4, model, opt)
    ref_step(case, 4, ref, ref_opt)
    same_on_all_ranks(model)
    close_to(model, ref, 1e-5)


CASES = {
    "small_gradients_share_buckets": small_gradients_share_buckets,
    "plans_agree": plans_agree,
    "mixed_dtypes": mixed_dtypes,
    "unused_on_some_ranks": unused_on_some_ranks,
    "frozen_after_planning": frozen_after_planning,
    "compression.fp16": lambda c: compressed(c, hvd.Compression.fp16, torch.float16, 2e-3),
    "compression.bf16": lambda c: compressed(c, hvd.Compression.bf16, torch.bfloat16, 2e-2),
    "custom_compressor_goes_alone": custom_compressor_goes_alone,
    "registration_order_differs": registration_order_differs,
    "reshaped_parameter": reshaped_parameter,
    "reshaped_on_one_rank.fewer_elements": lambda c: reshaped_on_one_rank(c, lambda t: t[:1]),
    "reshaped_on_one_rank.same_elements": lambda c: reshaped_on_one_rank(
        c, lambda t: t.view(1, -1)),
    "sparse_stays_out": sparse_stays_out,
    "bpps_with_unused": bpps_with_unused,
    "replan_while_a_rank_has_joined": replan_while_a_rank_has_joined,
    "join_with_reductions_in_flight": join_with_reductions_in_flight,
}
assert list(CASES) == C.BUCKET_CASES
for case, fn in CASES.items():
    r.case(case, fn, case)
r.write()
hvd.shutdown()
