"""hvdlite.torch collectives on every rank: every op x dtype x shape, in place / out of place /
async, non-contiguous inputs, broadcast, allgather, scaling, compression and autograd.

Every rank generates every rank's input deterministically (``torch_cases.op_input``) and checks
the collective's result against its own torch reference.
"""
import time

import torch

torch.set_num_threads(1)

import hvdlite.torch as hvd  # noqa: E402
import torch_cases as C  # noqa: E402

hvd.init()
from mpi4py import MPI  # noqa: E402  (independent cross-rank checks, on COMM_WORLD)

COMM = MPI.COMM_WORLD
RANK, SIZE = hvd.rank(), hvd.size()
r = C.synced_reporter(RANK, COMM)
OP = {name: getattr(hvd, name) for name in C.OPS}
F64, I64 = torch.float64, torch.int64


# --- helpers -----------------------------------------------------------------------------------
def describe(t):
    return f"{tuple(t.shape)} {t.dtype}: {t.flatten()[:12].tolist()}"


def check_values(res, expected, dtype, exact=True, what="result"):
    """``expected`` is in the wide dtype of ``C.reduce_reference`` (int64 / float64)."""
    assert isinstance(res, torch.Tensor), f"{what} is a {type(res).__name__}"
    assert res.dtype == C.torch_dtype(dtype), f"{what} dtype {res.dtype}, expected {dtype}"
    assert tuple(res.shape) == tuple(expected.shape), \
        f"{what} shape {tuple(res.shape)}, expected {tuple(expected.shape)}"
    if dtype in C.FLOAT_DTYPES:
        got = res.to(F64)
        if exact:
            assert torch.equal(got, expected), f"{what} {describe(got)} != {describe(expected)}"
        else:
            rtol, atol = C.FLOAT_TOL[dtype]
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: (
                f"{what}: {m}\n got {describe(got)}\n expected {describe(expected)}"))
    else:
        info = torch.iinfo(C.torch_dtype(dtype)) if dtype != "bool" else None
        if info is not None and expected.numel():   # the test's inputs must not overflow
            assert info.min <= int(expected.min()) and int(expected.max()) <= info.max
        got = res.to(I64)
        assert torch.equal(got, expected), f"{what} {describe(got)} != {describe(expected)}"


def exact_for(op, dtype):
    return not (op == "Average" and dtype in C.FLOAT_DTYPES)


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_on_all_ranks(t, what="tensor"):
    gathered = COMM.allgather(bits(t))
    assert all(g == gathered[0] for g in gathered), f"{what} differs between ranks"


def assert_unchanged(t, original, what="input"):
    assert torch.equal(bits_tensor(t), bits_tensor(original)), f"{what} was modified"


def bits_tensor(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def rank_gen(case, rank, extra=0):
    return torch.Generator().manual_seed(C.seed_of(case, rank, extra))


def randn(case, rank, shape, dtype=F64, extra=0):
    return torch.randn(shape, generator=rank_gen(case, rank, extra), dtype=F64).to(dtype)


# --- 1. allreduce: every op x dtype x shape x variant -------------------------------------------
def allreduce_setup(case):
    _, variant, op, dt, sh = case.split(".")
    inputs = [C.op_input(case, k, dt, op, C.SHAPES[sh]) for k in range(SIZE)]
    return variant, op, dt, inputs, C.reduce_reference(inputs, op, dt)


def allreduce_sync(case):
    variant, op, dt, inputs, expected = allreduce_setup(case)
    x = inputs[RANK].clone()
    if variant == "out":
        res = hvd.allreduce(x, op=OP[op], name=case)
        assert res is not x
        assert_unchanged(x, inputs[RANK])
    else:
        ptr = x.data_ptr()
        res = hvd.allreduce_(x, op=OP[op], name=case)
        assert res is x, "allreduce_ did not return its input tensor"
        assert x.data_ptr() == ptr
    check_values(res, expected, dt, exact_for(op, dt))


def allreduce_async_submit(case):
    variant, op, dt, inputs, expected = allreduce_setup(case)
    x = inputs[RANK].clone()
    fn = hvd.allreduce_async if variant == "async" else hvd.allreduce_async_
    return x, fn(x, op=OP[op], name=case), (variant, op, dt, inputs, expected)


def allreduce_async_check(x, handle, info):
    variant, op, dt, inputs, expected = info
    res = hvd.synchronize(handle)
    assert hvd.poll(handle) is True
    if variant == "async":
        assert res is not x
        assert_unchanged(x, inputs[RANK])
    else:
        assert res is x, "synchronize(allreduce_async_) did not return the input tensor"
    check_values(res, expected, dt, exact_for(op, dt))


def run_with_async_batch(cases, is_async, sync_fn, submit_fn, check_fn):
    """Run synchronous cases one by one, then submit every async case before waiting for any."""
    for case in cases:
        if not is_async(case):
            r.case(case, sync_fn, case)
    pending = {}
    for case in cases:
        if is_async(case):
            try:
                pending[case] = submit_fn(case)
            except Exception as exc:  # noqa: BLE001 - reported by the case below
                pending[case] = exc
    for case in cases:
        if is_async(case):
            item = pending[case]

            def check(item=item):
                if isinstance(item, Exception):
                    raise item
                check_fn(*item)
            r.case(case, check)


run_with_async_batch(C.allreduce_cases(SIZE), lambda c: c.split(".")[1].startswith("async"),
                     allreduce_sync, allreduce_async_submit, allreduce_async_check)


# --- non-contiguous allreduce ------------------------------------------------------------------
def nc_base(case, rank, kind, dt, op):
    shape = (1, 6) if kind == "expanded" else (4, 6)
    return C.op_input(case, rank, dt, op, shape)


def nc_view(kind, base):
    if kind == "transposed":
        return base.t()
    if kind == "strided":
        return base[:, ::2]
    if kind == "expanded":
        return base.expand(3, 6)
    raise ValueError(kind)


def allreduce_nc(case):
    _, kind, variant, op, dt = case.split(".")
    bases = [nc_base(case, k, kind, dt, op) for k in range(SIZE)]
    expected = C.reduce_reference([nc_view(kind, b).contiguous() for b in bases], op, dt)
    base = bases[RANK].clone()
    view = nc_view(kind, base)
    assert not view.is_contiguous()
    if variant in ("out", "async"):
        res = (hvd.allreduce(view, op=OP[op], name=case) if variant == "out"
               else hvd.synchronize(hvd.allreduce_async(view, op=OP[op], name=case)))
        assert_unchanged(base, bases[RANK], "base of the non-contiguous input")
        check_values(res, expected, dt, exact_for(op, dt))
        return
    res = (hvd.allreduce_(view, op=OP[op], name=case) if variant == "inplace"
           else hvd.synchronize(hvd.allreduce_async_(view, op=OP[op], name=case)))
    assert res is view, "in-place op did not return the (non-contiguous) input tensor"
    check_values(view, expected, dt, exact_for(op, dt), what="input view after in-place op")
    # the original storage holds the result: look at it through a fresh view
    check_values(nc_view(kind, base), expected, dt, exact_for(op, dt), what="base storage")
    if kind == "strided":
        assert_unchanged(base[:, 1::2], bases[RANK][:, 1::2], "elements outside the view")


for case in C.allreduce_nc_cases(SIZE):
    r.case(case, allreduce_nc, case)


# --- prescale / postscale ----------------------------------------------------------------------
def allreduce_scaled(case):
    _, variant, op, dt, i = case.split(".")
    pre, post = C.SCALE_FACTORS[int(i)]
    inputs = [C.op_input(case, k, dt, "Sum", (5,), small=True) for k in range(SIZE)]
    factor = post * (1.0 / SIZE) if op == "Average" else post
    if dt in C.FLOAT_DTYPES:
        expected = sum(t.to(F64) * pre for t in inputs) * factor
    else:   # integers: each scaling in float64, truncated toward zero
        pres = [(t.to(F64) * pre).trunc().to(I64) for t in inputs]
        expected = (sum(pres).to(F64) * factor).trunc().to(I64)
    x = inputs[RANK].clone()
    kwargs = dict(op=OP[op], name=case, prescale_factor=pre, postscale_factor=post)
    if variant == "out":
        res = hvd.allreduce(x, **kwargs)
        assert_unchanged(x, inputs[RANK])
    else:
        res = hvd.allreduce_(x, **kwargs)
        assert res is x
    check_values(res, expected, dt, exact=dt not in C.FLOAT_DTYPES)


for case in C.scaled_cases(SIZE):
    r.case(case, allreduce_scaled, case)


# --- broadcast ---------------------------------------------------------------------------------
def broadcast_setup(case):
    _, variant, dt, sh, root = case.split(".")
    root = int(root[4:])
    inputs = [C.op_input(case, k, dt, "Sum", C.SHAPES[sh]) for k in range(SIZE)]
    return variant, dt, root, inputs, inputs[root].to(F64 if dt in C.FLOAT_DTYPES else I64)


def broadcast_sync(case):
    variant, dt, root, inputs, expected = broadcast_setup(case)
    x = inputs[RANK].clone()
    if variant == "out":
        res = hvd.broadcast(x, root, name=case)
        assert res is not x
        assert_unchanged(x, inputs[RANK])
    else:
        res = hvd.broadcast_(x, root, name=case)
        assert res is x
    check_values(res, expected, dt)


def broadcast_async_submit(case):
    variant, dt, root, inputs, expected = broadcast_setup(case)
    x = inputs[RANK].clone()
    fn = hvd.broadcast_async if variant == "async" else hvd.broadcast_async_
    return x, fn(x, root, name=case), (variant, dt, inputs, expected)


def broadcast_async_check(x, handle, info):
    variant, dt, inputs, expected = info
    res = hvd.synchronize(handle)
    assert hvd.poll(handle) is True
    if variant == "async":
        assert res is not x
        assert_unchanged(x, inputs[RANK])
    else:
        assert res is x
    check_values(res, expected, dt)


run_with_async_batch(C.broadcast_cases(SIZE), lambda c: c.split(".")[1].startswith("async"),
                     broadcast_sync, broadcast_async_submit, broadcast_async_check)


def broadcast_nc(case):
    _, kind, variant, dt = case.split(".")
    root = SIZE - 1
    bases = [C.op_input(case, k, dt, "Sum", (4, 6)) for k in range(SIZE)]
    wide = F64 if dt in C.FLOAT_DTYPES else I64
    expected = nc_view(kind, bases[root]).to(wide)
    base = bases[RANK].clone()
    view = nc_view(kind, base)
    assert not view.is_contiguous()
    if variant == "out":
        res = hvd.broadcast(view, root, name=case)
        assert_unchanged(base, bases[RANK], "base of the non-contiguous input")
        check_values(res, expected, dt)
        return
    res = (hvd.broadcast_(view, root, name=case) if variant == "inplace"
           else hvd.synchronize(hvd.broadcast_async_(view, root, name=case)))
    assert res is view
    check_values(nc_view(kind, base), expected, dt, what="base storage after in-place op")
    if kind == "strided":
        assert_unchanged(base[:, 1::2], bases[RANK][:, 1::2], "elements outside the view")


for case in C.broadcast_nc_cases(SIZE):
    r.case(case, broadcast_nc, case)


# --- allgather ---------------------------------------------------------------------------------
def gather_inputs(case, dt, sh):
    trailing = C.GATHER_SHAPES[sh]
    shapes = [() if trailing is None else (C.gather_rows(k, sh),) + trailing
              for k in range(SIZE)]
    inputs = [C.op_input(case, k, dt, "Sum", shapes[k]) for k in range(SIZE)]
    wide = F64 if dt in C.FLOAT_DTYPES else I64
    expected = torch.cat([t.reshape(1) if trailing is None else t for t in inputs]).to(wide)
    return inputs, expected


def allgather_case(case):
    _, variant, dt, sh = case.split(".")
    inputs, expected = gather_inputs(case, dt, sh)
    x = inputs[RANK].clone()
    res = (hvd.allgather(x, name=case) if variant == "out"
           else hvd.synchronize(hvd.allgather_async(x, name=case)))
    assert_unchanged(x, inputs[RANK])
    check_values(res, expected, dt)


def allgather_nc(case):
    _, kind, dt = case.split(".")
    bases = [C.op_input(case, k, dt, "Sum", (3, k + 1)) for k in range(SIZE)]
    wide = F64 if dt in C.FLOAT_DTYPES else I64
    expected = torch.cat([b.t() for b in bases]).to(wide)
    base = bases[RANK].clone()
    view = base.t()
    if RANK > 0:
        assert not view.is_contiguous()
    res = hvd.allgather(view, name=case)
    assert_unchanged(base, bases[RANK])
    check_values(res, expected, dt)


for case in C.allgather_cases(SIZE):
    r.case(case, allgather_nc if case.startswith("allgather_nc") else allgather_case, case)


# --- miscellaneous -------------------------------------------------------------------------------
def allreduce_randn(case):
    _, op, dt = case.split(".")
    shape = (6, 5)
    if op == "Product":
        inputs = [(1.0 + 0.3 * randn(case, k, shape)).to(C.torch_dtype(dt)) for k in range(SIZE)]
    else:
        inputs = [randn(case, k, shape, C.torch_dtype(dt)) for k in range(SIZE)]
    expected = C.reduce_reference(inputs, op, dt)
    res = hvd.allreduce(inputs[RANK].clone(), op=OP[op], name=case)
    assert res.dtype == inputs[RANK].dtype and res.shape == inputs[RANK].shape
    got = res.to(F64)
    if op in ("Min", "Max"):
        assert torch.equal(got, expected)
        return
    eps = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-14}[dt]
    if op == "Product":
        bound = 3 * eps * expected.abs()
    else:
        bound = eps * sum(t.to(F64).abs() for t in inputs) / (SIZE if op == "Average" else 1)
    err = (got - expected).abs()
    assert bool((err <= bound + 1e-300).all()), \
        f"max error {float((err - bound).max()):.3g} over the bound; got {describe(got)}"


def allreduce_int_trunc(case):
    dt = case.split(".")[1]
    vals0 = [5, 7, 1, 0, 2] if dt == "uint8" else [-5, 5, -7, 7, -1, 1, 0, -8]
    x = torch.tensor(vals0 if RANK == 0 else [0] * len(vals0), dtype=C.torch_dtype(dt))
    res = hvd.allreduce(x, op=hvd.Average, name=case)
    expected = [int(v / SIZE) for v in vals0]        # Python int(): truncation toward zero
    assert res.dtype == x.dtype
    assert res.tolist() == expected, f"{res.tolist()} != {expected} (size {SIZE})"


def allreduce_compressed(case):
    _, comp, dt, op = case.split(".")
    compression = getattr(hvd.Compression, comp)
    inputs = [randn(case, k, (4, 5), C.torch_dtype(dt)) for k in range(SIZE)]
    if dt == "int32":
        inputs = [C.op_input(case, k, dt, "Sum", (4, 5)) for k in range(SIZE)]
    x = inputs[RANK].clone()
    res = hvd.allreduce(x, op=OP[op], name=case, compression=compression)
    assert_unchanged(x, inputs[RANK])
    assert res.dtype == x.dtype, f"decompressed dtype {res.dtype} != {x.dtype}"
    assert res.shape == x.shape
    if dt == "int32":   # compression leaves integers alone
        assert torch.equal(res.to(I64), C.reduce_reference(inputs, op, dt))
        return
    wire = torch.float16 if comp == "fp16" else torch.bfloat16
    assert torch.equal(res, res.to(wire).to(res.dtype)), "result did not travel as " + comp
    expected = C.reduce_reference(inputs, op, dt)
    eps = 2e-3 if comp == "fp16" else 1.6e-2
    bound = eps * sum(t.to(F64).abs() for t in inputs) / (SIZE if op == "Average" else 1)
    err = (res.to(F64) - expected).abs()
    assert bool((err <= bound).all()), f"max excess error {float((err - bound).max()):.3g}"


def empty3d_every_op_and_dtype():
    failures = []
    for op, dt in C._op_dtype_pairs():
        name = f"empty3d.{op}.{dt}"
        x = C.op_input(name, RANK, dt, op, C.EMPTY_3D)
        try:
            expected = C.reduce_reference([x] * SIZE, op, dt)
            check_values(hvd.allreduce(x, op=OP[op], name=name), expected, dt)
            y = x.clone()
            assert hvd.allreduce_(y, op=OP[op], name=name + ".inplace") is y
            assert y.shape == C.EMPTY_3D and y.dtype == x.dtype
        except Exception as exc:  # noqa: BLE001 - collect all, report once
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


def scaled_in_float32(case):
    """Documented: Average = Sum * (1/size), and 16-bit floats are scaled in float32.  The sum of
    these inputs is exact, so the result must be exactly fp16/bf16(float32(S) * float32(f))."""
    _, dt, variant = case.split(".", 2)
    tdt = C.torch_dtype(dt)
    op, _, post = variant.replace("inplace_", "").partition("_post")
    post = float(post) if post else 1.0
    factor = post * (1.0 / SIZE) if op == "Average" else post
    inputs = [C.op_input(case, k, dt, "Sum", (64,)) for k in range(SIZE)]
    total = sum(t.to(F64) for t in inputs)
    assert torch.equal(total.to(tdt).to(F64), total), "test set-up: sum not exact in " + dt
    expected = (total.to(torch.float32) * torch.tensor(factor, dtype=torch.float32)).to(tdt)
    x = inputs[RANK].clone()
    kwargs = dict(op=OP[op], name=case, postscale_factor=post)
    res = hvd.allreduce_(x, **kwargs) if variant.startswith("inplace") else \
        hvd.allreduce(x, **kwargs)
    assert res.dtype == tdt
    # the check can tell float32 scaling from 16-bit scaling (when the factor is not exact)
    in_16bit = total.to(tdt) * torch.tensor(factor, dtype=tdt)
    if factor not in (0.5, 1.0, 0.25) and torch.equal(in_16bit, expected):
        raise AssertionError("test set-up: inputs do not discriminate float32 scaling")
    assert torch.equal(res, expected), (
        f"not scaled in float32: {(res.to(F64) - expected.to(F64)).abs().max().item():.3g} "
        f"max difference; got {describe(res)}, expected {describe(expected)}")


def default_op_is_average():
    inputs = [randn("default_op", k, (5,), torch.float32) for k in range(SIZE)]
    res = hvd.allreduce(inputs[RANK].clone(), name="default_op")
    torch.testing.assert_close(res.to(F64), sum(t.to(F64) for t in inputs) / SIZE,
                               rtol=1e-6, atol=1e-6)


def average_flag(flag):
    inputs = [C.op_input("average_flag", k, "int32", "Sum", (6,)) for k in range(SIZE)]
    res = hvd.allreduce(inputs[RANK].clone(), average=flag, name=f"average_flag.{flag}")
    expected = C.reduce_reference(inputs, "Average" if flag else "Sum", "int32")
    assert torch.equal(res.to(I64), expected), f"{res.tolist()} != {expected.tolist()}"


def op_as_int():
    inputs = [C.op_input("op_as_int", k, "int64", "Sum", (6,)) for k in range(SIZE)]
    res = hvd.allreduce(inputs[RANK].clone(), op=int(hvd.Max), name="op_as_int")
    assert torch.equal(res, torch.stack(inputs).amax(0))


def async_poll_until_done():
    inputs = [C.op_input("poll", k, "float32", "Sum", (100,)) for k in range(SIZE)]
    h = hvd.allreduce_async(inputs[RANK].clone(), op=hvd.Sum, name="poll_until_done")
    deadline = time.monotonic() + 60
    while True:
        done = hvd.poll(h)
        assert isinstance(done, bool)
        if done:
            break
        assert time.monotonic() < deadline, "poll() never became True"
        time.sleep(0.001)
    assert torch.equal(hvd.synchronize(h).to(F64), C.reduce_reference(inputs, "Sum", "float32"))


def async_many_mixed_kinds():
    jobs = []
    for i in range(30):
        name = f"mixed.ar.{i}"
        inputs = [C.op_input(name, k, "float32", "Sum", (i + 1,)) for k in range(SIZE)]
        jobs.append((hvd.allreduce_async(inputs[RANK].clone(), op=hvd.Sum, name=name),
                     C.reduce_reference(inputs, "Sum", "float32")))
    for i in range(10):
        name = f"mixed.bc.{i}"
        inputs = [C.op_input(name, k, "int32", "Sum", (3, i + 1)) for k in range(SIZE)]
        jobs.append((hvd.broadcast_async(inputs[RANK].clone(), i % SIZE, name=name),
                     inputs[i % SIZE].to(I64)))
    for i in range(10):
        name = f"mixed.ag.{i}"
        inputs = [C.op_input(name, k, "int16", "Sum", (k + i % 2, 2)) for k in range(SIZE)]
        jobs.append((hvd.allgather_async(inputs[RANK].clone(), name=name),
                     torch.cat(inputs).to(I64)))
    for handle, expected in reversed(jobs):
        got = hvd.synchronize(handle)
        got = got.to(F64) if got.is_floating_point() else got.to(I64)
        assert torch.equal(got, expected), f"{handle}: {describe(got)} != {describe(expected)}"


def barrier_blocks():
    COMM.Barrier()     # line the ranks up first (independently of hvdlite)
    if RANK == 0:
        time.sleep(0.5)
    start = time.monotonic()
    assert hvd.barrier() is None
    waited = time.monotonic() - start
    if RANK != 0:
        assert waited >= 0.3, f"barrier returned after {waited:.3f} s though rank 0 slept 0.5 s"


def requires_grad_input():
    inputs = [randn("rg", k, (3,), torch.float32) for k in range(SIZE)]
    x = inputs[RANK].clone().requires_grad_()
    res = hvd.allreduce(x, op=hvd.Sum, name="requires_grad_input")
    assert res.requires_grad
    torch.testing.assert_close(res.detach().to(F64), sum(t.to(F64) for t in inputs),
                               rtol=1e-6, atol=1e-6)


def fast_path_taken():
    """Named allreduces of plain contiguous CPU tensors skip the adapter's general path (and
    the core's make_entry) once their dtype/op pair is known: with both disabled, every such
    dtype still reduces correctly in place, out of place (a new tensor, the input untouched)
    and async, with scale factors.  Tensors that need the general path (autograd, bfloat16,
    non-contiguous, a Parameter) are then shown to still get there."""
    from hvdlite.common.api import grouped as core_grouped
    from hvdlite.common.api import submission as core_submission
    from hvdlite.torch import async_ops
    fast = [dt for dt in C.DTYPES if dt != "bfloat16"]
    pairs = [(op, dt) for op in ("Sum", "Max", "Average") for dt in fast
             if not (dt == "bool" and op == "Average")]
    for op, dt in pairs:   # warm: the general path registers each pair with the core
        hvd.allreduce(C.op_input("fast.warm", RANK, dt, op, (3,)), op=OP[op],
                      name=f"fast.warm.{op}.{dt}")
    originals = (async_ops._submit, core_submission.make_entry)

    def general_path(*args, **kwargs):
        raise AssertionError("the general path ran: the fast path was not taken")

    async_ops._submit = core_submission.make_entry = core_grouped.make_entry = general_path
    try:
        for op in ("Sum", "Max", "Average"):   # grouped: every dtype of the op in one group
            dts = [dt for o, dt in pairs if o == op]
            case = f"fast.group.{op}"
            inputs = {dt: [C.op_input(f"{case}.{dt}", k, dt, op, (2, 3)) for k in range(SIZE)]
                      for dt in dts}
            mine = [inputs[dt][RANK].clone() for dt in dts]
            outs = hvd.synchronize(hvd.grouped_allreduce_async(mine, op=OP[op], name=case))
            work = [t.clone() for t in mine]
            done = hvd.grouped_allreduce_(work, op=OP[op], name=case + "_")
            for dt, x, out, w, d in zip(dts, mine, outs, work, done):
                expected = C.reduce_reference(inputs[dt], op, dt)
                assert out.dtype == x.dtype and out.shape == x.shape, (dt, out.dtype, out.shape)
                check_values(out, expected, dt, exact_for(op, dt), f"grouped {dt}")
                assert_unchanged(x, inputs[dt][RANK])
                assert d is w, "grouped_allreduce_ must return its inputs"
                check_values(w, expected, dt, exact_for(op, dt), f"grouped in place {dt}")
        for op, dt in pairs:
            case = f"fast.{op}.{dt}"
            inputs = [C.op_input(case, k, dt, op, (2, 5)) for k in range(SIZE)]
            expected = C.reduce_reference(inputs, op, dt)
            x = inputs[RANK].clone()
            res = hvd.allreduce(x, op=OP[op], name=case + ".out")
            assert res is not x and res.data_ptr() != x.data_ptr()
            assert_unchanged(x, inputs[RANK])
            check_values(res, expected, dt, exact_for(op, dt), "out of place")
            res.zero_()   # the result owns its memory: the input stays as it was
            assert_unchanged(x, inputs[RANK])
            handle = hvd.allreduce_async(x, op=OP[op], name=case + ".async")
            check_values(hvd.synchronize(handle), expected, dt, exact_for(op, dt), "async")
            assert hvd.allreduce_(x, op=OP[op], name=case + ".inplace") is x
            check_values(x, expected, dt, exact_for(op, dt), "in place")
        inputs = [C.op_input("fast.scaled", k, "float32", "Sum", (4,)) for k in range(SIZE)]
        res = hvd.allreduce(inputs[RANK], op=hvd.Sum, name="fast.scaled", prescale_factor=0.5,
                            postscale_factor=3.0)
        check_values(res, C.reduce_reference(inputs, "Sum", "float32") * 1.5, "float32",
                     exact=False, what="scaled")
    finally:
        async_ops._submit, core_submission.make_entry = originals
        core_grouped.make_entry = originals[1]
    taken = []
    async_ops._submit = lambda *a, **k: (taken.append(a[0]), originals[0](*a, **k))[1]
    try:
        inputs = [C.op_input("fast.not", k, "float32", "Sum", (3, 4)) for k in range(SIZE)]
        expected = C.reduce_reference(inputs, "Sum", "float32")
        others = {"requires_grad": inputs[RANK].clone().requires_grad_(),
                  "bfloat16": inputs[RANK].to(torch.bfloat16),
                  "non-contiguous": inputs[RANK].t(),
                  "parameter": torch.nn.Parameter(inputs[RANK].clone(), requires_grad=False)}
        for label, t in others.items():
            res = hvd.allreduce(t, op=hvd.Sum, name=f"fast.not.{label}")
            want = expected.t() if label == "non-contiguous" else expected
            torch.testing.assert_close(res.detach().to(F64), want, msg=lambda m: f"{label}: {m}")
    finally:
        async_ops._submit = originals[0]
    assert len(taken) == len(others), f"general path ran {len(taken)} times, not {len(others)}"


def results_identical_across_ranks():
    x = randn("ident", RANK, (1000,), torch.float32)
    for op in ("Average", "Sum", "Product"):
        same_on_all_ranks(hvd.allreduce(x, op=OP[op], name=f"ident.{op}"), op)
    same_on_all_ranks(hvd.allreduce(x.half(), name="ident.half"), "float16 average")
    same_on_all_ranks(hvd.allreduce(x.bfloat16(), name="ident.bf16"), "bfloat16 average")


for case in C.MISC_OPS_CASES:
    if case.startswith("allreduce_randn."):
        r.case(case, allreduce_randn, case)
    elif case.startswith("allreduce_int_trunc."):
        r.case(case, allreduce_int_trunc, case)
    elif case.startswith("allreduce_compressed."):
        r.case(case, allreduce_compressed, case)
    elif case.startswith("allreduce_16bit_scaled_in_float32."):
        r.case(case, scaled_in_float32, case)
MISC = {
    "allreduce_empty3d_every_op_and_dtype": empty3d_every_op_and_dtype,
    "allreduce_default_op_is_average": default_op_is_average,
    "allreduce_average_flag_true": lambda: average_flag(True),
    "allreduce_average_flag_false": lambda: average_flag(False),
    "allreduce_op_as_int": op_as_int,
    "async_poll_until_done": async_poll_until_done,
    "async_many_mixed_kinds": async_many_mixed_kinds,
    "barrier_blocks": barrier_blocks,
    "allreduce_requires_grad_input_out_of_place": requires_grad_input,
    "results_identical_across_ranks": results_identical_across_ranks,
    "allreduce_fast_path_taken": fast_path_taken,
}
for case, fn in MISC.items():
    r.case(case, fn)


# --- 2. autograd -------------------------------------------------------------------------------
def close(a, b, what, tol=1e-6):
    assert a is not None, f"{what} is None"
    assert a.shape == b.shape, f"{what} shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a.to(F64), b.to(F64), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


def grad_allreduce(case):
    _, _, op, dt = case.split(".")
    tdt = C.torch_dtype(dt)
    xs = [randn(case, k, (3, 4), tdt) for k in range(SIZE)]
    ws = [randn(case, k, (3, 4), tdt, extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    y = hvd.allreduce(x, op=OP[op], name=case)
    red = (lambda ts: sum(t.to(F64) for t in ts) / SIZE) if op == "Average" \
        else (lambda ts: sum(t.to(F64) for t in ts))
    close(y.detach(), red(xs), "forward")
    (y * ws[RANK]).sum().backward()
    assert x.grad.dtype == tdt
    # d/dx_r of sum_k <w_k, y_k> with y_k = red(x): Average -> mean_k w_k, Sum -> sum_k w_k
    close(x.grad, red(ws), "x.grad")


def grad_allreduce_scaled(case):
    op = case.split(".")[-1]
    pre, post = 2.0, 0.25
    xs = [randn(case, k, (5,)) for k in range(SIZE)]
    ws = [randn(case, k, (5,), extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    y = hvd.allreduce(x, op=OP[op], name=case, prescale_factor=pre, postscale_factor=post)
    div = SIZE if op == "Average" else 1
    close(y.detach(), sum(xs) * pre * post / div, "forward", 1e-12)
    (y * ws[RANK]).sum().backward()
    close(x.grad, sum(ws) * pre * post / div, "x.grad", 1e-12)


def grad_allreduce_default_op(case):
    xs = [randn(case, k, (4,)) for k in range(SIZE)]
    ws = [randn(case, k, (4,), extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    (hvd.allreduce(x, name=case) * ws[RANK]).sum().backward()
    close(x.grad, sum(ws) / SIZE, "x.grad", 1e-12)


def grad_allreduce_nonlinear(case):
    xs = [randn(case, k, (4,)) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    y = hvd.allreduce(x, name=case)
    (y ** 2).sum().backward()
    # total loss n * sum(mean_k x_k)^2 -> d/dx_r = 2 * mean_k x_k
    close(x.grad, 2 * sum(xs) / SIZE, "x.grad", 1e-12)


def grad_allreduce_compressed(case):
    xs = [randn(case, k, (4, 3), torch.float32) for k in range(SIZE)]
    ws = [randn(case, k, (4, 3), torch.float32, extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    y = hvd.allreduce(x, name=case, compression=hvd.Compression.fp16)
    assert y.dtype == torch.float32
    (y * ws[RANK]).sum().backward()
    assert x.grad.dtype == torch.float32
    close(x.grad, sum(w.to(F64) for w in ws) / SIZE, "x.grad", 5e-3)


def grad_min_raises(case):
    x = randn(case, RANK, (3,)).requires_grad_()
    y = hvd.allreduce(x, op=hvd.Min, name=case)
    try:
        y.sum().backward()
    except RuntimeError as exc:
        assert "Min" in str(exc) or "gradient" in str(exc), exc
    else:
        raise AssertionError("backward through allreduce(op=Min) did not raise")
    follow_up(case)


def follow_up(case):
    res = hvd.allreduce(torch.tensor([float(RANK), 1.0]), op=hvd.Sum, name=case + ".followup")
    assert res.tolist() == [float(sum(range(SIZE))), float(SIZE)], res


def grad_allgather(case, rows_of, trailing, dt=torch.float64, scalar=False):
    shapes = [() if scalar else (rows_of(k),) + trailing for k in range(SIZE)]
    xs = [randn(case, k, shapes[k], dt) for k in range(SIZE)]
    total = SIZE if scalar else sum(rows_of(k) for k in range(SIZE))
    ws = [randn(case, k, (total,) + (() if scalar else trailing), dt, extra=1)
          for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    y = hvd.allgather(x, name=case)
    close(y.detach(), torch.cat([t.reshape(1) if scalar else t for t in xs]), "forward")
    (y * ws[RANK]).sum().backward()
    offset = RANK if scalar else sum(rows_of(k) for k in range(RANK))
    rows = 1 if scalar else rows_of(RANK)
    # Horovod's gradient: the ranks' upstream gradients averaged (allreduce Average), then
    # this rank's rows (not the sum, which is SIZE times larger)
    expected = (sum(w.to(F64) for w in ws) / SIZE)[offset:offset + rows]
    if scalar:
        expected = expected.reshape(())
    assert x.grad is not None and x.grad.dtype == dt
    close(x.grad, expected, "x.grad", 1e-5)


def grad_broadcast(case):
    root = int(case.split("root")[-1])
    xs = [randn(case, k, (3,)) for k in range(SIZE)]
    ws = [randn(case, k, (3,), extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    y = hvd.broadcast(x, root, name=case)
    assert torch.equal(y.detach(), xs[root])
    (y * ws[RANK]).sum().backward()
    # Horovod's gradient: the average of every rank's upstream gradient at the root (root_rank
    # is a global rank), zeros elsewhere
    expected = sum(ws) / SIZE if RANK == root else torch.zeros(3, dtype=F64)
    close(x.grad, expected, "x.grad", 1e-12)
    if RANK != root:
        assert torch.equal(x.grad, torch.zeros(3, dtype=F64))


def grad_broadcast_graph(case):
    xs = [randn(case, k, (4,)) for k in range(SIZE)]
    ws = [randn(case, k, (4,), extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    y = hvd.broadcast(x * 2.0, 0, name=case)        # y = 2 x_0 on every rank
    (y ** 2 * ws[RANK]).sum().backward()
    # upstream on rank k: 2 y w_k = 4 x_0 w_k; Horovod averages it over the ranks at the root,
    # then the chain rule's factor 2: 8 x_0 * mean_k w_k; other ranks' x get zeros
    expected = 8 * xs[0] * sum(ws) / SIZE if RANK == 0 else torch.zeros(4, dtype=F64)
    close(x.grad, expected, "x.grad", 1e-10)


GRADS = {
    "grad.allreduce.scaled.Sum": grad_allreduce_scaled,
    "grad.allreduce.scaled.Average": grad_allreduce_scaled,
    "grad.allreduce.default_op": grad_allreduce_default_op,
    "grad.allreduce.nonlinear": grad_allreduce_nonlinear,
    "grad.allreduce.compressed_fp16": grad_allreduce_compressed,
    "grad.allreduce.min_backward_raises": grad_min_raises,
    "grad.allgather.uneven.float32": lambda c: grad_allgather(c, lambda k: k + 1, (2,),
                                                              torch.float32),
    "grad.allgather.uneven.float64": lambda c: grad_allgather(c, lambda k: k + 1, (2,)),
    "grad.allgather.zerorows": lambda c: grad_allgather(
        c, lambda k: C.gather_rows(k, "zerorows"), (3,)),
    "grad.allgather.scalar": lambda c: grad_allgather(c, None, (), scalar=True),
    "grad.allgather.3d": lambda c: grad_allgather(c, lambda k: 2 * k + 1, (2, 3)),
    "grad.broadcast.inside_graph": grad_broadcast_graph,
}
for case in C.grad_cases(SIZE):
    if case in GRADS:
        r.case(case, GRADS[case], case)
    elif case.startswith("grad.allreduce."):
        r.case(case, grad_allreduce, case)
    elif case.startswith("grad.broadcast.root"):
        r.case(case, grad_broadcast, case)
    else:
        r.case(case, lambda: (_ for _ in ()).throw(AssertionError("no implementation")))

r.write()
hvd.shutdown()
