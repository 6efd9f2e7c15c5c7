"""Sparse tensors in hvdlite.torch on every rank.

sparse_allreduce cases rebuild every rank's deterministic sparse input and check the result
against a dense float64 reference (and against hvd.allreduce of the dense input, which must agree
bit for bit: values are multiples of 1/4, so every sum is exact and only the final scaling rounds).
Optimizer cases train nn.Embedding(sparse=True) models and compare with (a) every other rank's
parameters, bit for bit, and (b) a single-process reference trained on the whole global batch.
"""
import copy

import torch
import torch.nn.functional as F
import torch_cases as C
from torch import nn

import hvdlite.torch as hvd
from hvdlite.torch.sparse import sparse_allreduce, sparse_allreduce_async
from tests.torch.test_sparse import SPARSE_CASES


def _world():
    # imported after hvd.init(), which sets MPI up the way hvdlite needs it
    from mpi4py import MPI
    return MPI.COMM_WORLD


torch.set_num_threads(1)
hvd.init()
COMM = _world()
RANK, SIZE = hvd.rank(), hvd.size()
r = C.synced_reporter(RANK, COMM)
OP = {"Average": hvd.Average, "Sum": hvd.Sum}


# --- helpers -----------------------------------------------------------------------------------
def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_on_all_ranks(blob, what):
    gathered = COMM.allgather(blob)
    assert all(g == gathered[0] for g in gathered), f"{what} differs between ranks"


def sparse_same_on_all_ranks(t, what="result"):
    same_on_all_ranks(bits(t.indices()) + bits(t.values()) + repr(tuple(t.shape)).encode(), what)


def expect(exc_type, fn, *args, **kwargs):
    """Call ``fn``; it must raise ``exc_type``; return the exception."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    except Exception as exc:
        raise AssertionError(f"expected {exc_type.__name__}, got {type(exc).__name__}: "
                             f"{exc}") from exc
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


def follow_up(case):
    """Collectives right after an error must still work (nothing left half-submitted)."""
    res = hvd.allreduce(torch.tensor([float(RANK), 1.0]), op=hvd.Sum, name=case + ".followup")
    assert res.tolist() == [float(sum(range(SIZE))), float(SIZE)], res


# --- sparse_allreduce --------------------------------------------------------------------------
def sparse_input(case, k, pattern, dtype=torch.float32):
    """Rank ``k``'s input: an *uncoalesced* COO tensor (indices may repeat within a rank).
    Values are multiples of 1/4 (integers for integer dtypes)."""
    g = torch.Generator().manual_seed(C.seed_of(case, k))

    def vals(shape):
        v = torch.randint(-32, 33, shape, generator=g)
        return v.to(dtype) if not dtype.is_floating_point else (v.double() / 4).to(dtype)

    if pattern in ("overlap", "empty_rank"):
        # few rows for many entries: repeats within a rank and rows shared across ranks
        nnz = 0 if pattern == "empty_rank" and k == 1 else 5
        shape, idx = (8,), torch.randint(0, 4, (1, nnz), generator=g)
        v = vals((nnz,))
    elif pattern == "distinct":      # rows k*4 .. k*4+3: no other rank touches them
        shape, idx = (4 * SIZE,), (k * 4 + torch.randperm(4, generator=g)[:3]).reshape(1, 3)
        v = vals((3,))
    elif pattern == "all_empty":
        shape, idx = (6, 3), torch.empty((1, 0), dtype=torch.int64)
        v = vals((0, 3))
    elif pattern == "rows2d":        # embedding-gradient shape: sparse rows of dense vectors
        nnz = 2 + k
        shape, idx = (10, 4), torch.randint(0, 10, (1, nnz), generator=g)
        v = vals((nnz, 4))
    elif pattern == "sparse2d":      # two sparse dimensions, scalar values
        shape = (5, 6)
        idx = torch.stack([torch.randint(0, 5, (4,), generator=g),
                           torch.randint(0, 6, (4,), generator=g)])
        v = vals((4,))
    else:
        raise ValueError(pattern)
    return torch.sparse_coo_tensor(idx, v, shape, check_invariants=True)


def dense_reference(inputs, op, scale=1.0):
    wide = torch.float64 if inputs[0].dtype.is_floating_point else torch.int64
    total = sum(t.to_dense().to(wide) for t in inputs) * scale
    return total / len(inputs) if op == "Average" else total


def check_sparse_result(res, inp, expected, exact, what="result"):
    assert res.layout == torch.sparse_coo, res.layout
    assert res.is_coalesced(), "result is not coalesced"
    assert res.shape == inp.shape and res.dtype == inp.dtype, (res.shape, res.dtype)
    assert res.sparse_dim() == inp.sparse_dim() and res.dense_dim() == inp.dense_dim()
    assert not res.requires_grad
    got = res.to_dense().to(expected.dtype)
    if exact:
        assert torch.equal(got, expected), f"{what}: {got} != {expected}"
    else:
        rtol, atol = C.FLOAT_TOL[str(inp.dtype).split(".")[1]]
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    sparse_same_on_all_ranks(res, what)


def allreduce_case(case):
    _, op, dt, pat = case.split(".")
    dtype = C.torch_dtype(dt)
    inputs = [sparse_input(case, k, pat, dtype) for k in range(SIZE)]
    inp = inputs[RANK]
    res = sparse_allreduce(inp, name=case, op=OP[op])
    check_sparse_result(res, inp, dense_reference(inputs, op), exact=op == "Sum")
    # The same reduction done densely must agree bit for bit (the sums are exact; both scale by
    # 1/size the same way).
    dense = hvd.allreduce(inp.to_dense(), op=OP[op], name=case + ".dense")
    assert torch.equal(res.to_dense(), dense), f"sparse {res.to_dense()} != dense {dense}"


def default_op(case):
    inputs = [sparse_input(case, k, "rows2d") for k in range(SIZE)]
    res = sparse_allreduce(inputs[RANK], case)
    check_sparse_result(res, inputs[RANK], dense_reference(inputs, "Average"), exact=False)


def op_as_int(case):
    inputs = [sparse_input(case, k, "overlap") for k in range(SIZE)]
    res = sparse_allreduce(inputs[RANK], case, op=int(hvd.Sum))
    check_sparse_result(res, inputs[RANK], dense_reference(inputs, "Sum"), exact=True)


def scaled(case):
    inputs = [sparse_input(case, k, "rows2d", torch.float64) for k in range(SIZE)]
    for op in ("Sum", "Average"):
        res = sparse_allreduce(inputs[RANK], f"{case}.{op}", op=OP[op], prescale_factor=0.5,
                               postscale_factor=3.0)
        check_sparse_result(res, inputs[RANK], dense_reference(inputs, op, 1.5), exact=False)
        dense = hvd.allreduce(inputs[RANK].to_dense(), name=f"{case}.{op}.dense", op=OP[op],
                              prescale_factor=0.5, postscale_factor=3.0)
        assert torch.equal(res.to_dense(), dense)


def unnamed(case):
    for pat in ("overlap", "rows2d"):
        inputs = [sparse_input(case + pat, k, pat) for k in range(SIZE)]
        res = sparse_allreduce(inputs[RANK], op=hvd.Sum)
        check_sparse_result(res, inputs[RANK], dense_reference(inputs, "Sum"), exact=True)


def async_several(case):
    pats = ["overlap", "rows2d", "sparse2d"]
    inputs = {p: [sparse_input(case + p, k, p) for k in range(SIZE)] for p in pats}
    handles = {}
    for p in pats:
        handles[p] = sparse_allreduce_async(inputs[p][RANK], f"{case}.{p}", hvd.Sum)
        if p == "overlap":    # a dense op in flight between the sparse ones
            dense_handle = hvd.allreduce_async(torch.ones(3), name=f"{case}.dense", op=hvd.Sum)
    for p in reversed(pats):
        res = hvd.synchronize(handles[p])
        assert hvd.poll(handles[p])
        check_sparse_result(res, inputs[p][RANK], dense_reference(inputs[p], "Sum"), exact=True,
                            what=p)
    assert hvd.synchronize(dense_handle).tolist() == [float(SIZE)] * 3


def handle_is_callable(case):
    """Horovod's sparse_allreduce_async(tensor, name, op) returns a function: calling it gives
    the reduced sparse tensor.  hvdlite's handle is callable too, and still works with
    hvd.poll / hvd.synchronize / handle.wait (in any order, any number of times)."""
    pats = ["overlap", "rows2d"]
    inputs = {p: [sparse_input(case + p, k, p) for k in range(SIZE)] for p in pats}
    called = sparse_allreduce_async(inputs["overlap"][RANK], f"{case}.called", hvd.Sum)
    waited = hvd.sparse_allreduce_async(inputs["rows2d"][RANK], f"{case}.waited", hvd.Average)
    res = called()
    assert hvd.poll(called)
    check_sparse_result(res, inputs["overlap"][RANK], dense_reference(inputs["overlap"], "Sum"),
                        exact=True, what="handle()")
    assert torch.equal(hvd.synchronize(called).to_dense(), res.to_dense())
    res = hvd.synchronize(waited)
    check_sparse_result(res, inputs["rows2d"][RANK],
                        dense_reference(inputs["rows2d"], "Average"), exact=False,
                        what="synchronize(handle)")
    assert torch.equal(waited().to_dense(), res.to_dense()) and hvd.poll(waited)
    assert torch.equal(waited.wait().to_dense(), res.to_dense())


def input_unchanged(case):
    inputs = [sparse_input(case, k, "overlap") for k in range(SIZE)]
    inp = inputs[RANK]
    idx, val = inp._indices().clone(), inp._values().clone()
    sparse_allreduce(inp, case)
    assert not inp.is_coalesced(), "the input was coalesced in place"
    assert torch.equal(inp._indices(), idx) and torch.equal(inp._values(), val), "input modified"


def requires_grad_input(case):
    inputs = [sparse_input(case, k, "rows2d") for k in range(SIZE)]
    inp = inputs[RANK].clone().requires_grad_(True)
    res = sparse_allreduce(inp, case, op=hvd.Sum)
    check_sparse_result(res, inp, dense_reference(inputs, "Sum"), exact=True)


def unsupported_ops(case):
    inp = sparse_input(case, RANK, "overlap")
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        exc = expect(ValueError, sparse_allreduce, inp, case, op=op)
        msg = str(exc)
        assert op.name in msg and "Average" in msg and "sparse_as_dense=True" in msg, msg
        expect(ValueError, sparse_allreduce_async, inp, case, op)
    # nothing was submitted: the same name works right away
    inputs = [sparse_input(case, k, "overlap") for k in range(SIZE)]
    res = sparse_allreduce(inp, case, op=hvd.Sum)
    check_sparse_result(res, inp, dense_reference(inputs, "Sum"), exact=True)
    follow_up(case)


def dense_input(case):
    exc = expect(TypeError, sparse_allreduce, torch.ones(3), case)
    assert "sparse" in str(exc) and "allreduce" in str(exc), str(exc)
    expect(TypeError, sparse_allreduce, [1.0, 2.0], case)
    follow_up(case)


def size_mismatch(case):
    # rank 0's tensor is smaller than the indices the others send: it must refuse to build an
    # out-of-range sparse tensor; the others get a valid result of their own size
    t = torch.sparse_coo_tensor(torch.tensor([[RANK + 3]]), torch.tensor([1.0]),
                                (4 if RANK == 0 else 8,), check_invariants=True)
    if RANK == 0:
        exc = expect(ValueError, sparse_allreduce, t, case, op=hvd.Sum)
        assert "same size on every rank" in str(exc), str(exc)
    else:
        res = sparse_allreduce(t, case, op=hvd.Sum)
        assert res.to_dense().tolist() == [1.0 if 3 <= i < 3 + SIZE else 0.0 for i in range(8)]
    follow_up(case)


def complex_values(case):
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, dtype=torch.complex64),
                                (4,), check_invariants=True)
    exc = expect(hvd.UnsupportedDtypeError, sparse_allreduce, t, case, op=hvd.Sum)
    assert "complex64" in str(exc), str(exc)
    # nothing went out: the same name works right away
    res = sparse_allreduce(t.real, case, op=hvd.Sum)
    assert res.to_dense().tolist() == [float(SIZE), 0.0, float(SIZE), 0.0], res
    follow_up(case)


def bool_average(case):
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([True, False]), (4,))
    expect(ValueError, sparse_allreduce, t, case)
    follow_up(case)


# --- DistributedOptimizer ----------------------------------------------------------------------
V, D, L, IN = 16, 3, 3, 4      # vocabulary, embedding dim (= outputs), lookups per row, features
B = 4                          # rows per rank per step
STEPS = 4


class EmbedNet(nn.Module):
    """Mean of L embedding rows per example, plus (``mixed``) a dense Linear of features."""

    def __init__(self, sparse=True, mixed=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, D, sparse=sparse)
        self.lin = nn.Linear(IN, D) if mixed else None

    def forward(self, idx, x, use_emb=True):
        out = self.emb(idx).mean(1) if use_emb else torch.zeros(idx.shape[0], D)
        return out if self.lin is None else out + self.lin(x)


def batch(case, step):
    g = torch.Generator().manual_seed(C.seed_of(case, "batch", step))
    idx = torch.randint(0, V, (SIZE * B, L), generator=g)
    x = torch.randn(SIZE * B, IN, generator=g)
    y = torch.randn(SIZE * B, D, generator=g)
    return idx, x, y


def shard(t, k=None):
    k = RANK if k is None else k
    return t[k * B:(k + 1) * B]


def params_same_on_all_ranks(model):
    for name, p in model.named_parameters():
        same_on_all_ranks(bits(p), f"parameter {name!r}")


def close_to(model, ref, tol):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=tol,
                                   msg=lambda m, name=name: f"parameter {name!r}: {m}")


def moved(model, init):
    for (name, p), (_, q) in zip(model.named_parameters(), init.named_parameters(), strict=True):
        assert not torch.equal(p, q), f"{name!r} never changed"


def uses_emb(k, step, rank0_drops):
    """Whether rank k's model uses the embedding in ``step``.  rank0_drops: False (always),
    True (rank 0 stops after the first step), "first" (rank 0 skips only the first step, so
    it has no gradient the first time the embedding is reduced), "staggered" (nobody in
    step 0, only the last rank in step 1, everyone after)."""
    if rank0_drops == "first":
        return not (k == 0 and step == 0)
    if rank0_drops == "staggered":
        return step >= 2 or (step == 1 and k == SIZE - 1)
    return not (rank0_drops and k == 0 and step >= 1)


def train_dist(case, model, opt, micro=1, check_grads=None, rank0_drops=False,
               set_to_none=True):
    for step in range(STEPS):
        idx, x, y = batch(case, step)
        opt.zero_grad(set_to_none=set_to_none)
        use = uses_emb(RANK, step, rank0_drops)
        for im, xm, ym in zip(shard(idx).chunk(micro), shard(x).chunk(micro),
                              shard(y).chunk(micro), strict=True):
            (F.mse_loss(model(im, xm, use), ym) / micro).backward()
        if check_grads is not None:
            opt.synchronize()
            check_grads(model)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()


def train_ref(case, model, opt, loss_mul=1.0, rank0_drops=False):
    """Single process on the whole batch: the mean over equal shards of each shard's loss."""
    for step in range(STEPS):
        idx, x, y = batch(case, step)
        opt.zero_grad()
        loss = sum(F.mse_loss(model(shard(idx, k), shard(x, k), uses_emb(k, step, rank0_drops)),
                              shard(y, k)) for k in range(SIZE)) / SIZE
        (loss * loss_mul).backward()
        opt.step()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)


def grads_are(sparse):
    def check(model):
        g = model.emb.weight.grad
        if sparse:
            assert g.is_sparse and g.is_coalesced(), "embedding gradient is not sparse+coalesced"
            sparse_same_on_all_ranks(g, "embedding gradient")
        else:
            # Horovod's sparse_as_dense: reduced densely, then to_sparse() (every dimension
            # sparse, exact zeros dropped) before the update
            assert g.is_sparse, f"sparse_as_dense left a {g.layout} gradient"
            assert g.sparse_dim() == g.dim(), (g.sparse_dim(), g.dim())
            dense = g.to_dense()
            assert torch.equal(dense.to_sparse().to_dense(), dense)
            assert g._nnz() == int((dense != 0).sum()), "exact zeros kept"
            same_on_all_ranks(bits(dense), "embedding gradient")
        if model.lin is not None:
            assert model.lin.weight.grad.layout == torch.strided
    return check


def standard(case, mixed=False, sparse=True, make_opt=sgd, ref_sparse=False, dist_kwargs=None,
             tol=1e-5, loss_mul=1.0, micro=1, check_grads=None, rank0_drops=False,
             set_to_none=True):
    model = EmbedNet(sparse=True, mixed=mixed)
    init = copy.deepcopy(model)
    ref = EmbedNet(sparse=ref_sparse, mixed=mixed)
    kwargs = {"sparse_as_dense": not sparse, **(dist_kwargs or {})}
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   **kwargs)
    train_dist(case, model, opt, micro=micro, rank0_drops=rank0_drops, set_to_none=set_to_none,
               check_grads=check_grads or grads_are(sparse))
    train_ref(case, ref, make_opt(ref), loss_mul=loss_mul, rank0_drops=rank0_drops)
    params_same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, tol)


def optimizer_case(case):
    _, model, mode = case.split(".")
    standard(case, mixed=model == "mixed", sparse=mode == "sparse")


def sparse_adam(case):
    # SparseAdam only takes sparse gradients: so does its reference
    standard(case, make_opt=lambda m: torch.optim.SparseAdam(list(m.parameters()), lr=0.05),
             ref_sparse=True, tol=2e-5)


def compression_fp16(case):
    def check(model):
        grads_are(True)(model)
        g = model.lin.weight.grad
        assert torch.equal(g, g.half().float()), "dense gradient did not travel as fp16"
        assert model.emb.weight.grad.dtype == torch.float32
    standard(case, mixed=True, dist_kwargs={"compression": hvd.Compression.fp16}, tol=1e-3,
             check_grads=check)


def groups(case):
    model = EmbedNet(sparse=True, mixed=True)
    init, ref = copy.deepcopy(model), EmbedNet(sparse=False, mixed=True)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   groups=[[model.emb.weight, model.lin.weight], [model.lin.bias]])
    train_dist(case, model, opt, check_grads=grads_are(True))
    train_ref(case, ref, sgd(ref))
    params_same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, 1e-5)


def staggered_embedding(case):
    """A rank without a gradient the first time a parameter is reduced cannot tell a sparse
    reduction from a dense one: the ranks agree on it (this used to hang every rank).  When
    no rank used the embedding, its gradient is zeros everywhere."""
    steps = iter(range(STEPS))

    def check(model):
        step = next(steps)
        g = model.emb.weight.grad
        if any(uses_emb(k, step, "staggered") for k in range(SIZE)):
            grads_are(True)(model)
        else:
            assert g.layout == torch.strided and not g.any(), "expected dense zeros"
    standard(case, mixed=True, rank0_drops="staggered", check_grads=check)


def op_max_raises(case):
    model = EmbedNet(sparse=True)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   op=hvd.Max)
    idx, x, y = batch(case, 0)
    exc = expect(ValueError, lambda: F.mse_loss(model(shard(idx), shard(x)), shard(y)).backward())
    msg = str(exc)
    assert "emb.weight" in msg and "Max" in msg and "sparse_as_dense=True" in msg, msg
    follow_up(case)
    del opt


def as_dense_sparse_adam(case):
    """sparse_as_dense=True with SparseAdam (which refuses dense gradients) trains like
    Horovod's definition: the gradient averaged densely over the ranks, then to_sparse() (so an
    element whose average is exactly zero is left out: SparseAdam neither decays its moments
    nor moves it).  Column 2 of the embedding gets exact-zero gradients from step 1 on (the
    forward masks it), after a first step that gave it momentum: keeping those zeros in the
    sparse gradient (row-wise sparse) would move it on, so the reference tells them apart."""
    def mask(step):
        return torch.tensor([1.0, 1.0, 1.0 if step == 0 else 0.0])

    torch.manual_seed(7)
    emb = nn.Embedding(V, D, sparse=True)
    ref = nn.Embedding(V, D, sparse=False)
    ref.load_state_dict(emb.state_dict())
    init = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.05),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=True)
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05)
    for step in range(STEPS):
        idx, _, y = batch(case, step)
        opt.zero_grad()
        F.mse_loss(emb(shard(idx)).mean(1) * mask(step), shard(y)).backward()
        g = emb.weight.grad
        assert g.is_sparse and g.sparse_dim() == 2, f"step {step}: {g.layout}"
        opt.step()
        ref_opt.zero_grad()
        sum(F.mse_loss(ref(shard(idx, k)).mean(1) * mask(step), shard(y, k))
            for k in range(SIZE)).div(SIZE).backward()
        ref.weight.grad = ref.weight.grad.to_sparse()   # Horovod: dense average, to_sparse()
        ref_opt.step()
    same_on_all_ranks(bits(emb.weight), "embedding")
    assert not torch.equal(emb.weight, init)
    torch.testing.assert_close(emb.weight.detach(), ref.weight.detach(), rtol=0, atol=2e-6)


CASES = {}
for name in SPARSE_CASES:
    parts = name.split(".")
    if name.startswith("allreduce.") and len(parts) == 4:
        CASES[name] = allreduce_case
    elif name.startswith("optimizer.") and parts[1] in ("embedding", "mixed"):
        CASES[name] = optimizer_case
CASES.update({
    "allreduce.default_op_is_average": default_op,
    "allreduce.op_as_int": op_as_int,
    "allreduce.scaled": scaled,
    "allreduce.unnamed": unnamed,
    "allreduce.async_several_in_flight": async_several,
    "allreduce.input_unchanged": input_unchanged,
    "allreduce.requires_grad_input": requires_grad_input,
    "errors.unsupported_ops_then_sum": unsupported_ops,
    "errors.dense_input": dense_input,
    "errors.size_mismatch": size_mismatch,
    "errors.complex_values": complex_values,
    "errors.bool_average": bool_average,
    "optimizer.sparse_adam": sparse_adam,
    "optimizer.op_sum": lambda c: standard(c, mixed=True, dist_kwargs={"op": hvd.Sum},
                                           loss_mul=SIZE),
    "optimizer.predivide_factor": lambda c: standard(
        c, mixed=True, dist_kwargs={"gradient_predivide_factor": 2.0}),
    "optimizer.bpps2": lambda c: standard(c, mixed=True, micro=2,
                                          dist_kwargs={"backward_passes_per_step": 2}),
    "optimizer.compression_fp16": compression_fp16,
    "optimizer.groups": groups,
    "optimizer.unused_embedding_on_rank0": lambda c: standard(c, mixed=True, rank0_drops=True),
    "optimizer.unused_embedding_on_rank0_first_step": lambda c: standard(
        c, mixed=True, rank0_drops="first"),
    "optimizer.embedding_used_staggered": staggered_embedding,
    "optimizer.zero_grad_keep_sparse": lambda c: standard(c, mixed=True, set_to_none=False),
    "optimizer.op_max_raises": op_max_raises,
    "allreduce.handle_is_callable": handle_is_callable,
    "optimizer.as_dense_sparse_adam": as_dense_sparse_adam,
    # a rank without an embedding gradient gets a sparse one too (the ranks agreed on the
    # layout): every rank's SparseAdam-ready gradient is checked in grads_are
    "optimizer.as_dense_unused_embedding_on_rank0_first_step": lambda c: standard(
        c, mixed=True, sparse=False, rank0_drops="first"),
    "optimizer.as_dense_bpps2": lambda c: standard(
        c, mixed=True, sparse=False, micro=2, dist_kwargs={"backward_passes_per_step": 2}),
})
assert sorted(CASES) == sorted(SPARSE_CASES), sorted(set(CASES) ^ set(SPARSE_CASES))
for case in SPARSE_CASES:
    r.case(case, CASES[case], case)
r.write()
hvd.shutdown()
