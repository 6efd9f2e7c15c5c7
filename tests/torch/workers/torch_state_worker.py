"""broadcast_parameters / broadcast_optimizer_state / broadcast_object / allgather_object on
every rank.

Ranks start from different parameters, different optimizer hyper-parameters and different (or no)
optimizer state.  Everything a rank does before the broadcast is deterministic, so every rank
rebuilds the *root's* model and optimizer locally (``reconstruct``) and expects its own state to
equal that reconstruction bit for bit after the broadcast; then training continues with a
DistributedOptimizer, which must keep the ranks bitwise identical and match the reconstructed root
trained on the full batch.
"""
import copy
import dataclasses
import pickle

import numpy as np
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
B, IN, HID, OUT = 4, 5, 7, 2


class MLP(nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.bn = nn.BatchNorm1d(HID) if bn else None
        self.fc2 = nn.Linear(HID, OUT)

    def forward(self, x):
        h = self.fc1(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.fc2(torch.tanh(h))


def make_model(seed, bn=False):
    torch.manual_seed(seed)
    return MLP(bn)


def make_opt(kind, model, k):
    """Rank ``k``'s optimizer: hyper-parameters (and so state layout) differ per rank."""
    lr = 0.01 * (k + 1)
    groups = [{"params": list(model.fc1.parameters())},
              {"params": list(model.fc2.parameters()), "lr": lr * 0.5}]
    if kind == "sgd_momentum":
        return torch.optim.SGD(groups, lr=lr, momentum=0.5 + 0.1 * k, weight_decay=1e-3 * k)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=(0.9 - 0.05 * k, 0.999 - 0.0005 * k),
                                eps=1e-8 * (k + 1), weight_decay=1e-3 * k, amsgrad=(k % 2 == 1))
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01 * (k + 1),
                                 betas=(0.85 + 0.01 * k, 0.99))
    if kind == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, alpha=0.99 - 0.01 * k, momentum=0.1 * k,
                                   centered=(k % 2 == 1))
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr, lr_decay=1e-3 * k,
                                   initial_accumulator_value=0.1 * k)
    raise ValueError(kind)


def pre_steps(cond, k, root):
    """How many local steps rank ``k`` takes before the broadcast."""
    return {"fresh": 0, "stepped": k + 1, "root_only": 2 if k == root else 0,
            "others_only": 0 if k == root else k + 1}[cond]


def local_data(k, step):
    g = torch.Generator().manual_seed(C.seed_of("pre", k, step))
    return torch.randn(B, IN, generator=g), torch.randn(B, OUT, generator=g)


def global_batch(case, step):
    g = torch.Generator().manual_seed(C.seed_of(case, "batch", step))
    return torch.randn(SIZE * B, IN, generator=g), torch.randn(SIZE * B, OUT, generator=g)


def pre_train(model, opt, steps, k):
    for step in range(steps):
        x, y = local_data(k, step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def horovod_lazy_state(model, opt):
    """What Horovod's broadcast_optimizer_state does to an optimizer without state: every
    parameter gets a zero gradient, which stays, and the optimizer takes one step (weight decay
    moves the parameters; they are not put back)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()


def reconstruct(kind, cond, root):
    """Root's model and optimizer as they are right after the broadcast, rebuilt locally: if
    the root had no optimizer state, the state (and the parameters) after its zero-gradient
    step."""
    model = make_model(100 + root)
    opt = make_opt(kind, model, root)
    pre_train(model, opt, pre_steps(cond, root, root), root)
    if not opt.state:
        horovod_lazy_state(model, opt)
    return model, opt


def own_params_after(kind, cond, root, had_state):
    """This rank's parameters after broadcast_parameters(root) and broadcast_optimizer_state,
    as in Horovod: the root's parameters, moved by this rank's own zero-gradient step (with
    this rank's hyper-parameters) if its optimizer had no state.  (Adagrad creates its state
    when it is built, so it never takes that step.)"""
    model = make_model(100 + root)
    pre_train(model, make_opt(kind, model, root), pre_steps(cond, root, root), root)
    if not had_state:
        horovod_lazy_state(model, make_opt(kind, model, RANK))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def serialize(obj):
    """Byte-exact, comparable form of a (nested) state dict."""
    if torch.is_tensor(obj):
        return ("tensor", str(obj.dtype), tuple(obj.shape), bits(obj))
    if isinstance(obj, dict):
        return ("dict", sorted(((repr(k), serialize(v)) for k, v in obj.items())))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [serialize(v) for v in obj])
    return ("value", repr(obj))


def ranks_differing(obj):
    """Ranks whose ``obj`` differs from rank 0's (bytewise), gathered with mpi4py."""
    gathered = COMM.allgather(pickle.dumps(serialize(obj)))
    return [k for k, g in enumerate(gathered) if g != gathered[0]]


def assert_state_equal(got, expected, what):
    """Optimizer state_dicts: same entries, tensors bitwise equal, hyper-parameters equal."""
    g_groups, e_groups = got["param_groups"], expected["param_groups"]
    assert len(g_groups) == len(e_groups), f"{what}: number of param groups"
    for i, (g, e) in enumerate(zip(g_groups, e_groups)):
        assert g == e, f"{what}: param_groups[{i}] {g} != root's {e}"
    assert sorted(got["state"]) == sorted(expected["state"]), \
        f"{what}: state for params {sorted(got['state'])}, root has {sorted(expected['state'])}"
    for pid, e in expected["state"].items():
        g = got["state"][pid]
        assert sorted(g) == sorted(e), f"{what}: state[{pid}] keys {sorted(g)} != {sorted(e)}"
        for key, ev in e.items():
            gv = g[key]
            if torch.is_tensor(ev):
                assert torch.is_tensor(gv), f"{what}: state[{pid}][{key!r}] is not a tensor"
                assert gv.dtype == ev.dtype and gv.shape == ev.shape, \
                    f"{what}: state[{pid}][{key!r}] {gv.dtype}{tuple(gv.shape)} != " \
                    f"{ev.dtype}{tuple(ev.shape)}"
                assert bits(gv) == bits(ev), \
                    f"{what}: state[{pid}][{key!r}] = {gv.flatten()[:6].tolist()} != root's " \
                    f"{ev.flatten()[:6].tolist()}"
            else:
                assert gv == ev, f"{what}: state[{pid}][{key!r}] = {gv!r} != root's {ev!r}"


def assert_params_equal(model, ref, what="parameter", include_buffers=False):
    got = model.state_dict() if include_buffers else dict(model.named_parameters())
    exp = ref.state_dict() if include_buffers else dict(ref.named_parameters())
    assert sorted(got) == sorted(exp)
    for name in exp:
        assert got[name].dtype == exp[name].dtype and bits(got[name]) == bits(exp[name]), \
            f"{what} {name!r} differs from the root's"


# --- optimizer state ---------------------------------------------------------------------------
def state_case(case):
    _, kind, cond, order, root = case.split(".")
    root = int(root[4:])
    model = make_model(100 + RANK)
    opt = make_opt(kind, model, RANK)
    pre_train(model, opt, pre_steps(cond, RANK, root), RANK)
    if order == "wrapped":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    params = list(model.parameters())
    had_state = bool(opt.state)

    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    # Every collective first, every assertion last: a rank whose check fails must not skip
    # collectives the other ranks still run.
    after_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    after_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    after_ids = [id(p) for p in model.parameters()]
    after_sd = copy.deepcopy(opt.state_dict())
    attached = all(bool(opt.state[p]) for p in model.parameters())
    lrs = [g["lr"] for g in opt.param_groups]
    diff_sd = ranks_differing(after_sd)

    # training continues identically on every rank (and like the root trained alone)
    ref_model, ref_opt = reconstruct(kind, cond, root)
    expected_params = own_params_after(kind, cond, root, had_state)
    expected_sd = copy.deepcopy(ref_opt.state_dict())
    if order == "plain":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    # Ranks whose optimizer had no state took a zero-gradient step with their own weight decay,
    # as in Horovod: broadcasting the parameters again (Horovod's remedy) makes them equal.
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    for step in range(3):
        x, y = global_batch(case, step)
        opt.zero_grad()
        F.mse_loss(model(x[RANK * B:(RANK + 1) * B]), y[RANK * B:(RANK + 1) * B]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref_model(x), y).backward()
        ref_opt.step()
    diff_trained = ranks_differing(dict(model.named_parameters()))
    diff_trained_sd = ranks_differing(opt.state_dict())

    assert after_ids == [id(p) for p in params], \
        "parameters were replaced instead of updated in place"
    for name, value in expected_params.items():   # Horovod's zero step moved them (or not)
        assert bits(after_params[name]) == bits(value), \
            f"parameter {name!r} != Horovod's {value.flatten()[:4].tolist()}: " \
            f"{after_params[name].flatten()[:4].tolist()}"
    if not had_state:   # Horovod leaves the zero gradients in place
        for i, g in enumerate(after_grads):
            assert g is not None and g.layout == torch.strided and not g.any(), \
                f"parameter {i}: .grad is {g} after broadcast_optimizer_state, not zeros"
    assert_state_equal(after_sd, expected_sd, "optimizer state")
    assert lrs == [0.01 * (root + 1), 0.005 * (root + 1)], lrs
    assert attached, "state not attached to the model's parameters"
    assert not diff_sd, f"optimizer state_dict differs between ranks: {diff_sd}"
    assert not diff_trained, f"parameters after training differ between ranks: {diff_trained}"
    assert not diff_trained_sd, f"optimizer state after training differs: {diff_trained_sd}"
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=2e-5,
                                   msg=lambda m, name=name: f"after training, {name!r}: {m}")


for case in C.state_cases(SIZE):
    if case.startswith("state."):
        r.case(case, state_case, case)


# --- parameters ---------------------------------------------------------------------------------
def bn_model(k):
    model = make_model(200 + k, bn=True)
    model.train()
    for step in range(k + 1):              # running statistics differ per rank
        model(local_data(k, step)[0])
    return model


def params_state_dict(case):
    root = int(case.split("root")[-1])
    model = bn_model(RANK)
    tensors = {name: t for name, t in model.state_dict().items()}
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    expected = bn_model(root)
    assert_params_equal(model, expected, "state_dict entry", include_buffers=True)
    assert int(model.bn.num_batches_tracked) == root + 1
    for name, t in model.state_dict().items():
        assert t.data_ptr() == tensors[name].data_ptr(), f"{name!r} not updated in place"


def params_named(case):
    root = int(case.split("root")[-1])
    model = bn_model(RANK)
    own_running_mean = model.bn.running_mean.clone()
    hvd.broadcast_parameters(model.named_parameters(), root_rank=root)
    assert_params_equal(model, bn_model(root))
    # buffers are not parameters: they keep this rank's values
    assert torch.equal(model.bn.running_mean, own_running_mean)


def params_list_of_pairs(case):
    model = make_model(300 + RANK)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=SIZE - 1)
    assert_params_equal(model, make_model(300 + SIZE - 1))


def params_list_of_tensors(case):
    """Horovod also takes bare tensors (``list(model.parameters())``), named by position."""
    model = make_model(310 + RANK)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=SIZE - 1)
    assert_params_equal(model, make_model(310 + SIZE - 1))


def scheduler_made_before(case):
    """A learning-rate scheduler made for the plain optimizer before it was wrapped and its
    state broadcast (the order of some of Horovod's examples) schedules the learning rate the
    DistributedOptimizer steps with.  ``restored``: the plain optimizer already has state when
    it is wrapped (a checkpoint loaded first); ``plain_broadcast``: the state is broadcast on
    the plain optimizer, before wrapping."""
    variant = case.split(".")[-1]
    model = make_model(320)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if variant == "restored":
        model(local_data(RANK, 0)[0]).sum().backward()
        base.step()
        base.zero_grad()
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    if variant == "plain_broadcast":
        hvd.broadcast_optimizer_state(base, root_rank=0)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    if variant != "plain_broadcast":
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(3):
        opt.zero_grad()
        x, y = local_data(RANK, step + 1)
        F.mse_loss(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        lr = opt.param_groups[0]["lr"]
        assert lr == 0.1 * 0.5 ** step, f"step {step}: the optimizer steps with lr {lr}"
        opt.step()
        scheduler.step()
        assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert base.param_groups[0] is opt.param_groups[0], "the groups are no longer shared"
    assert not ranks_differing(dict(model.named_parameters())), "ranks differ"


def params_noncontiguous(case):
    bases = [torch.arange(12, dtype=torch.float32).reshape(3, 4) * (k + 1) for k in range(SIZE)]
    base = bases[RANK].clone()
    hvd.broadcast_parameters({"t": base.t(), "s": base[:, ::2]}, root_rank=0)
    assert torch.equal(base, bases[0]), base


def params_bad_input(case):
    for bad in (42, [1.5], {"a": 1}, [("a", torch.zeros(1), 3)]):
        try:
            hvd.broadcast_parameters(bad, root_rank=0)
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError(f"broadcast_parameters({bad!r}) did not raise")
    # A tensor before the bad entry is not sent either: nothing is left in flight.
    from hvdlite.common.runtime import state
    try:
        hvd.broadcast_parameters([("first", torch.zeros(2)), ("bad", 1.5)], root_rank=0)
    except ValueError as exc:
        assert "'bad' is a float" in str(exc), str(exc)
    else:
        raise AssertionError("a float among the parameters did not raise")
    assert not state.engine().in_flight.entries, list(state.engine().in_flight.entries)
    t = torch.full((3,), float(RANK))
    hvd.broadcast_parameters({"ok": t, "first": t + 1}, root_rank=SIZE - 1)
    assert t.tolist() == [float(SIZE - 1)] * 3


# --- lazily created state (Horovod's zero-gradient step) ---------------------------------------
class EmbedMLP(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(6, 3, sparse=True)
        self.fc = nn.Linear(3, 2)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


def lazy_sparse_adam(case):
    """SparseAdam takes sparse gradients only: Horovod gives it sparse zero gradients, which
    stay.  Its state (step 1, zero moments) then equals the root's."""
    model = EmbedMLP(400 + RANK)
    opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01 * (RANK + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=SIZE - 1)
    g = model.emb.weight.grad
    assert g is not None and g.is_sparse and g._nnz() == 0, g
    assert model.fc.weight.grad is None, "a parameter outside the optimizer got a gradient"
    assert opt.param_groups[0]["lr"] == 0.01 * SIZE
    state = opt.state[model.emb.weight]
    assert int(state["step"]) == 1 and not state["exp_avg"].any(), state
    assert not ranks_differing(opt.state_dict())


def lazy_sgd_sparse_embedding(case):
    """With model=, an SGD's sparse embedding parameters get sparse zero gradients (Horovod's
    rule), the others dense ones; plain SGD has no state, the hyper-parameters still come from
    the root."""
    model = EmbedMLP(410 + RANK)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (RANK + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    assert model.emb.weight.grad.is_sparse and model.emb.weight.grad._nnz() == 0
    for p in model.fc.parameters():
        assert p.grad.layout == torch.strided and not p.grad.any()
    assert opt.param_groups[0]["lr"] == 0.1
    # without model= every zero gradient is dense
    plain = EmbedMLP(410 + RANK)
    hvd.broadcast_optimizer_state(torch.optim.SGD(plain.parameters(), lr=0.1), root_rank=0)
    assert plain.emb.weight.grad.layout == torch.strided and not plain.emb.weight.grad.any()


def lazy_existing_grads_replaced(case):
    """Gradients computed before the call are replaced by zeros (Horovod sets every
    parameter's .grad), and the zero step moves the parameters by weight decay only: SGD with
    weight_decay=wd shrinks them by lr * wd, once."""
    model = make_model(420 + RANK)
    frozen = model.fc2.bias
    frozen.requires_grad_(False)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    F.mse_loss(model(local_data(RANK, 0)[0]), local_data(RANK, 0)[1]).backward()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1),
        named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for name, p in model.named_parameters():
        if p is frozen:
            assert p.grad is None and torch.equal(p, start[name])
            continue
        assert p.grad is not None and not p.grad.any(), f"{name!r}: .grad is not zeros"
        # momentum buffer = 0 + wd * p; p -= lr * buffer
        assert torch.equal(p.detach(), start[name] - 0.5 * (0.1 * start[name])), name
        buf = opt.state[p]["momentum_buffer"]
        assert torch.equal(buf, 0.1 * start[name]) or RANK != 0, name
    # training goes on from here: the next backward accumulates onto the zeros
    opt.zero_grad()
    F.mse_loss(model(local_data(RANK, 1)[0]), local_data(RANK, 1)[1]).backward()
    opt.step()


def lazy_stateless_sgd(case):
    """Plain SGD stays without state after the zero step; the parameters do not move (no
    weight decay) and the zero gradients stay."""
    model = make_model(430 + RANK)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert not opt.state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# --- objects -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Point:
    x: float
    tags: list
    child: "Point | None" = None


def make_obj(k):
    return {
        "rank": k, "name": f"rank-{k}", "floats": [1.5 * k, float("inf"), -0.0],
        "tuple": (k, ("nested", [k] * k)), "set": frozenset(range(k)), "none": None,
        "bytes": bytes(range(k * 10)), "tensor": torch.arange(k + 2, dtype=torch.float32) * k,
        "array": np.arange(3 * k, dtype=np.int16).reshape(k, 3),
        "deep": {"a": [{"b": {"c": [k, {"d": (k, k + 1)}]}}]}, 7: "int key",
    }


def deep_equal(a, b, path="obj"):
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            deep_equal(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            deep_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def object_broadcast(case):
    root = int(case.split("root")[-1])
    deep_equal(hvd.broadcast_object(make_obj(RANK), root_rank=root), make_obj(root))
    # non-root ranks may pass None
    got = hvd.broadcast_object(make_obj(RANK) if RANK == root else None, root_rank=root)
    deep_equal(got, make_obj(root))


def object_broadcast_large(case):
    big = bytes(np.random.default_rng(5).integers(0, 256, 3_000_000, dtype=np.uint8))
    got = hvd.broadcast_object({"blob": big} if RANK == 0 else {"blob": b"x"}, root_rank=0)
    assert got["blob"] == big


def object_broadcast_none(case):
    assert hvd.broadcast_object(None if RANK == 1 else [RANK], root_rank=1) is None


def make_point(k):
    return Point(float(k), [k, "t"], Point(-1.0, [], None))


def point_fields(p):
    """Compare instances by class name and fields: cloudpickle sends classes defined in
    ``__main__`` by value, so a receiving rank gets an equivalent class, not the same object."""
    assert type(p).__name__ == "Point", type(p)
    return dataclasses.asdict(p)


def object_broadcast_custom(case):
    got = hvd.broadcast_object(make_point(RANK), root_rank=SIZE - 1)
    assert point_fields(got) == point_fields(make_point(SIZE - 1)), got
    assert got.child.x == -1.0


def object_allgather_nested(case):
    got = hvd.allgather_object(make_obj(RANK))
    deep_equal(got, [make_obj(k) for k in range(SIZE)])


def object_allgather_uneven(case):
    got = hvd.allgather_object(list(range(1000 * RANK)))
    assert got == [list(range(1000 * k)) for k in range(SIZE)]


def object_allgather_none_empty(case):
    objs = [None, "", {}, (), b""]
    got = hvd.allgather_object(objs[RANK])
    assert got == objs[:SIZE] and [type(x) for x in got] == [type(x) for x in objs[:SIZE]]


def object_allgather_custom(case):
    got = hvd.allgather_object(make_point(RANK))
    assert [point_fields(p) for p in got] == [point_fields(make_point(k)) for k in range(SIZE)]


OTHER = {
    "params.list_of_pairs": params_list_of_pairs,
    "params.list_of_tensors": params_list_of_tensors,
    "scheduler.made_before.fresh": scheduler_made_before,
    "scheduler.made_before.restored": scheduler_made_before,
    "scheduler.made_before.plain_broadcast": scheduler_made_before,
    "params.noncontiguous_tensor": params_noncontiguous,
    "lazy_state.sparse_adam": lazy_sparse_adam,
    "lazy_state.sgd_sparse_embedding_model": lazy_sgd_sparse_embedding,
    "lazy_state.existing_grads_replaced": lazy_existing_grads_replaced,
    "lazy_state.stateless_sgd": lazy_stateless_sgd,
    "params.bad_input": params_bad_input,
    "object.broadcast_large": object_broadcast_large,
    "object.broadcast_none": object_broadcast_none,
    "object.broadcast_custom_class": object_broadcast_custom,
    "object.allgather_nested": object_allgather_nested,
    "object.allgather_uneven_sizes": object_allgather_uneven,
    "object.allgather_none_and_empty": object_allgather_none_empty,
    "object.allgather_custom_class": object_allgather_custom,
}
for case in C.state_cases(SIZE):
    if case.startswith("state."):
        continue
    if case in OTHER:
        fn = OTHER[case]
    elif case.startswith("params.state_dict_with_buffers"):
        fn = params_state_dict
    elif case.startswith("params.named_parameters"):
        fn = params_named
    elif case.startswith("object.broadcast.root"):
        fn = object_broadcast
    else:
        raise AssertionError(f"no implementation for {case}")
    r.case(case, fn, case)

r.write()
hvd.shutdown()
