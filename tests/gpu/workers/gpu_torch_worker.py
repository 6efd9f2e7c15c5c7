"""CUDA tensors through hvdlite.torch on every rank of a real MPI job: the GPU test set.

Run as ``gpu_torch_worker.py MODE BACKEND`` under mpiexec, with ``HVDLITE_GPU_OPERATIONS`` set to
match BACKEND (tests/gpu/test_gpu_torch.py does both):

  MODE collectives  allreduce (every op x dtype, in place / out of place / async, pre- and
                    postscale), allgather (uneven first dimensions), broadcast (every root),
                    alltoall, reducescatter, many small async allreduces waited together (fusion),
                    stream ordering (kernels still running on torch's stream or on a side stream
                    when the op is submitted; results used right after synchronize()), autograd,
                    and with 2+ ranks CPU-vs-CUDA mismatches and join
  MODE train        DistributedOptimizer on small CUDA models: parameters bitwise identical on
                    every rank and close to a single-process run on the concatenated batch
  BACKEND nccl      HVDLITE_GPU_OPERATIONS=nccl, one GPU per rank (1 rank on a 1-GPU machine);
                    an int16 allreduce must fail with GpuUnavailableError and advice
  BACKEND staged    HVDLITE_GPU_OPERATIONS=mpi: host staging; ranks may share one GPU

Each rank works on ``cuda:<local_rank % device_count>``.  Every rank builds every rank's input on
the CPU from a deterministic seed, moves its own to the GPU, and checks the result (which must be
on that same GPU) against a torch reference computed on the CPU: exact for integers and for data
movement.  Within a case the collectives run on every rank before anything is asserted, the ranks
line up after every case (``torch_cases.synced_reporter``) and jobs run with a stall timeout, so a
case that fails on one rank never leaves the others waiting.  Cases that could take the engine
down (zero-size tensors) run last, so they cannot hide the results of the others.

Importable without torch, MPI or a GPU: the case lists (:func:`cases`) parametrize the tests.

Debugging aid: ``HVDLITE_GPU_WORKER_DEVICE=cpu`` runs the cases on CPU tensors, which checks the
worker's own references on a machine without a GPU (the cases that look at the GPU path itself,
``device.*``, ``fused.path_taken``, ``int16.*`` and ``mismatch.*``, then fail by design).
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[3]
if __package__ in (None, ""):     # run as a script by mpiexec
    sys.path.insert(0, str(_REPO))

from tests.torch.workers import torch_cases as C

MODES = ("collectives", "train")
BACKENDS = ("nccl", "staged")
GPU_OPERATIONS = {"nccl": "nccl", "staged": "mpi"}      # BACKEND -> HVDLITE_GPU_OPERATIONS

OPS = list(C.OPS)                  # Average, Sum, Min, Max, Product
DTYPES = list(C.DTYPES)            # bool, uint8, int8, int16, int32, int64, 16/32/64-bit floats
FLOAT_DTYPES = list(C.FLOAT_DTYPES)
NCCL_UNREDUCIBLE = ("int16",)      # NCCL has no 16-bit integer type
VARIANTS = ("out", "inplace", "async", "async_inplace")
GATHER_SHAPES = ("scalar", "vec", "mat", "cube", "zerorows")   # keys of C.GATHER_SHAPES
SHAPE = (3, 5)
FUSED_N = 40                       # small async allreduces submitted before any is waited for
FUSED_DTYPES = ("uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")


# --- case lists (pure Python) ------------------------------------------------------------------
def reduce_dtypes(backend: str) -> list[str]:
    return [dt for dt in DTYPES if not (backend == "nccl" and dt in NCCL_UNREDUCIBLE)]


def op_dtype_pairs(dtypes) -> list[tuple[str, str]]:
    return [(op, dt) for op in OPS for dt in dtypes if not (dt == "bool" and op == "Average")]


def allreduce_cases(backend: str, size: int) -> list[str]:
    dts = reduce_dtypes(backend)
    return ([f"allreduce.{v}.{op}.{dt}" for v in VARIANTS for op, dt in op_dtype_pairs(dts)]
            + [f"allreduce_scalar.Sum.{dt}" for dt in dts]
            + [f"allreduce_scaled.{v}.{op}.{dt}.{i}" for v in ("out", "inplace")
               for op in ("Sum", "Average") for dt in dts if dt != "bool"
               for i in range(len(C.SCALE_FACTORS))]
            + ["allreduce_misc.large.float32", "allreduce_misc.large.bfloat16",
               "allreduce_misc.noncontig.float32", "allreduce_misc.noncontig_inplace.float64",
               "allreduce_misc.default_op_is_average.float32",
               "allreduce_misc.repeated_name.float32"])


def int16_cases(backend: str, size: int) -> list[str]:
    if backend != "nccl":
        return []   # host staging reduces int16 like any dtype (in the allreduce lists)
    return ([f"int16.allreduce.{op}" for op in OPS]
            + ["int16.allreduce_inplace", "int16.allreduce_async", "int16.allreduce_scaled",
               "int16.grouped_allreduce", "int16.other_ops_work"])


def allgather_cases(backend: str, size: int) -> list[str]:
    return ([f"allgather.{v}.{dt}.{sh}" for v in ("out", "async") for dt in DTYPES
             for sh in GATHER_SHAPES]
            + ["allgather_misc.even_rows.float32", "allgather_misc.even_rows.int64",
               "allgather_misc.noncontig.float32"])


def broadcast_cases(backend: str, size: int) -> list[str]:
    return ([f"broadcast.{v}.{dt}.root{root}" for v in VARIANTS for dt in DTYPES
             for root in range(size)]
            + ["broadcast_misc.noncontig_inplace.float32", "broadcast_misc.large.float32"])


def fused_cases(backend: str, size: int) -> list[str]:
    return ([f"fused.async.{op}.{dt}" for op, dt in op_dtype_pairs(FUSED_DTYPES + ("bool",))]
            + [f"fused.grouped.Sum.{dt}" for dt in reduce_dtypes(backend)]
            + ["fused.grouped_inplace.Average.float32", "fused.scaled.Average.float32",
               "fused.scaled.Sum.int32", "fused.scaled.Average.bfloat16", "fused.mixed_dtypes",
               "fused.large_and_small.float32", "fused.path_taken"])


def alltoall_cases(backend: str, size: int) -> list[str]:
    return ([f"alltoall.{layout}.{dt}" for layout in ("even", "uneven") for dt in DTYPES]
            + ["alltoall.async.float32"])


def reducescatter_cases(backend: str, size: int) -> list[str]:
    # through host staging under both backends (NCCL has no uneven reducescatter), so int16 too
    return ([f"reducescatter.{op}.{dt}" for op, dt in op_dtype_pairs(DTYPES)]
            + [f"reducescatter_scaled.{op}.{dt}" for op in ("Sum", "Average")
               for dt in ("int32", "float32", "bfloat16")])


ORDER_CASES = ["order.matmul_then_allreduce_out", "order.matmul_then_allreduce_inplace_prescaled",
               "order.side_stream_then_allreduce", "order.consume_right_after_synchronize",
               "order.wait_in_reverse_and_consume", "order.chained_allreduces",
               "order.kernel_then_broadcast_inplace", "order.kernel_then_broadcast_out",
               "order.kernel_then_allgather", "order.interleaved_kernels_and_async",
               "order.input_overwritten_after_wait", "order.grouped_after_kernels",
               "order.synchronize_and_the_device"]
GRAD_CASES = ["grad.allreduce.Sum", "grad.allreduce.Average", "grad.allgather", "grad.broadcast",
              "grad.reducescatter.Sum", "grad.reducescatter.Average", "grad.grouped_allgather",
              "grad.grouped_reducescatter.Sum"]
DEVICE_CASES = ["device.backend_in_use", "device.build_flags", "device.outputs_on_device"]
MISMATCH_CASES = ["mismatch.cpu_vs_cuda.allreduce", "mismatch.cpu_vs_cuda.allreduce_inplace",
                  "mismatch.cpu_vs_cuda.allgather", "mismatch.cpu_vs_cuda.broadcast",
                  "mismatch.cuda_vs_cpu.allreduce", "mismatch.then_same_name_on_cuda"]
JOIN_CASES = ["join.cuda_allreduce_while_joined"]
EDGE_CASES = ([f"edge.allreduce_empty.{dt}" for dt in ("bool", "uint8", "int32", "float16",
                                                        "bfloat16", "float32", "float64")]
              + ["edge.allreduce_empty_inplace.float32", "edge.allreduce_empty_3d.int64",
                 "edge.broadcast_empty.float32", "edge.allgather_zero_width.float32",
                 "edge.allgather_no_rows_anywhere.float32", "edge.alltoall_nothing_sent.float32",
                 "edge.reducescatter_zero_rows.float32"])

TRAIN_CASES = ["train.sgd_momentum.float32", "train.sgd_momentum.float64", "train.adam.float32",
               "train.num_groups2.float32", "train.groups_list.float32",
               "train.fp16_compression.float32", "train.bpps2.float32",
               "train.sync_clip_step.float32", "train.broadcast_state_then_train.float32",
               "train.convnet.float32"]


def collectives_cases(backend: str, size: int) -> list[str]:
    out = (allreduce_cases(backend, size) + int16_cases(backend, size)
           + allgather_cases(backend, size) + broadcast_cases(backend, size)
           + fused_cases(backend, size) + alltoall_cases(backend, size)
           + reducescatter_cases(backend, size) + ORDER_CASES + GRAD_CASES + DEVICE_CASES)
    if size >= 2:
        out += MISMATCH_CASES + JOIN_CASES
    return out + EDGE_CASES


def cases(mode: str, backend: str, size: int) -> list[str]:
    """Every case name the worker reports in ``mode`` with ``backend`` at ``size`` ranks."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    if mode == "collectives":
        return collectives_cases(backend, size)
    if mode == "train":
        return list(TRAIN_CASES)
    raise ValueError(f"unknown mode {mode!r}")


# =================================================================================================
# Everything below runs under MPI only (torch and hvdlite are imported by _setup()).
# =================================================================================================
def _setup(backend: str) -> None:
    global torch, nn, F, hvd, COMM, RANK, SIZE, DEV, ON_GPU, r, OP, F64, I64, BACKEND, MM_N
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    torch.set_num_threads(1)
    import hvdlite.torch as hvd
    from mpi4py import MPI

    BACKEND = backend
    want = GPU_OPERATIONS[backend]
    got = (os.environ.get("HVDLITE_GPU_OPERATIONS") or os.environ.get("HOROVOD_GPU_OPERATIONS")
           or "nccl").strip().lower()
    if got != want:
        raise SystemExit(f"gpu_torch_worker: backend {backend!r} needs "
                         f"HVDLITE_GPU_OPERATIONS={want}, but it is {got!r}")
    hvd.init()
    COMM = MPI.COMM_WORLD
    RANK, SIZE = hvd.rank(), hvd.size()
    if os.environ.get("HVDLITE_GPU_WORKER_DEVICE", "cuda").strip().lower() == "cpu":
        DEV = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_torch_worker: no CUDA device here (set "
                             "HVDLITE_GPU_WORKER_DEVICE=cpu for a dry run on CPU tensors)")
        # Horovod's layout: one GPU per local rank (ranks share it when there are fewer GPUs).
        DEV = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(DEV)
        # exact float32 arithmetic for the references (no TF32), deterministic cuDNN
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    ON_GPU = DEV.type == "cuda"
    MM_N = 4096 if ON_GPU else 128
    r = C.synced_reporter(RANK, COMM)
    OP = {name: getattr(hvd, name) for name in OPS}
    F64, I64 = torch.float64, torch.int64


# --- helpers -------------------------------------------------------------------------------------
def tdt(name):
    return getattr(torch, name)


def gpu(t):
    """A copy of CPU tensor ``t`` on this rank's device."""
    return t.to(DEV, copy=True)


def describe(t):
    t = t.detach().cpu()
    return f"{tuple(t.shape)} {t.dtype}: {t.flatten()[:12].tolist()}"


def assert_on_device(res, what="result"):
    assert isinstance(res, torch.Tensor), f"{what} is a {type(res).__name__}, not a tensor"
    assert res.device == DEV, f"{what} is on {res.device}, expected {DEV}"


def exact_for(op, dt):
    return not (op == "Average" and dt in FLOAT_DTYPES)


def check_values(res, expected, dt, exact=True, what="result"):
    """``res`` must be on this rank's device; ``expected`` is a CPU tensor in the wide dtype of
    ``C.reduce_reference`` (int64 for integers and bool, float64 for floats)."""
    assert_on_device(res, what)
    assert res.dtype == tdt(dt), f"{what} dtype {res.dtype}, expected {dt}"
    assert tuple(res.shape) == tuple(expected.shape), \
        f"{what} shape {tuple(res.shape)}, expected {tuple(expected.shape)}"
    got = res.detach().cpu()
    if dt in FLOAT_DTYPES:
        got = got.to(F64)
        if exact:
            assert torch.equal(got, expected), f"{what} {describe(got)} != {describe(expected)}"
        else:
            rtol, atol = C.FLOAT_TOL[dt]
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: (
                f"{what}: {m}\n got {describe(got)}\n expected {describe(expected)}"))
    else:
        if dt != "bool" and expected.numel():      # the test's own inputs must not overflow
            info = torch.iinfo(tdt(dt))
            assert info.min <= int(expected.min()) and int(expected.max()) <= info.max, \
                f"test bug: reference {describe(expected)} overflows {dt}"
        got = got.to(I64)
        assert torch.equal(got, expected), f"{what} {describe(got)} != {describe(expected)}"


def bits(t):
    t = t.detach().contiguous().reshape(-1).cpu()
    return t.to(torch.uint8) if t.dtype == torch.bool else t.view(torch.uint8)


def check_same(res, expected, what="result"):
    """Bitwise equality with CPU tensor ``expected`` (data movement), on this rank's device."""
    assert_on_device(res, what)
    assert res.dtype == expected.dtype, f"{what} dtype {res.dtype}, expected {expected.dtype}"
    assert tuple(res.shape) == tuple(expected.shape), \
        f"{what} shape {tuple(res.shape)}, expected {tuple(expected.shape)}"
    assert torch.equal(bits(res), bits(expected)), \
        f"{what} {describe(res)} != {describe(expected)}"


def check_exact_float(res, expected, what="result"):
    """Float result that must equal ``expected`` (CPU) exactly; says how far off it is."""
    assert_on_device(res, what)
    got = res.detach().cpu().to(F64)
    exp = expected.to(F64)
    assert got.shape == exp.shape, f"{what} shape {tuple(got.shape)} != {tuple(exp.shape)}"
    if not torch.equal(got, exp):
        nans = int(torch.isnan(got).sum())
        wrong = int((got != exp).sum())
        raise AssertionError(f"{what}: {wrong} of {got.numel()} elements wrong ({nans} NaN: "
                             f"data read before the kernel that produced it had finished?); "
                             f"got {describe(got)}, expected {describe(exp)}")


def assert_unchanged(t, original, what="input"):
    assert torch.equal(bits(t), bits(original)), f"{what} was modified"


attempt, expect_raises = C.attempt, C.expect_raises   # shared with the other torch workers


def make_input(case, k, dt, op, shape, small=False):
    """Rank k's input (torch_cases.op_input), except integer Product inputs come from [-2, 2]."""
    if op == "Product" and dt in C.INT_DTYPES:
        g = torch.Generator().manual_seed(C.seed_of(case, k))
        lo = 0 if dt == "uint8" else -2
        return torch.randint(lo, 3, tuple(shape), generator=g).to(tdt(dt))
    return C.op_input(case, k, dt, op, tuple(shape), small=small)


def randn(case, k, shape, dtype=None, extra=0):
    g = torch.Generator().manual_seed(C.seed_of(case, k, extra))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype or F64)


def follow_up(case):
    """A plain CUDA allreduce after an error works (the engine is still healthy)."""
    res = hvd.allreduce(gpu(torch.tensor([1.0, 2.0])), op=hvd.Sum, name=case + ".followup")
    assert_on_device(res, "follow-up result")
    assert res.cpu().tolist() == [float(SIZE), 2.0 * SIZE], \
        f"follow-up allreduce gave {res.cpu().tolist()}"


def run_async_batch(names, submit, check):
    """Submit every case's async op before waiting for any; report each case separately."""
    pending = {name: attempt(submit, name) for name in names}
    for name in names:
        item, exc = pending[name]

        def run(item=item, exc=exc):
            if exc is not None:
                raise exc
            check(*item)
        r.case(name, run)


def split_rows(rows, parts):
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def my_rows(full, parts, me):
    rows = split_rows(full.shape[0], parts)
    start = sum(rows[:me])
    return full[start:start + rows[me]]


def synchronize_device():
    if ON_GPU:
        torch.cuda.synchronize(DEV)


# =================================================================================================
# allreduce
# =================================================================================================
def allreduce_setup(case):
    _, variant, op, dt = case.split(".")
    inputs = [make_input(case, k, dt, op, SHAPE) for k in range(SIZE)]
    return variant, op, dt, inputs, C.reduce_reference(inputs, op, dt)


def allreduce_sync(case):
    variant, op, dt, inputs, expected = allreduce_setup(case)
    x = gpu(inputs[RANK])
    if variant == "out":
        res = hvd.allreduce(x, op=OP[op], name=case)
        assert res is not x, "allreduce returned its input"
        assert_unchanged(x, inputs[RANK])
    else:
        ptr = x.data_ptr()
        res = hvd.allreduce_(x, op=OP[op], name=case)
        assert res is x, "allreduce_ did not return its input tensor"
        assert x.data_ptr() == ptr, "allreduce_ moved the tensor's storage"
    check_values(res, expected, dt, exact_for(op, dt))


def allreduce_submit(case):
    variant, op, dt, inputs, expected = allreduce_setup(case)
    x = gpu(inputs[RANK])
    fn = hvd.allreduce_async if variant == "async" else hvd.allreduce_async_
    return x, fn(x, op=OP[op], name=case), (variant, op, dt, inputs, expected)


def allreduce_check(x, handle, info):
    variant, op, dt, inputs, expected = info
    res = hvd.synchronize(handle)
    assert hvd.poll(handle) is True
    if variant == "async":
        assert res is not x
        assert_unchanged(x, inputs[RANK])
    else:
        assert res is x, "synchronize(allreduce_async_) did not return the input tensor"
    check_values(res, expected, dt, exact_for(op, dt))


def allreduce_scalar(case):
    _, op, dt = case.split(".")
    inputs = [make_input(case, k, dt, op, ()) for k in range(SIZE)]
    res = hvd.allreduce(gpu(inputs[RANK]), op=OP[op], name=case)
    check_values(res, C.reduce_reference(inputs, op, dt), dt)


def allreduce_scaled(case):
    _, variant, op, dt, i = case.split(".")
    pre, post = C.SCALE_FACTORS[int(i)]
    inputs = [C.op_input(case, k, dt, "Sum", (5,), small=True) for k in range(SIZE)]
    factor = post * (1.0 / SIZE) if op == "Average" else post
    if dt in FLOAT_DTYPES:
        expected = sum(t.to(F64) * pre for t in inputs) * factor
    else:   # integers: each scaling in float64, truncated toward zero
        pres = [(t.to(F64) * pre).trunc().to(I64) for t in inputs]
        expected = (sum(pres).to(F64) * factor).trunc().to(I64)
    x = gpu(inputs[RANK])
    kwargs = dict(op=OP[op], name=case, prescale_factor=pre, postscale_factor=post)
    if variant == "out":
        res = hvd.allreduce(x, **kwargs)
        assert_unchanged(x, inputs[RANK])
    else:
        res = hvd.allreduce_(x, **kwargs)
        assert res is x
    check_values(res, expected, dt, exact=dt not in FLOAT_DTYPES)


def allreduce_misc(case):
    _, what, dt = case.split(".")
    if what == "large":   # beyond the fusion size: reduced alone, in place on the device
        inputs = [C.op_input(case, k, dt, "Sum", (1 << 22,)) for k in range(SIZE)]
        res = hvd.allreduce(gpu(inputs[RANK]), op=hvd.Sum, name=case)
        check_values(res, C.reduce_reference(inputs, "Sum", dt), dt)
    elif what in ("noncontig", "noncontig_inplace"):
        bases = [C.op_input(case, k, dt, "Sum", (4, 6)) for k in range(SIZE)]
        expected = C.reduce_reference([b.t() for b in bases], "Sum", dt)
        base = gpu(bases[RANK])
        view = base.t()
        assert not view.is_contiguous()
        if what == "noncontig":
            res = hvd.allreduce(view, op=hvd.Sum, name=case)
            assert_unchanged(base, bases[RANK], "base of the non-contiguous input")
            check_values(res, expected, dt)
        else:
            res = hvd.allreduce_(view, op=hvd.Sum, name=case)
            assert res is view
            check_values(base.t(), expected, dt, what="base storage after the in-place op")
    elif what == "default_op_is_average":
        inputs = [randn(case, k, (5,), torch.float32) for k in range(SIZE)]
        res = hvd.allreduce(gpu(inputs[RANK]), name=case)
        check_values(res, sum(t.to(F64) for t in inputs) / SIZE, dt, exact=False)
    elif what == "repeated_name":   # the response cache on the GPU path: same name, new data
        for step in range(4):
            inputs = [C.op_input(case, k, dt, "Sum", (6,), small=True) + step
                      for k in range(SIZE)]
            res = hvd.allreduce(gpu(inputs[RANK]), op=hvd.Sum, name=case)
            check_values(res, C.reduce_reference(inputs, "Sum", dt), dt, what=f"step {step}")
    else:
        raise ValueError(case)


def run_allreduce():
    names = allreduce_cases(BACKEND, SIZE)
    main = [c for c in names if c.startswith("allreduce.")]
    for case in main:
        if not case.split(".")[1].startswith("async"):
            r.case(case, allreduce_sync, case)
    run_async_batch([c for c in main if c.split(".")[1].startswith("async")],
                    allreduce_submit, allreduce_check)
    for case in names:
        if case.startswith("allreduce_scalar."):
            r.case(case, allreduce_scalar, case)
        elif case.startswith("allreduce_scaled."):
            r.case(case, allreduce_scaled, case)
        elif case.startswith("allreduce_misc."):
            r.case(case, allreduce_misc, case)


# --- int16 under NCCL --------------------------------------------------------------------------
def int16_case(case):
    what = case.split(".", 1)[1]
    x0 = C.op_input(case, RANK, "int16", "Sum", (4,))
    x = gpu(x0)
    needles = ("int16", "HVDLITE_GPU_OPERATIONS=mpi")
    if what.startswith("allreduce."):
        op = what.split(".")[1]
        fn = lambda: hvd.allreduce(x, op=OP[op], name=case)
    elif what == "allreduce_inplace":
        fn = lambda: hvd.allreduce_(x, op=hvd.Sum, name=case)
    elif what == "allreduce_async":   # refused at submission, before anything is in flight
        fn = lambda: hvd.allreduce_async(x, op=hvd.Sum, name=case)
    elif what == "allreduce_scaled":
        fn = lambda: hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5,
                                   name=case)
    elif what == "grouped_allreduce":
        other = gpu(torch.ones(3))
        fn = lambda: hvd.grouped_allreduce([other, x], op=hvd.Sum, name=case)
    else:
        raise ValueError(case)
    exc = expect_raises(fn, hvd.GpuUnavailableError, *needles)
    assert isinstance(exc, hvd.HvdliteError), "GpuUnavailableError is not an HvdliteError"
    assert_unchanged(x, x0, "the refused int16 tensor")
    follow_up(case)


def int16_other_ops(case):
    """Allgather/broadcast move bytes (any dtype through NCCL); alltoall and reducescatter go
    through host staging: all of them work on int16 under NCCL."""
    rows = [C.op_input(case, k, "int16", "Sum", (k + 1, 3)) for k in range(SIZE)]
    check_same(hvd.allgather(gpu(rows[RANK]), name=case + ".allgather"), torch.cat(rows),
               "allgather")
    vals = [C.op_input(case + "b", k, "int16", "Sum", (5,)) for k in range(SIZE)]
    check_same(hvd.broadcast(gpu(vals[RANK]), 0, name=case + ".broadcast"), vals[0], "broadcast")
    full = [C.op_input(case + "rs", k, "int16", "Sum", (2 * SIZE, 2), small=True)
            for k in range(SIZE)]
    res = hvd.reducescatter(gpu(full[RANK]), op=hvd.Sum, name=case + ".reducescatter")
    check_values(res, my_rows(C.reduce_reference(full, "Sum", "int16"), SIZE, RANK), "int16",
                 what="reducescatter")
    a2a = [C.op_input(case + "a2a", k, "int16", "Sum", (2 * SIZE,)) for k in range(SIZE)]
    res = hvd.alltoall(gpu(a2a[RANK]), name=case + ".alltoall")
    check_same(res, torch.cat([a2a[k][2 * RANK:2 * RANK + 2] for k in range(SIZE)]),
               "alltoall")
    follow_up(case)


def run_int16():
    for case in int16_cases(BACKEND, SIZE):
        r.case(case, int16_other_ops if case == "int16.other_ops_work" else int16_case, case)


# =================================================================================================
# allgather and broadcast
# =================================================================================================
def gather_inputs(case, dt, sh):
    trailing = C.GATHER_SHAPES[sh]
    shapes = [() if trailing is None else (C.gather_rows(k, sh),) + trailing
              for k in range(SIZE)]
    inputs = [C.op_input(case, k, dt, "Sum", shapes[k]) for k in range(SIZE)]
    expected = torch.cat([t.reshape(1) if trailing is None else t for t in inputs])
    return inputs, expected


def allgather_case(case):
    _, variant, dt, sh = case.split(".")
    inputs, expected = gather_inputs(case, dt, sh)
    x = gpu(inputs[RANK])
    res = (hvd.allgather(x, name=case) if variant == "out"
           else hvd.synchronize(hvd.allgather_async(x, name=case)))
    assert_unchanged(x, inputs[RANK])
    check_same(res, expected)


def allgather_misc(case):
    _, what, dt = case.split(".")
    if what == "even_rows":   # same first dimension everywhere (NCCL's one-call allgather)
        inputs = [C.op_input(case, k, dt, "Sum", (3, 2)) for k in range(SIZE)]
        check_same(hvd.allgather(gpu(inputs[RANK]), name=case), torch.cat(inputs))
    elif what == "noncontig":
        bases = [C.op_input(case, k, dt, "Sum", (3, k + 2)) for k in range(SIZE)]
        base = gpu(bases[RANK])
        res = hvd.allgather(base.t(), name=case)
        assert_unchanged(base, bases[RANK])
        check_same(res, torch.cat([b.t() for b in bases]))
    else:
        raise ValueError(case)


def broadcast_setup(case):
    _, variant, dt, root = case.split(".")
    root = int(root[len("root"):])
    inputs = [C.op_input(case, k, dt, "Sum", (3, 4)) for k in range(SIZE)]
    return variant, dt, root, inputs


def broadcast_sync(case):
    variant, _, root, inputs = broadcast_setup(case)
    x = gpu(inputs[RANK])
    if variant == "out":
        res = hvd.broadcast(x, root, name=case)
        assert res is not x
        assert_unchanged(x, inputs[RANK])
    else:
        res = hvd.broadcast_(x, root, name=case)
        assert res is x
    check_same(res, inputs[root])


def broadcast_submit(case):
    variant, _, root, inputs = broadcast_setup(case)
    x = gpu(inputs[RANK])
    fn = hvd.broadcast_async if variant == "async" else hvd.broadcast_async_
    return x, fn(x, root, name=case), (variant, inputs, root)


def broadcast_check(x, handle, info):
    variant, inputs, root = info
    res = hvd.synchronize(handle)
    if variant == "async":
        assert res is not x
        assert_unchanged(x, inputs[RANK])
    else:
        assert res is x
    check_same(res, inputs[root])


def broadcast_misc(case):
    _, what, dt = case.split(".")
    root = SIZE - 1
    if what == "noncontig_inplace":
        bases = [C.op_input(case, k, dt, "Sum", (4, 6)) for k in range(SIZE)]
        base = gpu(bases[RANK])
        view = base.t()
        res = hvd.broadcast_(view, root, name=case)
        assert res is view
        check_same(base, bases[root], "base storage after the in-place broadcast")
    elif what == "large":
        inputs = [C.op_input(case, k, dt, "Sum", (1 << 22,)) for k in range(SIZE)]
        check_same(hvd.broadcast(gpu(inputs[RANK]), root, name=case), inputs[root])
    else:
        raise ValueError(case)


def run_allgather_broadcast():
    for case in allgather_cases(BACKEND, SIZE):
        r.case(case, allgather_misc if case.startswith("allgather_misc.") else allgather_case,
               case)
    names = broadcast_cases(BACKEND, SIZE)
    main = [c for c in names if c.startswith("broadcast.")]
    for case in main:
        if not case.split(".")[1].startswith("async"):
            r.case(case, broadcast_sync, case)
    run_async_batch([c for c in main if c.split(".")[1].startswith("async")],
                    broadcast_submit, broadcast_check)
    for case in names:
        if case.startswith("broadcast_misc."):
            r.case(case, broadcast_misc, case)


# =================================================================================================
# fusion: many small allreduces in flight together
# =================================================================================================
def fused_inputs(case, dt, op, n=FUSED_N, small=False):
    shapes = [(j % 7 + 1, 3) for j in range(n)]
    return [[make_input(f"{case}.{j}", k, dt, op, shape, small) for k in range(SIZE)]
            for j, shape in enumerate(shapes)]


def fused_async(case):
    _, _, op, dt = case.split(".")
    inputs = fused_inputs(case, dt, op)
    xs = [gpu(per_rank[RANK]) for per_rank in inputs]
    handles = []
    for j, x in enumerate(xs):   # odd ones in place, even ones out of place; all before a wait
        fn = hvd.allreduce_async_ if j % 2 else hvd.allreduce_async
        handles.append(fn(x, op=OP[op], name=f"{case}.{j}"))
    results = [hvd.synchronize(h) for h in handles]
    for j, (res, per_rank) in enumerate(zip(results, inputs)):
        if j % 2:
            assert res is xs[j], f"tensor {j}: allreduce_async_ did not return its input"
        else:
            assert_unchanged(xs[j], per_rank[RANK], f"input {j}")
        check_values(res, C.reduce_reference(per_rank, op, dt), dt, exact_for(op, dt),
                     what=f"tensor {j}")


def fused_grouped(case):
    _, kind, op, dt = case.split(".")
    inputs = fused_inputs(case, dt, op, n=12)
    xs = [gpu(per_rank[RANK]) for per_rank in inputs]
    if kind == "grouped":
        outs = hvd.grouped_allreduce(xs, op=OP[op], name=case)
        for j, x in enumerate(xs):
            assert_unchanged(x, inputs[j][RANK], f"input {j}")
    else:
        outs = hvd.grouped_allreduce_(xs, op=OP[op], name=case)
        assert all(o is x for o, x in zip(outs, xs)), "grouped_allreduce_ returned new tensors"
    assert len(outs) == len(xs)
    for j, (res, per_rank) in enumerate(zip(outs, inputs)):
        check_values(res, C.reduce_reference(per_rank, op, dt), dt, exact_for(op, dt),
                     what=f"member {j}")


def fused_scaled(case):
    _, _, op, dt = case.split(".")
    pre, post = 0.5, 3.0
    inputs = fused_inputs(case, dt, "Sum", n=10, small=True)
    factor = post * (1.0 / SIZE) if op == "Average" else post
    xs = [gpu(per_rank[RANK]) for per_rank in inputs]
    outs = hvd.grouped_allreduce(xs, op=OP[op], prescale_factor=pre, postscale_factor=post,
                                 name=case)
    for j, (res, per_rank) in enumerate(zip(outs, inputs)):
        if dt in FLOAT_DTYPES:
            expected = sum(t.to(F64) * pre for t in per_rank) * factor
        else:
            pres = [(t.to(F64) * pre).trunc().to(I64) for t in per_rank]
            expected = (sum(pres).to(F64) * factor).trunc().to(I64)
        check_values(res, expected, dt, exact=dt not in FLOAT_DTYPES, what=f"member {j}")


def fused_mixed(case):
    """Interleaved dtypes in flight together: fusion must group by dtype and keep order."""
    dts = ["float32", "int32", "bfloat16", "float64", "uint8", "float16"]
    inputs, handles = [], []
    for j in range(24):
        dt = dts[j % len(dts)]
        per_rank = [C.op_input(f"{case}.{j}", k, dt, "Sum", (j % 5 + 1, 2)) for k in range(SIZE)]
        inputs.append((dt, per_rank))
        handles.append(hvd.allreduce_async(gpu(per_rank[RANK]), op=hvd.Sum, name=f"{case}.{j}"))
    for j, (h, (dt, per_rank)) in enumerate(zip(handles, inputs)):
        check_values(hvd.synchronize(h), C.reduce_reference(per_rank, "Sum", dt), dt,
                     what=f"tensor {j} ({dt})")


def fused_large_and_small(case):
    dt = case.split(".")[2]
    inputs, handles = [], []
    for j in range(10):   # 2 MiB tensors (reduced alone) between small ones (fused)
        shape = (1 << 19,) if j % 3 == 0 else (j + 1, 4)
        per_rank = [C.op_input(f"{case}.{j}", k, dt, "Sum", shape) for k in range(SIZE)]
        inputs.append(per_rank)
        handles.append(hvd.allreduce_async(gpu(per_rank[RANK]), op=hvd.Sum, name=f"{case}.{j}"))
    for j, (h, per_rank) in enumerate(zip(handles, inputs)):
        check_values(hvd.synchronize(h), C.reduce_reference(per_rank, "Sum", dt), dt,
                     what=f"tensor {j}")


def fused_path_taken(case):
    """White box: a grouped allreduce of small CUDA tensors goes through the fused device path
    (NCCLPath._allreduce_fused; under host staging, the host MPI path's fused path)."""
    from hvdlite.common.runtime import state
    hvd.allreduce(gpu(torch.ones(1)), op=hvd.Sum, name=case + ".warm")
    engine = state.engine()
    if BACKEND == "nccl":
        target = engine.path("nccl")
    else:
        target = next(p for p in engine.path("staged")._host_paths if p.name == "mpi")
    original = target._allreduce_fused
    sizes = []

    def counting(*args, **kwargs):
        sizes.append(len(args[-1]))   # the batch is the last positional argument
        return original(*args, **kwargs)
    target._allreduce_fused = counting
    try:
        inputs = fused_inputs(case, "float32", "Sum", n=12)
        outs = hvd.grouped_allreduce([gpu(p[RANK]) for p in inputs], op=hvd.Sum, name=case)
    finally:
        del target._allreduce_fused   # back to the class's method
    for j, (res, per_rank) in enumerate(zip(outs, inputs)):
        check_values(res, C.reduce_reference(per_rank, "Sum", "float32"), "float32",
                     what=f"member {j}")
    if BACKEND == "staged" and SIZE == 1:
        return   # the MPI backend copies and scales at one rank: no fused reduction to see
    assert sizes and max(sizes) > 1, \
        f"the fused path did not run for 12 small grouped tensors (batches seen: {sizes})"


def run_fused():
    for case in fused_cases(BACKEND, SIZE):
        kind = case.split(".")[1]
        fn = {"async": fused_async, "grouped": fused_grouped, "grouped_inplace": fused_grouped,
              "scaled": fused_scaled, "mixed_dtypes": fused_mixed,
              "large_and_small": fused_large_and_small, "path_taken": fused_path_taken}[kind]
        r.case(case, fn, case)


# =================================================================================================
# alltoall and reducescatter (host-staged under both backends)
# =================================================================================================
def a2a_splits(case, layout):
    if layout == "even":
        return [[2] * SIZE for _ in range(SIZE)]
    g = torch.Generator().manual_seed(C.seed_of(case, "splits"))
    S = torch.randint(0, 4, (SIZE, SIZE), generator=g)
    S[0, 0] = max(int(S[0, 0]), 1)        # something moves even at one rank
    return S.tolist()


def a2a_expected(inputs, S, me):
    parts = []
    for k, x in enumerate(inputs):
        off = sum(S[k][:me])
        parts.append(x[off:off + S[k][me]])
    return torch.cat(parts)


def alltoall_case(case):
    _, layout, dt = case.split(".")
    S = a2a_splits(case, "even" if layout == "even" else "uneven")
    inputs = [C.op_input(case, k, dt, "Sum", (sum(S[k]), 2)) for k in range(SIZE)]
    x = gpu(inputs[RANK])
    received = None
    if layout == "even":
        out = hvd.alltoall(x, name=case)
    elif layout == "uneven":
        out, received = hvd.alltoall(x, splits=S[RANK], name=case)
    else:
        out, received = hvd.synchronize(hvd.alltoall_async(x, splits=S[RANK], name=case))
    assert_unchanged(x, inputs[RANK])
    check_same(out, a2a_expected(inputs, S, RANK))
    if received is not None:
        assert received.tolist() == [S[k][RANK] for k in range(SIZE)], \
            f"received splits {received.tolist()}"


def reducescatter_case(case):
    kind, op, dt = case.split(".")
    rows = 2 * SIZE + 1   # uneven shares
    if kind == "reducescatter":
        inputs = [make_input(case, k, dt, op, (rows, 3)) for k in range(SIZE)]
        expected = my_rows(C.reduce_reference(inputs, op, dt), SIZE, RANK)
        res = hvd.reducescatter(gpu(inputs[RANK]), op=OP[op], name=case)
        check_values(res, expected, dt, exact_for(op, dt))
        return
    pre, post = 2.5, 0.25
    inputs = [C.op_input(case, k, dt, "Sum", (rows, 2), small=True) for k in range(SIZE)]
    factor = post * (1.0 / SIZE) if op == "Average" else post
    if dt in FLOAT_DTYPES:
        full = sum(t.to(F64) * pre for t in inputs) * factor
    else:
        pres = [(t.to(F64) * pre).trunc().to(I64) for t in inputs]
        full = (sum(pres).to(F64) * factor).trunc().to(I64)
    res = hvd.reducescatter(gpu(inputs[RANK]), op=OP[op], prescale_factor=pre,
                            postscale_factor=post, name=case)
    check_values(res, my_rows(full, SIZE, RANK), dt, exact=dt not in FLOAT_DTYPES)


def run_alltoall_reducescatter():
    for case in alltoall_cases(BACKEND, SIZE):
        r.case(case, alltoall_case, case)
    for case in reducescatter_cases(BACKEND, SIZE):
        r.case(case, reducescatter_case, case)


# =================================================================================================
# stream ordering
# =================================================================================================
SPIN_CYCLES = 100_000_000   # torch.cuda._sleep: about 50 ms of GPU time before the matmul


def mm_operands(case, n=None):
    """Square matrices with entries in {-1, 0, 1}, the same on every rank: their product has
    integer entries below 2**24, so it is exact in float32 in any summation order."""
    n = n or MM_N
    g = torch.Generator(device=DEV).manual_seed(C.seed_of(case, "mm"))
    a = torch.randint(-1, 2, (n, n), generator=g, device=DEV).float()
    b = torch.randint(-1, 2, (n, n), generator=g, device=DEV).float()
    return a, b


def mm_reference(a, b):
    """a @ b, computed with the host synchronized before and after (no race possible)."""
    synchronize_device()
    ref = (a @ b).cpu()
    synchronize_device()
    return ref


def busy_then_matmul(a, b):
    """c = a @ b on torch's current stream, written over NaNs and queued behind ~50 ms of GPU
    spinning, with no host synchronization: an hvdlite op that read ``c`` without waiting for
    that stream would see NaNs (or a partial product), and one that wrote into ``c`` too early
    would be overwritten by the matmul."""
    c = torch.full((a.shape[0], b.shape[1]), float("nan"), device=DEV)
    if ON_GPU and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(SPIN_CYCLES)
    torch.matmul(a, b, out=c)
    return c


def stream_context(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def order_case(case):
    what = case.split(".", 1)[1]
    n = SIZE
    a, b = mm_operands(case)
    ref = mm_reference(a, b)
    if what == "matmul_then_allreduce_out":
        c = busy_then_matmul(a, b)
        res = hvd.allreduce(c, op=hvd.Sum, name=case)
        check_exact_float(res, ref * n)
    elif what == "matmul_then_allreduce_inplace_prescaled":
        c = busy_then_matmul(a, b)   # the prescale kernel reads and writes c in place
        res = hvd.allreduce_(c, op=hvd.Sum, prescale_factor=2.0, name=case)
        assert res is c
        check_exact_float(res, ref * (2 * n))
    elif what == "side_stream_then_allreduce":
        side = torch.cuda.Stream(device=DEV) if ON_GPU else None
        with stream_context(side):
            if side is not None:
                side.wait_stream(torch.cuda.default_stream(DEV))   # a, b come from there
            c = busy_then_matmul(a, b)
            res = hvd.synchronize(hvd.allreduce_async(c, op=hvd.Sum, name=case))
            half = res * 0.5     # consumed on the side stream straight away
        synchronize_device()
        check_exact_float(res, ref * n)
        check_exact_float(half, ref * (n * 0.5), "result consumed on the side stream")
    elif what == "consume_right_after_synchronize":
        c = busy_then_matmul(a, b)
        res = hvd.synchronize(hvd.allreduce_async(c, op=hvd.Sum, name=case))
        used = res * 3.0 + 1.0   # kernels on torch's stream, no host synchronization
        check_exact_float(used, ref * (3 * n) + 1.0, "result used right after synchronize()")
        check_exact_float(res, ref * n)
    elif what == "wait_in_reverse_and_consume":
        cs = [busy_then_matmul(a, b) + float(i) for i in range(3)]
        handles = [hvd.allreduce_async(c, op=hvd.Sum, name=f"{case}.{i}")
                   for i, c in enumerate(cs)]
        outs = [hvd.synchronize(h) for h in reversed(handles)][::-1]
        total = outs[0] + outs[1] + outs[2]
        check_exact_float(total, ref * (3 * n) + 3.0 * n, "sum of the three results")
    elif what == "chained_allreduces":
        c = busy_then_matmul(a, b)
        res = hvd.allreduce(hvd.allreduce(c, op=hvd.Sum, name=case + ".1"), op=hvd.Sum,
                            name=case + ".2")
        check_exact_float(res, ref * (n * n))
    elif what in ("kernel_then_broadcast_inplace", "kernel_then_broadcast_out"):
        c = busy_then_matmul(a, b)
        c.add_(float(RANK))     # every rank's tensor differs; the root's (rank 0) wins
        if what.endswith("inplace"):
            res = hvd.broadcast_(c, 0, name=case)
            assert res is c
        else:
            res = hvd.broadcast(c, 0, name=case)
        check_exact_float(res, ref)
    elif what == "kernel_then_allgather":
        c = busy_then_matmul(a, b)
        rows = c[:RANK + 1]
        res = hvd.allgather(rows, name=case)
        check_exact_float(res, torch.cat([ref[:k + 1] for k in range(SIZE)]))
    elif what == "interleaved_kernels_and_async":
        sa, sb = mm_operands(case + ".small", 256)
        small_ref = mm_reference(sa, sb)
        if ON_GPU and hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(SPIN_CYCLES)
        ts, handles = [], []
        for i in range(16):
            t = torch.mm(sa, sb).add_(float(i))
            ts.append(t)
            handles.append(hvd.allreduce_async_(t, op=hvd.Sum, name=f"{case}.{i}"))
        for i, h in enumerate(handles):
            res = hvd.synchronize(h)
            assert res is ts[i]
            check_exact_float(res, (small_ref + float(i)) * n, f"tensor {i}")
    elif what == "input_overwritten_after_wait":
        c = busy_then_matmul(a, b)
        res = hvd.allreduce(c, op=hvd.Sum, name=case)
        c.fill_(float("nan"))   # the result must not depend on the input any more
        gathered = hvd.allgather(c[:1].clone().fill_(1.0), name=case + ".after")
        check_exact_float(res, ref * n, "out-of-place result after the input was overwritten")
        check_exact_float(gathered, torch.ones(SIZE, ref.shape[1]))
    elif what == "grouped_after_kernels":
        c1 = busy_then_matmul(a, b)   # large: reduced alone
        c2 = c1[:64] * 2.0            # small: fused together
        c3 = c1[64:96] - 1.0
        outs = hvd.grouped_allreduce([c1, c2, c3], op=hvd.Sum, name=case)
        check_exact_float(outs[0], ref * n, "member 0")
        check_exact_float(outs[1], ref[:64] * (2 * n), "member 1")
        check_exact_float(outs[2], (ref[64:96] - 1.0) * n, "member 2")
    elif what == "synchronize_and_the_device":
        # NCCL under asynchronous completion (the default): synchronize() returns while the
        # input's producer is still spinning (~200 ms), since the handover is a device-side
        # wait, and torch's stream has work left.  With HVDLITE_ENABLE_ASYNC_COMPLETION=0 the
        # host waited for hvdlite's work, which waited for that spin; host staging (mpi) waits
        # for the input on the host before MPI reads it: either way nothing is left.
        c = torch.full((a.shape[0], b.shape[1]), float("nan"), device=DEV)
        if ON_GPU:
            torch.cuda._sleep(4 * SPIN_CYCLES)
        torch.matmul(a, b, out=c)
        res = hvd.synchronize(hvd.allreduce_async(c, op=hvd.Sum, name=case))
        left = ON_GPU and not torch.cuda.current_stream(DEV).query()
        check_exact_float(res, ref * n)
        if ON_GPU:
            async_on = os.environ.get("HVDLITE_ENABLE_ASYNC_COMPLETION", "1").strip() != "0"
            want = async_on and BACKEND == "nccl"
            assert left == want, (
                f"work left on torch's stream right after synchronize(): {left}; expected "
                f"{want} ({BACKEND}, asynchronous completion {'on' if async_on else 'off'})")
    else:
        raise ValueError(case)


# =================================================================================================
# autograd on CUDA tensors (backward runs hvdlite ops on autograd's device thread)
# =================================================================================================
def close(a, b, what, tol=1e-12):
    assert a is not None, f"{what} is None"
    assert_on_device(a, what)
    assert tuple(a.shape) == tuple(b.shape), f"{what} shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a.detach().cpu().to(F64), b.to(F64), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


def grad_case(case):
    what = case.split(".", 1)[1]
    if what.startswith("allreduce."):
        op = what.split(".")[1]
        xs = [randn(case, k, (3, 2)) for k in range(SIZE)]
        ws = [randn(case, k, (3, 2), extra=1) for k in range(SIZE)]
        x = gpu(xs[RANK]).requires_grad_()
        y = hvd.allreduce(x, op=OP[op], name=case)
        (y * gpu(ws[RANK])).sum().backward()
        expected = sum(ws) / (SIZE if op == "Average" else 1)
    elif what == "allgather":
        total = sum(k + 1 for k in range(SIZE))
        xs = [randn(case, k, (k + 1, 2)) for k in range(SIZE)]
        ws = [randn(case, k, (total, 2), extra=1) for k in range(SIZE)]
        x = gpu(xs[RANK]).requires_grad_()
        y = hvd.allgather(x, name=case)
        (y * gpu(ws[RANK])).sum().backward()
        off = sum(k + 1 for k in range(RANK))
        expected = (sum(ws) / SIZE)[off:off + RANK + 1]   # Horovod: averaged, then my rows
    elif what == "broadcast":
        root = SIZE - 1
        ws = [randn(case, k, (4,), extra=1) for k in range(SIZE)]
        x = gpu(randn(case, RANK, (4,))).requires_grad_()
        y = hvd.broadcast(x, root, name=case)
        (y * gpu(ws[RANK])).sum().backward()
        expected = sum(ws) / SIZE if RANK == root else torch.zeros(4, dtype=F64)
    elif what.startswith("reducescatter."):
        op = what.split(".")[1]
        rows = [2 + (1 if k == 0 else 0) for k in range(SIZE)]   # 2 * SIZE + 1 rows
        ws = [randn(case, k, (rows[k], 2), extra=1) for k in range(SIZE)]
        x = gpu(randn(case, RANK, (sum(rows), 2))).requires_grad_()
        y = hvd.reducescatter(x, op=OP[op], name=case, prescale_factor=2.0)
        (y * gpu(ws[RANK])).sum().backward()
        # Horovod: the gathered upstream rows, times size for Sum (no 1/size for Average)
        expected = torch.cat(ws) * 2.0 * (SIZE if op == "Sum" else 1)
    elif what == "grouped_allgather":
        total = sum(k + 1 for k in range(SIZE))
        ws = [randn(case, k, (total + 2 * SIZE, 2), extra=1) for k in range(SIZE)]
        x = gpu(randn(case, RANK, (RANK + 1, 2))).requires_grad_()
        ys = hvd.grouped_allgather([x, x[:1] * 3.0, x[:1]], name=case)
        (torch.cat(ys[:2] + [ys[2]]) * gpu(ws[RANK])).sum().backward()
        avg = sum(ws) / SIZE
        off = sum(k + 1 for k in range(RANK))
        expected = avg[off:off + RANK + 1].clone()
        expected[0] += 3.0 * avg[total + RANK] + avg[total + SIZE + RANK]
    elif what == "grouped_reducescatter.Sum":
        ws = [randn(case, k, (2, 2), extra=1) for k in range(SIZE)]
        x = gpu(randn(case, RANK, (SIZE, 2))).requires_grad_()
        ys = hvd.grouped_reducescatter([x, x * 2.0], op=hvd.Sum, name=case)
        (torch.cat(ys) * gpu(ws[RANK])).sum().backward()
        expected = SIZE * (torch.cat([w[:1] for w in ws]) + 2.0 * torch.cat([w[1:] for w in ws]))
    else:
        raise ValueError(case)
    close(x.grad, expected, "x.grad")


# =================================================================================================
# the GPU path itself
# =================================================================================================
def device_case(case):
    from hvdlite.common.runtime import state
    what = case.split(".", 1)[1]
    if what == "backend_in_use":
        used = []
        device_paths = [p for p in state.engine().paths if p.device]
        for path in device_paths:   # record which device path serves the allreduce
            path.execute = (lambda run, name: lambda batch: (used.append(name), run(batch))[1])(
                path.execute, path.name)
        try:
            hvd.allreduce(gpu(torch.ones(2)), op=hvd.Sum, name=case)
        finally:
            for path in device_paths:
                del path.execute   # back to the class's method
        expected = "nccl" if BACKEND == "nccl" else "staged"
        assert used == [expected], f"CUDA tensors went through {used}, expected [{expected!r}]"
    elif what == "build_flags":
        assert hvd.cuda_built() is True, "cuda_built() is not True on a GPU machine"
        version = hvd.nccl_built()
        assert isinstance(version, int), f"nccl_built() returned {type(version).__name__}"
        if BACKEND == "nccl":
            assert version > 0, "nccl_built() is 0 although NCCL runs the GPU operations"
    elif what == "outputs_on_device":
        x = gpu(torch.arange(2 * SIZE * 3, dtype=torch.float32).reshape(2 * SIZE, 3))
        outs = {"allreduce": hvd.allreduce(x, op=hvd.Sum, name=case + ".ar"),
                "allreduce_": hvd.allreduce_(x.clone(), op=hvd.Sum, name=case + ".ar_"),
                "allgather": hvd.allgather(x, name=case + ".ag"),
                "broadcast": hvd.broadcast(x, 0, name=case + ".bc"),
                "alltoall": hvd.alltoall(x, name=case + ".a2a"),
                "reducescatter": hvd.reducescatter(x, op=hvd.Sum, name=case + ".rs")}
        grouped = hvd.grouped_allreduce([x, x[:1]], op=hvd.Sum, name=case + ".g")
        outs.update({f"grouped[{i}]": t for i, t in enumerate(grouped)})
        for what_op, out in outs.items():
            assert_on_device(out, f"{what_op} output")
    else:
        raise ValueError(case)


def mismatch_case(case):
    """One name, a CPU tensor on one rank and a CUDA tensor on another: TensorMismatchError on
    every rank, and the next operation works."""
    parts = case.split(".")
    if parts[1] == "then_same_name_on_cuda":
        name = case + ".name"
        x = torch.ones(3) if RANK == 0 else gpu(torch.ones(3))
        exc = attempt(hvd.allreduce, x, op=hvd.Sum, name=name)[1]
        raised = COMM.allgather(isinstance(exc, hvd.TensorMismatchError))
        assert all(raised), f"TensorMismatchError on ranks {raised}; here: {exc!r}"
        res = hvd.allreduce(gpu(torch.ones(3)), op=hvd.Sum, name=name)   # same name, now valid
        check_values(res, torch.full((3,), float(SIZE), dtype=F64), "float32")
        return
    order, kind = parts[1], parts[2]
    cuda_rank = SIZE - 1 if order == "cpu_vs_cuda" else 0
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + RANK
    if RANK == cuda_rank:
        x = gpu(x)
    fn = {"allreduce": lambda: hvd.allreduce(x, op=hvd.Sum, name=case),
          "allreduce_inplace": lambda: hvd.allreduce_(x, op=hvd.Sum, name=case),
          "allgather": lambda: hvd.allgather(x, name=case),
          "broadcast": lambda: hvd.broadcast(x, 0, name=case)}[kind]
    exc = attempt(fn)[1]
    raised = COMM.allgather(isinstance(exc, hvd.TensorMismatchError))
    assert exc is not None, "no error although one rank passed a CPU tensor, another a CUDA one"
    assert isinstance(exc, hvd.TensorMismatchError), \
        f"expected TensorMismatchError, got {type(exc).__name__}: {exc}"
    for needle in ("Mismatched device", "'cpu'", "'gpu'"):
        assert needle in str(exc), f"{needle!r} not in the message: {exc}"
    assert all(raised), f"TensorMismatchError on ranks {raised}"
    follow_up(case)


def join_case(case):
    """Rank 0 joins at once; the others allreduce a CUDA tensor (the joined rank stands in with
    zeros, through the GPU path), then join."""
    inputs = [C.op_input(case, k, "float32", "Sum", (4,)) for k in range(SIZE)]

    def run():
        out = None
        if RANK != 0:
            out = hvd.allreduce(gpu(inputs[RANK]), op=hvd.Sum, name=case)
        return out, hvd.join()
    res, exc = attempt(run)
    lasts = COMM.allgather(None if exc is not None else res[1])
    if exc is not None:
        raise exc
    assert lasts == [lasts[0]] * SIZE and lasts[0] in range(1, SIZE), \
        f"join() returned {lasts}"
    if res[0] is not None:
        expected = C.reduce_reference([torch.zeros(4)] + inputs[1:], "Sum", "float32")
        check_values(res[0], expected, "float32")
    follow_up(case)


# =================================================================================================
# zero-size tensors (last: a failure here must not hide the other results)
# =================================================================================================
def edge_case(case):
    _, what, dt = case.split(".")
    if what in ("allreduce_empty", "allreduce_empty_inplace", "allreduce_empty_3d"):
        shape = (2, 0, 3) if what.endswith("3d") else (0,)
        x = gpu(C.op_input(case, RANK, dt, "Sum", shape))
        if what.endswith("inplace"):
            res = hvd.allreduce_(x, op=hvd.Sum, name=case)
            assert res is x
        else:
            res = hvd.allreduce(x, op=hvd.Sum, name=case)
        check_values(res, torch.zeros(shape, dtype=F64 if dt in FLOAT_DTYPES else I64), dt)
    elif what == "broadcast_empty":
        res = hvd.broadcast(gpu(torch.empty(0, 3, dtype=tdt(dt))), 0, name=case)
        check_same(res, torch.empty(0, 3, dtype=tdt(dt)))
    elif what == "allgather_zero_width":
        inputs = [torch.empty(k + 1, 0, dtype=tdt(dt)) for k in range(SIZE)]
        check_same(hvd.allgather(gpu(inputs[RANK]), name=case), torch.cat(inputs))
    elif what == "allgather_no_rows_anywhere":
        check_same(hvd.allgather(gpu(torch.empty(0, 3, dtype=tdt(dt))), name=case),
                   torch.empty(0, 3, dtype=tdt(dt)))
    elif what == "alltoall_nothing_sent":
        out, received = hvd.alltoall(gpu(torch.empty(0, 2, dtype=tdt(dt))), splits=[0] * SIZE,
                                     name=case)
        check_same(out, torch.empty(0, 2, dtype=tdt(dt)))
        assert received.tolist() == [0] * SIZE
    elif what == "reducescatter_zero_rows":
        res = hvd.reducescatter(gpu(torch.empty(0, 3, dtype=tdt(dt))), op=hvd.Sum, name=case)
        check_same(res, torch.empty(0, 3, dtype=tdt(dt)))
    else:
        raise ValueError(case)
    follow_up(case)


def run_collectives():
    run_allreduce()
    run_int16()
    run_allgather_broadcast()
    run_fused()
    run_alltoall_reducescatter()
    for case in ORDER_CASES:
        r.case(case, order_case, case)
    for case in GRAD_CASES:
        r.case(case, grad_case, case)
    for case in DEVICE_CASES:
        r.case(case, device_case, case)
    if SIZE >= 2:
        for case in MISMATCH_CASES:
            r.case(case, mismatch_case, case)
        for case in JOIN_CASES:
            r.case(case, join_case, case)
    for case in EDGE_CASES:
        r.case(case, edge_case, case)


# =================================================================================================
# DistributedOptimizer training on CUDA models
# =================================================================================================
B = 8                       # rows per rank per step
IN, HID, OUT = 16, 32, 4
STEPS = 6


def make_model(kind="mlp", dtype=None, seed=0):
    torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))
    else:   # a small CNN: cuDNN convolutions in forward and backward
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                              nn.Flatten(), nn.Linear(8 * 4 * 4, OUT))
    return model.to(device=DEV, dtype=dtype or torch.float32)


def batch(case, step, dtype, kind="mlp"):
    g = torch.Generator().manual_seed(C.seed_of(case, "batch", step))
    rows = SIZE * B
    in_shape = (IN,) if kind == "mlp" else (3, 8, 8)
    x = torch.randn((rows,) + in_shape, generator=g, dtype=F64).to(dtype)
    y = torch.randn(rows, OUT, generator=g, dtype=F64).to(dtype)
    return gpu(x), gpu(y)


def shard(t):
    return t[RANK * B:(RANK + 1) * B]


def param_bytes(p):
    return bits(p).numpy().tobytes()


def same_on_all_ranks(model):
    for name, p in model.named_parameters():
        assert_on_device(p, f"parameter {name!r}")
        gathered = COMM.allgather(param_bytes(p))
        assert all(g == gathered[0] for g in gathered), f"parameter {name!r} differs between ranks"


def close_to(model, ref, tol):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach().cpu().double(), q.detach().cpu().double(),
                                   rtol=0, atol=tol,
                                   msg=lambda m, name=name: f"parameter {name!r}: {m}")


def moved(model, init):
    for (name, p), (_, q) in zip(model.named_parameters(), init.named_parameters()):
        assert not torch.equal(p, q), f"parameter {name!r} never changed (vacuous comparison)"


def train_dist(case, model, opt, dtype, kind="mlp", micro=1, clip=None):
    for step in range(STEPS):
        x, y = batch(case, step, dtype, kind)
        xs, ys = shard(x), shard(y)
        opt.zero_grad()
        for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):
            (F.mse_loss(model(xm), ym) / micro).backward()
        if clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()


def train_ref(case, model, opt, dtype, kind="mlp", clip=None):
    """The single-process run: the concatenated batch of every rank, one step per step."""
    for step in range(STEPS):
        x, y = batch(case, step, dtype, kind)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_case(case):
    _, what, dt = case.split(".")
    dtype = tdt(dt)
    kind = "convnet" if what == "convnet" else "mlp"
    tol = {"float32": 2e-5, "float64": 1e-10}[dt]
    make_opt = sgd
    dist_kwargs, micro, clip = {}, 1, None
    model = make_model(kind, dtype)
    if what == "adam":
        make_opt = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)
        tol = 1e-4
    elif what == "convnet":
        tol = 1e-4
    elif what == "num_groups2":
        dist_kwargs = {"num_groups": 2}
    elif what == "groups_list":
        dist_kwargs = {"groups": [[model[0].weight, model[2].weight], [model[0].bias]]}
    elif what == "fp16_compression":
        dist_kwargs = {"compression": hvd.Compression.fp16}
        tol = 2e-3
    elif what == "bpps2":
        dist_kwargs = {"backward_passes_per_step": 2}
        micro = 2
    elif what == "sync_clip_step":
        clip = 0.05
    init = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    if what == "broadcast_state_then_train":
        # every rank starts elsewhere; rank 0's parameters and optimizer state win
        model = make_model(kind, dtype, seed=RANK)
        opt0 = sgd(model)
        if SIZE > 1:
            firsts = COMM.allgather(param_bytes(next(model.parameters())))
            assert len(set(firsts)) == SIZE, "test set-up: ranks must start from different values"
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt0, root_rank=0)
        same_on_all_ranks(model)
        close_to(model, init, 0.0)   # rank 0 started from seed 0, like init
        opt = hvd.DistributedOptimizer(opt0, named_parameters=model.named_parameters())
    else:
        opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                       **dist_kwargs)
    train_dist(case, model, opt, dtype, kind, micro=micro, clip=clip)
    train_ref(case, ref, make_opt(ref), dtype, kind, clip=clip)
    synchronize_device()
    same_on_all_ranks(model)
    moved(model, init)
    close_to(model, ref, tol)


def run_train():
    for case in TRAIN_CASES:
        r.case(case, train_case, case)


# =================================================================================================
def main(argv) -> int:
    if len(argv) != 2 or argv[0] not in MODES or argv[1] not in BACKENDS:
        print(f"usage: gpu_torch_worker.py {{{','.join(MODES)}}} {{{','.join(BACKENDS)}}}",
              file=sys.stderr)
        return 2
    mode, backend = argv
    _setup(backend)
    if mode == "collectives":
        run_collectives()
    else:
        run_train()
    synchronize_device()
    r.write()
    failed = sum(v is not None for v in r.results.values())
    print(f"rank {RANK}: {len(r.results)} cases ran, {failed} failed; shutting down", flush=True)
    hvd.shutdown()   # NCCL communicator destroyed, completion thread joined
    print(f"rank {RANK}: shut down cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
