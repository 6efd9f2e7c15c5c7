"""hvdlite.torch error handling on every rank: each case provokes an error that every rank must
see (as the documented exception type), then checks that a following collective still works."""
import copy
import gc
import weakref

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


def expect(exc_type, fn, *args, **kwargs):
    """Call ``fn``; it must raise ``exc_type``; return the exception."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}")
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


def follow_up(case):
    """A named and an unnamed collective right after the error must work."""
    res = hvd.allreduce(torch.tensor([float(RANK), 1.0]), op=hvd.Sum, name=case + ".followup")
    assert res.tolist() == [float(sum(range(SIZE))), float(SIZE)], res
    res = hvd.allgather(torch.full((RANK + 1,), RANK, dtype=torch.int32))
    assert res.tolist() == [k for k in range(SIZE) for _ in range(k + 1)], res


def mismatch(case, fn, *args, **kwargs):
    exc = expect(hvd.TensorMismatchError, fn, *args, **kwargs)
    assert isinstance(exc, hvd.HvdliteError)
    assert "ismatch" in str(exc), str(exc)
    follow_up(case)
    return exc


# --- error classes -----------------------------------------------------------------------------
def error_classes(case):
    from hvdlite.torch.optimizer import OptimizerMisuseError
    assert hvd.HorovodInternalError is hvd.HvdliteError
    for cls in (hvd.TensorMismatchError, hvd.DuplicateNameError, hvd.UnsupportedDtypeError,
                hvd.UnsupportedOperationError, hvd.NotInitializedError, OptimizerMisuseError):
        assert issubclass(cls, hvd.HvdliteError), cls
        assert issubclass(cls, hvd.HorovodInternalError), cls
        assert issubclass(cls, RuntimeError), cls
    # what Horovod raises for the same calls, and what hvdlite raised before
    assert issubclass(hvd.UnsupportedDtypeError, ValueError)       # Horovod: ValueError
    assert issubclass(hvd.UnsupportedDtypeError, TypeError)        # hvdlite before
    assert issubclass(hvd.UnsupportedOperationError, NotImplementedError)
    assert issubclass(hvd.UnsupportedOperationError, ValueError)
    assert issubclass(hvd.NotInitializedError, ValueError)         # Horovod's rank(), size()
    assert issubclass(OptimizerMisuseError, AssertionError)        # Horovod's optimizer


# --- Horovod's exception classes for the same calls --------------------------------------------
def h_reducescatter_adasum(case):
    """Horovod: HorovodInternalError (a RuntimeError); hvdlite's is also a ValueError, as
    before.  Raised locally, before anything is sent, for the grouped form too."""
    for fn in (lambda: hvd.reducescatter(torch.ones(SIZE, 2), op=hvd.Adasum, name=case),
               lambda: hvd.reducescatter_async(torch.ones(SIZE), name=case + ".a",
                                               op=hvd.Adasum),
               lambda: hvd.grouped_reducescatter([torch.ones(SIZE)], op=hvd.Adasum,
                                                 name=case + ".g")):
        exc = expect(hvd.HorovodInternalError, fn)
        assert isinstance(exc, RuntimeError) and isinstance(exc, ValueError), type(exc)
        assert "Adasum" in str(exc) and "Sum or Average" in str(exc), str(exc)
    follow_up(case)


def h_unsupported_tensor_is_value_error(case):
    """Horovod: ValueError("Tensor type ... is not supported") for a dtype, layout or device it
    has no kernel for."""
    for t in (torch.ones(2, dtype=torch.complex64), torch.ones(2, dtype=torch.uint32),
              torch.ones(2).to_sparse(), torch.ones(2, device="meta")):
        for fn in (lambda: hvd.allreduce(t, name=case), lambda: hvd.broadcast_(t, 0),
                   lambda: hvd.allgather(t), lambda: hvd.alltoall(t)):
            exc = expect(ValueError, fn)
            assert isinstance(exc, hvd.UnsupportedDtypeError), type(exc)
    follow_up(case)


def h_adasum_ranks(case):
    """Horovod: NotImplementedError for Adasum on a number of ranks that is not a power of
    two (raised before anything is sent)."""
    from hvdlite.common.data_paths.adasum import check_adasum_size
    exc = expect(NotImplementedError, check_adasum_size, 3, "allreduce of 'x'")
    assert isinstance(exc, ValueError) and "power-of-two" in str(exc), str(exc)
    x = torch.ones(4)
    if SIZE & (SIZE - 1):
        expect(NotImplementedError, hvd.allreduce, x, op=hvd.Adasum, name=case)
        expect(NotImplementedError, hvd.DistributedOptimizer,
               torch.optim.SGD([nn.Parameter(x)], lr=0.1), op=hvd.Adasum)
    else:
        assert hvd.allreduce(x, op=hvd.Adasum, name=case).tolist() == [1.0] * 4
    follow_up(case)


def h_gradient_of_max(case):
    """Horovod's backward would reduce the gradient with Max too; hvdlite refuses with an
    UnsupportedOperationError (a RuntimeError) on every rank, inside backward()."""
    x = torch.ones(3, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Max, name=case)
    exc = expect(hvd.UnsupportedOperationError, lambda: y.sum().backward())
    assert isinstance(exc, RuntimeError) and "Max" in str(exc), str(exc)
    follow_up(case)


def h_poll_not_a_handle(case):
    """Horovod: TypeError (pybind11 refuses the argument); hvdlite's synchronize() of a
    non-handle raises HvdliteError where Horovod returns None (a deliberate deviation)."""
    expect(TypeError, hvd.poll, 42)
    expect(hvd.HvdliteError, hvd.synchronize, 42)
    follow_up(case)


# --- mismatches across ranks -------------------------------------------------------------------
def odd(value_rank0, value_others):
    return value_rank0 if RANK == 0 else value_others


def m_allreduce_shape(case):
    exc = mismatch(case, hvd.allreduce, torch.ones(RANK + 2), name=case)
    assert "shape" in str(exc), str(exc)


def m_allreduce_dtype(case):
    exc = mismatch(case, hvd.allreduce, torch.ones(4, dtype=odd(torch.float32, torch.float64)),
                   name=case)
    assert "dtype" in str(exc), str(exc)


def m_allreduce_op(case):
    mismatch(case, hvd.allreduce, torch.ones(4), name=case, op=odd(hvd.Sum, hvd.Max))


def m_allreduce_prescale(case):
    mismatch(case, hvd.allreduce, torch.ones(4), name=case, prescale_factor=odd(1.0, 2.0))


def m_allreduce_unnamed(case):
    mismatch(case, hvd.allreduce, torch.ones(3, odd(1, 2)))


def m_allreduce_async(case):
    handle = hvd.allreduce_async(torch.ones(odd(5, 6)), name=case)
    mismatch(case, hvd.synchronize, handle)
    assert hvd.poll(handle) is True


def m_allreduce_inplace(case):
    t = torch.ones(4, dtype=odd(torch.int32, torch.int64))
    mismatch(case, hvd.allreduce_, t, name=case)


def m_broadcast_shape(case):
    mismatch(case, hvd.broadcast, torch.ones(odd(2, 3)), 0, name=case)


def m_broadcast_root(case):
    exc = mismatch(case, hvd.broadcast, torch.ones(3), odd(0, 1), name=case)
    assert "root" in str(exc), str(exc)


def m_broadcast_dtype(case):
    mismatch(case, hvd.broadcast_, torch.ones(3, dtype=odd(torch.float16, torch.bfloat16)), 0,
             name=case)


def m_allgather_trailing(case):
    mismatch(case, hvd.allgather, torch.ones(2, RANK + 1), name=case)


def m_allgather_ndim(case):
    mismatch(case, hvd.allgather, torch.ones(odd((2, 3), (2, 3, 1))), name=case)


def m_allgather_dtype(case):
    mismatch(case, hvd.allgather, torch.ones(2, dtype=odd(torch.uint8, torch.int8)), name=case)


def m_kind(case):
    t = torch.ones(3)
    if RANK == 0:
        mismatch(case, hvd.allreduce, t, name=case)
    else:
        mismatch(case, hvd.broadcast, t, 0, name=case)


def m_then_same_name_ok(case):
    mismatch(case, hvd.allreduce, torch.ones(odd(2, 3)), name=case, op=hvd.Sum)
    res = hvd.allreduce(torch.full((3,), float(RANK + 1)), name=case, op=hvd.Sum)
    assert res.tolist() == [float(sum(range(1, SIZE + 1)))] * 3, res


def m_optimizer(case):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, odd(4, 5)), nn.Tanh(), nn.Linear(odd(4, 5), 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    # the reductions are finished at the end of backward(): the mismatch is raised there
    mismatch(case, lambda: model(torch.ones(2, 3)).sum().backward())
    assert not any(h[0] is not None for h in opt._reducer.handles.values()), "left in flight"
    # nothing was applied, and the optimizer is usable again
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()


def m_error_frees_the_graph(case):
    """Once the user drops a failed reduction's error, nothing keeps the backward pass that
    raised it alive.  (The background thread used to hold its last round's entries until the
    next round: the error, its traceback's frames and so the whole autograd graph stayed
    alive, and a parameter whose shape the user then fixed still met its old gradient
    accumulator.)  No collective runs between the error and the check."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, odd(4, 5)), nn.Tanh(), nn.Linear(odd(4, 5), 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    loss = model(torch.ones(2, 3)).sum()
    graph = weakref.ref(loss)
    exc = expect(hvd.TensorMismatchError, loss.backward)
    assert "ismatch" in str(exc), str(exc)
    del loss, exc
    gc.collect()
    assert graph() is None, "the failed backward pass's graph is still alive"
    opt.zero_grad()
    follow_up(case)


# --- duplicate names in flight -----------------------------------------------------------------
def pending_on_every_rank(case, attempts):
    """Check ``attempts`` (functions submitting name N while N is in flight) deterministically.

    A tensor cannot complete before every rank submitted it, so: every rank but 1 submits
    ``case.a`` and rank 1 submits ``case.b``; each rank makes its duplicate attempts on the name
    it knows to be pending (the rank still missing will submit only after the barrier)."""
    mine = case + (".b" if RANK == 1 else ".a")
    x = torch.full((4,), float(RANK))
    first = hvd.allreduce_async(x, op=hvd.Sum, name=mine)
    errors = []
    for attempt in attempts:
        try:
            attempt(mine)
        except hvd.DuplicateNameError as exc:
            errors.append(exc)
        except Exception as exc:  # noqa: BLE001
            errors.append(AssertionError(f"{type(exc).__name__}: {exc}"))
        else:
            errors.append(AssertionError("no DuplicateNameError"))
    COMM.Barrier()
    other = hvd.allreduce_async(x, op=hvd.Sum, name=case + (".a" if RANK == 1 else ".b"))
    expected = [float(sum(range(SIZE)))] * 4
    results = [hvd.synchronize(first).tolist(), hvd.synchronize(other).tolist()]
    for err in errors:
        if not isinstance(err, hvd.DuplicateNameError):
            raise err
        assert isinstance(err, hvd.HvdliteError) and mine in str(err), str(err)
    assert results == [expected, expected], results
    follow_up(case)


def dup_allreduce(case):
    pending_on_every_rank(case, [
        lambda n: hvd.allreduce_async(torch.ones(4), name=n),
        lambda n: hvd.allreduce_async_(torch.ones(4), name=n),
        lambda n: hvd.allreduce(torch.ones(4), name=n),
    ])


def dup_across_kinds(case):
    pending_on_every_rank(case, [
        lambda n: hvd.broadcast_async(torch.ones(4), 0, name=n),
        lambda n: hvd.broadcast_async_(torch.ones(4), 0, name=n),
        lambda n: hvd.allgather_async(torch.ones(4), name=n),
    ])


def dup_after_completion(case):
    for i in range(3):
        res = hvd.synchronize(hvd.allreduce_async(torch.full((2,), float(i)), name=case,
                                                  op=hvd.Sum))
        assert res.tolist() == [float(i * SIZE)] * 2


# --- unsupported tensors -----------------------------------------------------------------------
def unsupported(case, fn, *args, **kwargs):
    exc = expect(hvd.UnsupportedDtypeError, fn, *args, **kwargs)
    assert isinstance(exc, hvd.HvdliteError)
    follow_up(case)


def u_dtype(case):
    dt = getattr(torch, case.split(".")[1])
    t = torch.ones(3, dtype=dt)
    unsupported(case, hvd.allreduce, t, name=case)
    unsupported(case + ".inplace", hvd.allreduce_, t, name=case + ".inplace", op=hvd.Sum)


def u_complex_broadcast(case):
    unsupported(case, hvd.broadcast, torch.ones(3, dtype=torch.complex64), 0, name=case)
    unsupported(case + ".inplace", hvd.broadcast_, torch.ones(3, dtype=torch.complex128), 0)


def u_complex_allgather(case):
    unsupported(case, hvd.allgather, torch.ones(3, dtype=torch.complex64), name=case)


def u_bool_average(case):
    unsupported(case, hvd.allreduce, torch.ones(3, dtype=torch.bool), name=case)
    unsupported(case + ".explicit", hvd.allreduce, torch.ones(3, dtype=torch.bool),
                op=hvd.Average)


def u_non_cpu(case):
    # no GPU here: the meta device stands in for any non-CPU device
    t = torch.ones(3, device="meta")
    unsupported(case, hvd.allreduce, t, name=case)
    unsupported(case + ".bc", hvd.broadcast, t, 0, name=case + ".bc")
    unsupported(case + ".ag", hvd.allgather, t, name=case + ".ag")


def u_sparse_inplace_allgather(case):
    t = torch.ones(3).to_sparse()
    unsupported(case, hvd.allreduce_, t, name=case)
    unsupported(case + ".bc", hvd.broadcast_, t, 0, name=case + ".bc")
    unsupported(case + ".ag", hvd.allgather, t, name=case + ".ag")


def u_sparse_out_of_place(case):
    t = torch.ones(3).to_sparse()
    unsupported(case, hvd.allreduce, t, name=case)
    unsupported(case + ".async", hvd.allreduce_async, t, name=case + ".async")
    unsupported(case + ".bc", hvd.broadcast, t, 0, name=case + ".bc")
    unsupported(case + ".bc_async", hvd.broadcast_async, t, 0, name=case + ".bc_async")


# --- bad arguments (raised locally, before anything is sent) -----------------------------------
def a_average_and_op(case):
    expect(ValueError, hvd.allreduce, torch.ones(2), average=True, op=hvd.Sum)
    follow_up(case)


def a_root_out_of_range(case):
    for root in (SIZE, -1):
        expect(ValueError, hvd.broadcast, torch.ones(2), root, name=f"{case}.{root}")
    follow_up(case)


def a_not_a_tensor(case):
    expect(TypeError, hvd.allreduce, [1.0, 2.0], name=case)
    follow_up(case)


def a_predivide_with_sum(case):
    model = nn.Linear(2, 2)
    expect(ValueError, hvd.DistributedOptimizer,
           torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
           op=hvd.Sum, gradient_predivide_factor=2.0)
    follow_up(case)


def a_bpps_zero(case):
    model = nn.Linear(2, 2)
    expect(ValueError, hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1),
           named_parameters=model.named_parameters(), backward_passes_per_step=0)
    follow_up(case)


# --- optimizer misuse --------------------------------------------------------------------------
def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def data(step=0):
    g = torch.Generator().manual_seed(C.seed_of("errors.data", RANK, step))
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def params_same_on_all_ranks(model):
    blob = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    gathered = COMM.allgather(blob)
    assert all(g == gathered[0] for g in gathered), "parameters differ between ranks"


def o_zero_grad_in_flight(case):
    """Reductions stay in flight only when a backward pass raised half-way (its end never came
    to finish them): zero_grad() then refuses and clears nothing, step() finishes them."""
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = data()

    def fail(grad):
        raise RuntimeError("boom in backward")

    # the hook raises after the last layer's gradients started their reductions
    hidden = model[0](x)
    hidden.register_hook(fail)
    expect(RuntimeError, lambda: F.mse_loss(model[2](torch.tanh(hidden)), y).backward())
    in_flight = [p for p, h in opt._reducer.handles.items() if h[0] is not None]
    assert in_flight, "test set-up: the failed backward must leave reductions in flight"
    exc = expect(AssertionError, opt.zero_grad)   # (Horovod's class; also an HvdliteError)
    assert isinstance(exc, hvd.HvdliteError), type(exc)
    assert "synchronize()" in str(exc), str(exc)
    assert all(p.grad is not None for p in in_flight), "zero_grad cleared gradients"
    opt.step()      # the reductions in flight complete normally
    opt.zero_grad()
    x, y = data(1)
    F.mse_loss(model(x), y).backward()
    opt.step()
    params_same_on_all_ranks(model)
    follow_up(case)


def too_many_passes(case, bpps):
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=bpps)
    before = copy.deepcopy(model)
    x, y = data()
    for _ in range(bpps):
        F.mse_loss(model(x), y).backward()
    exc = expect(AssertionError, lambda: F.mse_loss(model(x), y).backward())   # as Horovod
    assert isinstance(exc, hvd.HvdliteError), type(exc)
    assert "backward_passes_per_step" in str(exc), str(exc)
    # recover: drain what is in flight, start over from identical parameters
    opt.synchronize()
    opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))
    for step in range(2):
        opt.zero_grad()
        for _ in range(bpps):
            x, y = data(step + 1)
            F.mse_loss(model(x), y).backward()
        opt.step()
    params_same_on_all_ranks(model)
    follow_up(case)


def o_duplicate_named(case):
    model = make_model()
    named = [("same", p) for p in model.parameters()]
    exc = expect(ValueError, hvd.DistributedOptimizer,
                 torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)
    assert "same" in str(exc), str(exc)
    follow_up(case)


def o_named_missing(case):
    model = make_model()
    named = list(model.named_parameters())[:-1]
    expect(ValueError, hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1),
           named_parameters=named)
    follow_up(case)


def o_named_not_pairs(case):
    model = make_model()
    expect(ValueError, hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1),
           named_parameters=list(model.parameters()))
    follow_up(case)


class EmbedModel(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(10, 4, sparse=sparse)
        self.out = nn.Linear(4, 1)

    def forward(self, idx):
        return self.out(self.emb(idx)).squeeze(-1)


def embed_data(k, step):
    g = torch.Generator().manual_seed(C.seed_of("embed", k, step))
    return torch.randint(0, 10, (5,), generator=g), torch.randn(5, generator=g)


def o_sparse_unsupported_op(case):
    """Sparse gradients are reduced by allgather (Average/Sum only): op=Max must fail clearly
    during backward, naming the parameter, and leave the job usable."""
    model = nn.Embedding(10, 4, sparse=True)   # embedding only: no dense reduction in flight
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Max)
    idx, _ = embed_data(RANK, 0)
    exc = expect(ValueError, lambda: model(idx).sum().backward())
    assert "sparse" in str(exc) and "weight" in str(exc), str(exc)
    follow_up(case)
    del opt


def o_sparse_as_dense(case):
    model = EmbedModel(sparse=True)
    ref = EmbedModel(sparse=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   sparse_as_dense=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        idx, y = embed_data(RANK, step)
        opt.zero_grad()
        F.mse_loss(model(idx), y).backward()
        opt.step()
        ref_opt.zero_grad()   # reference: average of every rank's loss (equal-size shards)
        sum(F.mse_loss(ref(i), t) for i, t in (embed_data(k, step) for k in range(SIZE))) \
            .div(SIZE).backward()
        ref_opt.step()
    params_same_on_all_ranks(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)
    follow_up(case)


def o_sync_error_waits_for_rest(case):
    """One gradient's reduction fails (its shape differs across ranks) and is waited for first:
    synchronize() must still wait for every other gradient and write its average (with fp16
    compression only synchronize() writes it), raise the error, and leave nothing in flight."""
    model = make_model()
    bad = nn.Parameter(torch.zeros(odd(2, 3)))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([*model.parameters(), bad], lr=0.1),
        named_parameters=[*model.named_parameters(), ("bad", bad)],
        compression=hvd.Compression.fp16)
    x, y = data()
    plain = make_model()
    local = torch.autograd.grad(F.mse_loss(plain(x), y), list(plain.parameters()))
    order = []
    on_grad_ready = opt._reducer.on_grad_ready

    def record(p):
        order.append(p)
        on_grad_ready(p)

    opt._reducer.on_grad_ready = record
    # bad's node is created last, so autograd runs it first: its reduction is waited for first
    # (at the end of backward(), which raises the error)
    mismatch(case, lambda: (F.mse_loss(model(x), y) + bad.sum()).backward())
    assert order[0] is bad, "test set-up: the failing gradient must come first"
    for p, g in zip(model.parameters(), local):
        expected = torch.from_numpy(COMM.allreduce(g.half().float().numpy())) / SIZE
        assert torch.allclose(p.grad, expected, rtol=1e-2, atol=1e-3), (p.grad, expected)
    assert not any(h[0] is not None for h in opt._reducer.handles.values())
    # the same names work again once the shapes agree.  (The error, raised inside backward(),
    # keeps that graph alive through its traceback until collected, and with it bad's
    # gradient accumulator, which remembers bad's old shape.)
    gc.collect()
    bad.data = torch.zeros(2)
    opt.zero_grad()
    x, y = data(1)
    (F.mse_loss(model(x), y) + bad.sum()).backward()
    opt.step()
    params_same_on_all_ranks(model)


# --- an error on one rank before an unnamed op is submitted ------------------------------------
LAST = SIZE - 1


def unnamed_follow_ups():
    """Unnamed ops of different shapes right after the error: with drifting automatic names
    these would pair with the wrong tensors (a mismatch, or a hang)."""
    for k in range(3):
        got = hvd.allreduce(torch.arange(k + 2, dtype=torch.float64) * (RANK + 1), op=hvd.Sum)
        want = torch.arange(k + 2, dtype=torch.float64) * sum(range(1, SIZE + 1))
        assert torch.equal(got, want), (k, got, want)
    res = hvd.grouped_allreduce([torch.ones(2) * RANK, torch.ones(3)], op=hvd.Sum)
    assert res[0].tolist() == [float(sum(range(SIZE)))] * 2 and res[1].tolist() == [SIZE] * 3
    follow_up("unnamed")


def unnamed_one_rank(bad_call, good_call, local_cls, cause):
    """Rank LAST raises ``local_cls`` from ``bad_call``; the others must get FailedOnRankError
    from ``good_call`` (same kind, unnamed) naming rank LAST and ``cause``."""
    if RANK == LAST:
        expect(local_cls, bad_call)
    else:
        exc = expect(hvd.FailedOnRankError, good_call)
        assert f"ranks [{LAST}]" in str(exc) and cause in str(exc), str(exc)
    unnamed_follow_ups()


def n_not_a_tensor(case):
    unnamed_one_rank(lambda: hvd.allreduce([1.0, 2.0]), lambda: hvd.allreduce(torch.ones(2)),
                     TypeError, "TypeError")


def n_sparse_allgather_async(case):
    sparse = torch.eye(3).to_sparse()
    unnamed_one_rank(lambda: hvd.allgather_async(sparse).wait(),
                     lambda: hvd.allgather_async(torch.ones(3, 3)).wait(), ValueError, "sparse")


def n_average_and_op(case):   # resolve_op raises in the synchronous allreduce, before autograd
    unnamed_one_rank(lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum),
                     lambda: hvd.allreduce(torch.ones(2)), ValueError, "ValueError")


def n_grouped_member(case):
    unnamed_one_rank(lambda: hvd.grouped_allreduce([torch.ones(2), "x"]),
                     lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(1)]),
                     TypeError, "TypeError")


def n_reducescatter_adasum(case):
    unnamed_one_rank(lambda: hvd.reducescatter(torch.ones(SIZE, 2), op=hvd.Adasum),
                     lambda: hvd.reducescatter(torch.ones(SIZE, 2), op=hvd.Sum),
                     hvd.UnsupportedOperationError, "Adasum")


CASES = {
    "error_classes": error_classes,
    "mismatch.allreduce_shape": m_allreduce_shape,
    "mismatch.allreduce_dtype": m_allreduce_dtype,
    "mismatch.allreduce_op": m_allreduce_op,
    "mismatch.allreduce_prescale": m_allreduce_prescale,
    "mismatch.allreduce_unnamed_shape": m_allreduce_unnamed,
    "mismatch.allreduce_async": m_allreduce_async,
    "mismatch.allreduce_inplace_dtype": m_allreduce_inplace,
    "mismatch.broadcast_shape": m_broadcast_shape,
    "mismatch.broadcast_root": m_broadcast_root,
    "mismatch.broadcast_dtype": m_broadcast_dtype,
    "mismatch.allgather_trailing_shape": m_allgather_trailing,
    "mismatch.allgather_ndim": m_allgather_ndim,
    "mismatch.allgather_dtype": m_allgather_dtype,
    "mismatch.kind_allreduce_vs_broadcast": m_kind,
    "mismatch.then_same_name_ok": m_then_same_name_ok,
    "mismatch.optimizer_param_shapes": m_optimizer,
    "mismatch.optimizer_error_frees_the_graph": m_error_frees_the_graph,
    "duplicate.allreduce_in_flight": dup_allreduce,
    "duplicate.across_kinds": dup_across_kinds,
    "duplicate.after_completion_ok": dup_after_completion,
    "unsupported.complex64": u_dtype,
    "unsupported.complex128": u_dtype,
    "unsupported.complex_broadcast": u_complex_broadcast,
    "unsupported.complex_allgather": u_complex_allgather,
    "unsupported.uint16": u_dtype,
    "unsupported.uint32": u_dtype,
    "unsupported.uint64": u_dtype,
    "unsupported.bool_average": u_bool_average,
    "unsupported.non_cpu_device": u_non_cpu,
    "unsupported.sparse_inplace_and_allgather": u_sparse_inplace_allgather,
    "unsupported.sparse_out_of_place": u_sparse_out_of_place,
    "args.average_and_op": a_average_and_op,
    "args.broadcast_root_out_of_range": a_root_out_of_range,
    "args.not_a_tensor": a_not_a_tensor,
    "args.predivide_with_sum": a_predivide_with_sum,
    "args.bpps_zero": a_bpps_zero,
    "optimizer.zero_grad_in_flight": o_zero_grad_in_flight,
    "optimizer.too_many_backward_passes": lambda c: too_many_passes(c, 1),
    "optimizer.too_many_backward_passes_bpps2": lambda c: too_many_passes(c, 2),
    "optimizer.duplicate_named_parameters": o_duplicate_named,
    "optimizer.named_parameters_missing_param": o_named_missing,
    "optimizer.named_parameters_not_pairs": o_named_not_pairs,
    "optimizer.sparse_grad_unsupported_op": o_sparse_unsupported_op,
    "optimizer.sparse_as_dense": o_sparse_as_dense,
    "optimizer.sync_error_waits_for_the_rest": o_sync_error_waits_for_rest,
    "horovod_class.reducescatter_adasum": h_reducescatter_adasum,
    "horovod_class.unsupported_tensor_is_value_error": h_unsupported_tensor_is_value_error,
    "horovod_class.adasum_ranks": h_adasum_ranks,
    "horovod_class.gradient_of_max": h_gradient_of_max,
    "horovod_class.poll_not_a_handle": h_poll_not_a_handle,
    "unnamed.not_a_tensor": n_not_a_tensor,
    "unnamed.sparse_allgather_async": n_sparse_allgather_async,
    "unnamed.average_and_op": n_average_and_op,
    "unnamed.grouped_member": n_grouped_member,
    "unnamed.reducescatter_adasum": n_reducescatter_adasum,
}
assert list(CASES) == C.ERROR_CASES
for case, fn in CASES.items():
    r.case(case, fn, case)
r.write()
hvd.shutdown()
