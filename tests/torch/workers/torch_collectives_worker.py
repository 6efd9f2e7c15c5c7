"""hvdlite.torch's alltoall, reducescatter, grouped ops, join, process sets and Adasum on every
rank of a real MPI job.

Run as ``torch_collectives_worker.py main`` (global process set: alltoall, reducescatter, grouped
ops, join, Adasum) or ``torch_collectives_worker.py psets`` (``hvd.init(process_sets=...)`` with
the sets of :func:`pset_ranks`: every op on a set, plus non-members getting ValueError).

Every rank builds every rank's input from a deterministic seed (the case name and the rank) and
checks the collective's result against its own torch/numpy reference (exact for integers and for
data movement).  Within a case the collectives run on every rank before anything is asserted, so
a failed check on one rank never leaves the others waiting (and the job runs with a stall timeout
and a barrier after every case, see ``torch_cases.synced_reporter``).

Importable without MPI or torch: the case lists (``main_cases``, ``pset_cases``) are used by
tests/torch/test_collectives.py to parametrize.
"""
from __future__ import annotations

import sys
import time

try:                                      # imported by pytest as tests.torch.workers.<this module>
    from . import torch_cases as C
except ImportError:                       # run as a script: its own directory is on sys.path
    import torch_cases as C

NP_MAIN = (2, 3, 4)
NP_PSETS = (2, 3, 4)

OPS = C.OPS
DTYPES = C.DTYPES
FLOAT_DTYPES = C.FLOAT_DTYPES
INT_DTYPES = C.INT_DTYPES


def _op_dtype_pairs():
    return [(op, dt) for op in OPS for dt in DTYPES if not (dt == "bool" and op == "Average")]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# --- case lists: main job ------------------------------------------------------------------------
# alltoall layouts: splits pattern and shape; the async ones are submitted together, then waited
A2A_LAYOUTS = ["even.1d", "even.3d", "uneven_list.1d", "uneven_tensor.3d", "noncontig.2d",
               "async_even.1d", "async_uneven.3d"]
A2A_EXTRA = ["alltoall.splits_tensor_int32", "alltoall.all_to_self", "alltoall.empty_everywhere",
             "alltoall.one_rank_has_no_rows", "alltoall.zero_width_rows",
             "alltoall.named_changing_splits",
             "alltoall.unnamed_repeated", "alltoall.output_is_new_tensor",
             "alltoall.bad_splits_raise", "alltoall.scalar_raises",
             "alltoall.even_indivisible_raises",
             "alltoall.grad.uneven.float32.1d", "alltoall.grad.uneven.float64.3d",
             "alltoall.grad.receiver_empty.float64.2d", "alltoall.grad.even.float32.1d",
             "alltoall.grad.splits_tensor.float64.1d", "alltoall.grad.noncontig.float64",
             "alltoall.grad.round_trip", "alltoall.received_splits_not_differentiable"]

# reducescatter shapes (as a function of the number of ranks n): see rs_shape()
RS_SHAPES = ["even", "uneven", "fewer", "1d", "3d"]
RS_SCALES = [(2.5, 0.25), (0.5, 3.0)]
RS_EXTRA = ["reducescatter.default_op_is_average.int32",
            "reducescatter.default_op_is_average.float64",
            "reducescatter.zero_rows", "reducescatter.zero_width", "reducescatter.one_row",
            "reducescatter.named_repeated", "reducescatter.large",
            "reducescatter.scalar_raises", "reducescatter.adasum_raises",
            "reducescatter.bool_average_raises",
            "reducescatter.grad.Sum.float32.uneven", "reducescatter.grad.Sum.float64.fewer",
            "reducescatter.grad.Average.float32.even", "reducescatter.grad.Average.float64.uneven",
            "reducescatter.grad.Average.float64.3d", "reducescatter.grad.default_op",
            "reducescatter.grad.scaled.Sum", "reducescatter.grad.scaled.Average",
            "reducescatter.grad.min_raises", "reducescatter.grad.chain_allgather",
            "reducescatter.grad.compression_fp16"]

GROUPED_VARIANTS = ["out", "inplace", "async", "async_inplace"]
GROUPED_EXTRA = ["grouped_allreduce.unnamed.Sum", "grouped_allreduce.scaled.Sum",
                 "grouped_allreduce.scaled.Average", "grouped_allreduce.average_flag_false",
                 "grouped_allreduce.average_flag_true", "grouped_allreduce.repeated_named",
                 "grouped_allreduce.repeated_named_shape_change",
                 "grouped_allreduce.many_members", "grouped_allreduce.single_member",
                 "grouped_allreduce.large_members",
                 "grouped_allreduce.noncontig_out", "grouped_allreduce.noncontig_inplace_raises",
                 "grouped.empty_lists", "grouped_allreduce.poll_then_synchronize",
                 "grouped_allreduce.grad.Sum", "grouped_allreduce.grad.Average",
                 "grouped_allreduce.grad.scaled", "grouped_allreduce.grad.unused_output",
                 "grouped_allreduce.grad.partial_requires_grad",
                 "grouped_allreduce.grad.min_raises",
                 "grouped_allgather.grad.mixed", "grouped_allgather.grad.unused_output",
                 "grouped_allgather.grad.compared_with_allgather",
                 "grouped_reducescatter.grad.Sum", "grouped_reducescatter.grad.Average",
                 "grouped_reducescatter.grad.scaled", "grouped_reducescatter.grad.default_op",
                 "grouped_reducescatter.grad.min_raises",
                 "grouped_allgather.out", "grouped_allgather.async",
                 "grouped_allgather.repeated_named_changing_rows",
                 "grouped_reducescatter.scaled.Average",
                 "grouped_allgather.noncontig", "grouped_reducescatter.noncontig",
                 "grouped_reducescatter.scalar_raises",
                 "grouped_allreduce.same_name_different_sizes",
                 "grouped_mismatch.allreduce_shape.async", "grouped_mismatch.allreduce_shape.sync",
                 "grouped_mismatch.allreduce_dtype.async",
                 "grouped_mismatch.allreduce_inplace_shape.async",
                 "grouped_mismatch.allgather_trailing.async",
                 "grouped_mismatch.reducescatter_shape.async",
                 "grouped_mismatch.then_same_name_ok"]

JOIN_CASES = ["join.optimizer_uneven_steps", "join.optimizer_reverse_steps",
              "join.optimizer_idle_first_epoch",
              "join.allreduce_while_joined", "join.cached_ops_while_joined",
              "join.unsupported_while_joined", "join.immediately_everywhere"]

ADASUM_SHAPES = ["vec", "mat", "cube", "one"]


def adasum_cases(size: int) -> list[str]:
    if not _pow2(size):
        return ["adasum.non_power_of_two_raises", "adasum.grouped_non_power_of_two_raises"]
    return ([f"adasum.{dt}.{sh}" for dt in FLOAT_DTYPES for sh in ADASUM_SHAPES]
            + ["adasum.inplace.float32", "adasum.async.float64", "adasum.async_many.float32",
               "adasum.large.float32", "adasum.scaled.float64",
               "adasum.grouped.float32", "adasum.grouped.mixed_dtypes",
               "adasum.identical_inputs", "adasum.orthogonal_inputs", "adasum.zero_on_one_rank",
               "adasum.int32_raises", "adasum.noncontig.float64", "adasum.grad_raises"])


def alltoall_cases(size: int) -> list[str]:
    return [f"alltoall.{layout}.{dt}" for layout in A2A_LAYOUTS for dt in DTYPES] + A2A_EXTRA


def reducescatter_cases(size: int) -> list[str]:
    return ([f"reducescatter.{op}.{dt}.{sh}" for op, dt in _op_dtype_pairs() for sh in RS_SHAPES]
            + [f"reducescatter.async.{op}.{dt}" for op in ("Sum", "Average", "Max")
               for dt in DTYPES if not (dt == "bool" and op == "Average")]
            + [f"reducescatter.scaled.{op}.{dt}.{i}" for op in ("Sum", "Average")
               for dt in DTYPES if dt != "bool" for i in range(len(RS_SCALES))]
            + [f"reducescatter.noncontig.{dt}" for dt in DTYPES]
            + RS_EXTRA)


def grouped_cases(size: int) -> list[str]:
    return ([f"grouped_allreduce.{v}.{op}" for v in GROUPED_VARIANTS for op in OPS]
            + [f"grouped_reducescatter.{v}.{op}" for v in ("out", "async") for op in OPS]
            + GROUPED_EXTRA)


# tensors every torch op rejects up front (as allreduce/allgather/broadcast do): dtypes the
# adapter does not support, sparse and non-CPU tensors (UnsupportedDtypeError), non-tensors
# (TypeError)
VALIDATION_OPS = ["alltoall", "reducescatter", "grouped_allreduce", "grouped_allgather",
                  "grouped_reducescatter"]
VALIDATION_KINDS = ["uint16", "uint32", "sparse", "meta_device", "not_a_tensor"]


def validation_cases(size: int) -> list[str]:
    return [f"validation.{op}.{kind}" for op in VALIDATION_OPS for kind in VALIDATION_KINDS]


def main_cases(size: int) -> list[str]:
    return (alltoall_cases(size) + reducescatter_cases(size) + grouped_cases(size)
            + JOIN_CASES + adasum_cases(size) + validation_cases(size))


# --- case lists: process-set job -----------------------------------------------------------------
def pset_ranks(size: int) -> list[list[int]]:
    """The sets every rank passes to hvd.init (a set of all ranks would duplicate the global
    one, so np=2 has single-rank sets only)."""
    return {2: [[0], [1]],
            3: [[0, 1], [0, 2], [1, 2]],
            4: [[0, 1], [1, 3], [0, 2, 3], [2]]}[size]


PSET_OPS = ([f"allreduce.{op}.{dt}" for op in OPS
             for dt in ("int32", "float32", "bfloat16", "bool")
             if not (dt == "bool" and op == "Average")]
            + ["allreduce_inplace.Sum.float64", "allreduce_async.Average.float32",
               "allreduce_scaled.Average.float64",
               "allgather.int64", "allgather.float32", "allgather.bool", "allgather_async.int16",
               "alltoall.uneven.int32", "alltoall.uneven.float64", "alltoall.even.bfloat16",
               "alltoall_async.uneven.float32",
               "reducescatter.Sum.int32", "reducescatter.Average.float32",
               "reducescatter.Max.float64", "reducescatter.Average.int64",
               "reducescatter_async.Sum.float64",
               "grouped_allreduce.Sum", "grouped_allreduce.Average", "grouped_allreduce_.Max",
               "grouped_allreduce_async.Sum", "grouped_allgather.mixed",
               "grouped_reducescatter.Sum",
               "grad.allreduce.Sum", "grad.allreduce.Average", "grad.allgather",
               "grad.broadcast", "grad.alltoall", "grad.reducescatter.Average",
               "grad.grouped_allreduce.Sum", "grad.grouped_allgather",
               "grad.grouped_reducescatter.Sum",
               "adasum", "broadcast.nonmember_root_raises", "unnamed_ops", "join",
               "interleaved_with_global", "size_rank_included"])


def pset_cases(size: int) -> list[str]:
    out = []
    for i, ranks in enumerate(pset_ranks(size)):
        out += [f"pset{i}.{op}" for op in PSET_OPS]
        out += [f"pset{i}.broadcast.root{g}" for g in ranks]
        out += [f"pset{i}.broadcast_inplace.root{g}" for g in ranks]
    return out


# =================================================================================================
# Everything below runs under MPI only (torch and hvdlite are imported by main()).
# =================================================================================================
def _setup(mode: str) -> None:
    global torch, np, hvd, COMM, RANK, SIZE, r, F64, I64, OP, SETS, SET_RANKS, ada
    import numpy as np
    import torch
    torch.set_num_threads(1)
    import os
    import hvdlite.torch as hvd
    from tests.core.workers import core_adasum_kernel_worker as ada   # numpy Adasum reference

    # The size before init() from the launcher's variables (mpiexec's or torchrun's): under
    # torchrun, hvd.init() forms the MPI world, so MPI must not be initialised before it.
    launched = int(os.environ.get("PMI_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    SET_RANKS = pset_ranks(launched) if mode == "psets" else []
    SETS = [hvd.ProcessSet(ranks) for ranks in SET_RANKS]
    hvd.init(process_sets=SETS if mode == "psets" else None)
    from mpi4py import MPI
    COMM = MPI.COMM_WORLD
    RANK, SIZE = hvd.rank(), hvd.size()
    r = C.synced_reporter(RANK, COMM)
    F64, I64 = torch.float64, torch.int64
    OP = {name: getattr(hvd, name) for name in OPS}


# --- helpers -------------------------------------------------------------------------------------
def tdt(name):
    return getattr(torch, name)


def describe(t):
    return f"{tuple(t.shape)} {t.dtype}: {t.detach().flatten()[:12].tolist()}"


def make_input(case, k, dt, op, shape, small=False):
    """Rank k's input: torch_cases.op_input, except integer Product inputs come from [-2, 2]
    (so a product over 4 ranks fits int8/uint8)."""
    if op == "Product" and dt in INT_DTYPES:
        g = torch.Generator().manual_seed(C.seed_of(case, k))
        lo = 0 if dt == "uint8" else -2
        return torch.randint(lo, 3, tuple(shape), generator=g).to(tdt(dt))
    return C.op_input(case, k, dt, op, tuple(shape), small=small)


def randn(case, k, shape, dtype=None, extra=0):
    g = torch.Generator().manual_seed(C.seed_of(case, k, extra))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype or F64)


def check_values(res, expected, dt, exact=True, what="result"):
    """``expected`` in the wide dtype (int64 for integers and bool, float64 for floats)."""
    assert isinstance(res, torch.Tensor), f"{what} is a {type(res).__name__}"
    assert res.dtype == tdt(dt), f"{what} dtype {res.dtype}, expected {dt}"
    assert tuple(res.shape) == tuple(expected.shape), \
        f"{what} shape {tuple(res.shape)}, expected {tuple(expected.shape)}"
    if dt in FLOAT_DTYPES:
        got = res.detach().to(F64)
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
        got = res.to(I64)
        assert torch.equal(got, expected), f"{what} {describe(got)} != {describe(expected)}"


def exact_for(op, dt):
    return not (op == "Average" and dt in FLOAT_DTYPES)


def bits(t):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def check_same(res, expected, what="result"):
    """Bitwise equality (data movement): same dtype, shape and bytes."""
    assert isinstance(res, torch.Tensor), f"{what} is a {type(res).__name__}"
    assert res.dtype == expected.dtype, f"{what} dtype {res.dtype}, expected {expected.dtype}"
    assert tuple(res.shape) == tuple(expected.shape), \
        f"{what} shape {tuple(res.shape)}, expected {tuple(expected.shape)}"
    assert torch.equal(bits(res), bits(expected)), \
        f"{what} {describe(res)} != {describe(expected)}"


def close(a, b, what, tol=1e-6):
    assert a is not None, f"{what} is None"
    assert tuple(a.shape) == tuple(b.shape), f"{what} shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a.detach().to(F64), b.detach().to(F64), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


attempt, expect_raises = C.attempt, C.expect_raises   # shared with the other torch workers


def split_rows(rows, parts):
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def my_rows(full, parts, me):
    rows = split_rows(full.shape[0], parts)
    start = sum(rows[:me])
    return full[start:start + rows[me]]


def follow_up(case, process_set=None):
    """A plain op after an error works (the engine is still healthy)."""
    kwargs = {} if process_set is None else {"process_set": process_set}
    n = SIZE if process_set is None else process_set.size()
    res = hvd.allreduce(torch.tensor([1.0, 2.0]), op=hvd.Sum, name=case + ".followup", **kwargs)
    assert res.tolist() == [float(n), 2.0 * n], f"follow-up allreduce gave {res.tolist()}"


def run_async_batch(cases, submit, check):
    """Submit every case's async op before waiting for any; report each case separately."""
    pending = {}
    for case in cases:
        pending[case] = attempt(submit, case)
    for case in cases:
        item, exc = pending[case]

        def run(item=item, exc=exc):
            if exc is not None:
                raise exc
            check(*item)
        r.case(case, run)


def a2a_splits(case, n, kind):
    """S[k][j]: rows rank k sends to rank j (deterministic from the case name)."""
    if kind == "even":
        return [[2] * n for _ in range(n)]
    g = torch.Generator().manual_seed(C.seed_of(case, "splits"))
    lo = 1 if kind == "min1" else 0
    S = torch.randint(lo, 4, (n, n), generator=g)
    if kind == "sender_empty":
        S[1 % n, :] = 0                  # rank 1 sends nothing
        S[0, :] = S[0, :].clamp(min=1)   # rank 0 sends something everywhere
    elif kind == "receiver_empty":
        S[:, n - 1] = 0                  # the last rank receives nothing
        S[:, 0] = S[:, 0].clamp(min=1)
    return S.tolist()


def a2a_expected(inputs, S, me):
    """Rows received by ``me``: from every rank k (in order), its block for ``me``."""
    parts = []
    for k, x in enumerate(inputs):
        off = sum(S[k][:me])
        parts.append(x[off:off + S[k][me]])
    return torch.cat(parts)


def a2a_grad_expected(ws, S, me):
    """d/dx_me of sum_j <w_j, out_j>: the rows ``me`` sent to j sit in out_j after the rows
    of the ranks before ``me``."""
    parts = []
    for j, w in enumerate(ws):
        pos = sum(S[k][j] for k in range(me))
        parts.append(w[pos:pos + S[me][j]])
    return torch.cat(parts)


# =================================================================================================
# alltoall
# =================================================================================================
def a2a_layout(case):
    _, layout, dim, dt = case.split(".")
    kind = {"even": "even", "uneven_list": "sender_empty", "uneven_tensor": "receiver_empty",
            "noncontig": "min1", "async_even": "even", "async_uneven": "sender_empty"}[layout]
    trailing = {"1d": (), "2d": (3,), "3d": (2, 3)}[dim]
    S = a2a_splits(case, SIZE, kind)
    if layout == "noncontig":
        bases = [C.op_input(case, k, dt, "Sum", (3, sum(S[k]))) for k in range(SIZE)]
        inputs = [b.t() for b in bases]
    else:
        bases = None
        inputs = [C.op_input(case, k, dt, "Sum", (sum(S[k]),) + trailing) for k in range(SIZE)]
    return layout, dt, S, bases, inputs


def alltoall_sync(case):
    layout, _, S, bases, inputs = a2a_layout(case)
    if bases is not None:
        base = bases[RANK].clone()
        x = base.t()
    else:
        x = inputs[RANK].clone()
    if layout == "even":
        res, exc = attempt(hvd.alltoall, x, name=case)
    elif layout == "uneven_tensor":
        res, exc = attempt(hvd.alltoall, x, splits=torch.tensor(S[RANK]), name=case)
    else:
        res, exc = attempt(hvd.alltoall, x, splits=S[RANK], name=case)
    if exc is not None:
        raise exc
    expected = a2a_expected(inputs, S, RANK)
    if layout == "even":
        assert isinstance(res, torch.Tensor), \
            f"alltoall without splits returned a {type(res).__name__}, not the output tensor"
        out = res
    else:
        assert isinstance(res, tuple) and len(res) == 2, \
            f"alltoall with splits returned {type(res).__name__}, not (output, received_splits)"
        out, received = res
        assert isinstance(received, torch.Tensor) and received.dtype == torch.int32, \
            f"received_splits is {type(received).__name__} {getattr(received, 'dtype', '')}"
        assert received.tolist() == [S[k][RANK] for k in range(SIZE)], \
            f"received_splits {received.tolist()} != {[S[k][RANK] for k in range(SIZE)]}"
    check_same(out, expected)
    if bases is not None:
        assert not x.is_contiguous(), "test bug: the input view is contiguous"
        check_same(base, bases[RANK], "non-contiguous input's storage")
    else:
        check_same(x, inputs[RANK], "input")


def alltoall_async_submit(case):
    layout, _, S, _, inputs = a2a_layout(case)
    x = inputs[RANK].clone()
    splits = None if layout == "async_even" else S[RANK]
    return (x, hvd.alltoall_async(x, splits=splits, name=case), (S, inputs))


def alltoall_async_check(x, handle, info):
    S, inputs = info
    res = hvd.synchronize(handle)
    assert hvd.poll(handle) is True
    assert isinstance(res, tuple) and len(res) == 2, \
        f"synchronize(alltoall_async) returned {type(res).__name__}, not (output, splits)"
    out, received = res
    check_same(out, a2a_expected(inputs, S, RANK))
    assert received.dtype == torch.int32, received.dtype
    assert received.tolist() == [S[k][RANK] for k in range(SIZE)], received.tolist()
    check_same(x, inputs[RANK], "input")


def a2a_splits_tensor_int32(case):
    S = a2a_splits(case, SIZE, "sender_empty")
    inputs = [C.op_input(case, k, "int64", "Sum", (sum(S[k]), 2)) for k in range(SIZE)]
    res, exc = attempt(hvd.alltoall, inputs[RANK].clone(),
                       splits=torch.tensor(S[RANK], dtype=torch.int32), name=case)
    if exc is not None:
        raise exc
    out, received = res
    check_same(out, a2a_expected(inputs, S, RANK))
    assert received.tolist() == [S[k][RANK] for k in range(SIZE)]


def a2a_all_to_self(case):
    S = [[3 if j == k else 0 for j in range(SIZE)] for k in range(SIZE)]
    inputs = [C.op_input(case, k, "float32", "Sum", (3, 2)) for k in range(SIZE)]
    out, received = hvd.alltoall(inputs[RANK].clone(), splits=S[RANK], name=case)
    check_same(out, inputs[RANK])
    assert received.tolist() == S[RANK], received.tolist()


def a2a_empty_everywhere(case):
    x = torch.zeros((0, 3), dtype=torch.float64)
    out, received = hvd.alltoall(x, splits=[0] * SIZE, name=case)
    check_same(out, x)
    assert received.tolist() == [0] * SIZE
    res = hvd.alltoall(torch.zeros((0,), dtype=torch.int32), name=case + ".even")
    check_same(res, torch.zeros((0,), dtype=torch.int32), "even split of 0 rows")


def a2a_one_rank_has_no_rows(case):
    """The last rank has no rows at all (a (0, 2) input), the others send to everyone."""
    S = [[0] * SIZE if k == SIZE - 1 else [1 + (k + j) % 2 for j in range(SIZE)]
         for k in range(SIZE)]
    inputs = [C.op_input(case, k, "int16", "Sum", (sum(S[k]), 2)) for k in range(SIZE)]
    out, received = hvd.alltoall(inputs[RANK].clone(), splits=S[RANK], name=case)
    check_same(out, a2a_expected(inputs, S, RANK))
    assert received.tolist() == [S[k][RANK] for k in range(SIZE)]


def a2a_zero_width_rows(case):
    """Rows of zero elements ((R, 0) inputs): the row counts still travel."""
    S = a2a_splits(case, SIZE, "sender_empty")
    x = torch.zeros((sum(S[RANK]), 0), dtype=torch.float32)
    res, exc = attempt(hvd.alltoall, x, splits=S[RANK], name=case)
    if exc is not None:
        raise exc
    out, received = res
    recv = [S[k][RANK] for k in range(SIZE)]
    check_same(out, torch.zeros((sum(recv), 0), dtype=torch.float32))
    assert received.tolist() == recv, received.tolist()


def a2a_named_changing_splits(case):
    """The same name four times; only rank 0 changes its splits at iteration 2 (a cached
    response with stale splits must not be reused)."""
    results, failures = [], []
    for it in range(4):
        S = [[1 + (k + j + (it if (k == 0 and it >= 2) else 0)) % 3 for j in range(SIZE)]
             for k in range(SIZE)]
        inputs = [C.op_input(case, k, "int32", "Sum", (sum(S[k]), 2), small=bool(it % 2))
                  for k in range(SIZE)]
        res, exc = attempt(hvd.alltoall, inputs[RANK].clone(), splits=S[RANK], name=case)
        results.append((res, exc, S, inputs))
    for it, (res, exc, S, inputs) in enumerate(results):
        if exc is not None:
            failures.append(f"iteration {it}: {type(exc).__name__}: {exc}")
            continue
        try:
            check_same(res[0], a2a_expected(inputs, S, RANK), f"iteration {it} output")
            assert res[1].tolist() == [S[k][RANK] for k in range(SIZE)], \
                f"iteration {it} received_splits {res[1].tolist()}"
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "; ".join(failures)


def a2a_unnamed_repeated(case):
    outs = []
    for it in range(3):
        S = a2a_splits(f"{case}.{it}", SIZE, "sender_empty")
        inputs = [C.op_input(case, k, "float64", "Sum", (sum(S[k]),), small=bool(it))
                  for k in range(SIZE)]
        outs.append((attempt(hvd.alltoall, inputs[RANK].clone(), splits=S[RANK]), S, inputs))
    for it, ((res, exc), S, inputs) in enumerate(outs):
        if exc is not None:
            raise exc
        check_same(res[0], a2a_expected(inputs, S, RANK), f"iteration {it}")


def a2a_output_is_new_tensor(case):
    x = torch.arange(2 * SIZE, dtype=torch.float32) + 100 * RANK
    before = x.clone()
    out = hvd.alltoall(x, name=case)
    assert out.data_ptr() != x.data_ptr(), "alltoall output shares the input's memory"
    check_same(x, before, "input")
    out += 1    # the output is writable and independent
    check_same(x, before, "input after writing to the output")


def a2a_bad_splits(case):
    x = torch.arange(3 * SIZE, dtype=torch.float32)
    bad = [[3 * SIZE] + [0] * (SIZE - 2),           # wrong length
           [1] * SIZE,                              # wrong sum
           [-1, 3 * SIZE + 1] + [0] * (SIZE - 2)]   # negative entry
    for splits in bad:
        expect_raises(lambda s=splits: hvd.alltoall(x, splits=s, name=case), ValueError,
                      "splits")
    follow_up(case)


def a2a_scalar_raises(case):
    expect_raises(lambda: hvd.alltoall(torch.tensor(1.0), name=case), ValueError, "scalar")
    follow_up(case)


def a2a_even_indivisible(case):
    x = torch.arange(SIZE + 1, dtype=torch.float32)
    expect_raises(lambda: hvd.alltoall(x, name=case), ValueError, "divisible")
    follow_up(case)


def a2a_grad(case):
    parts = case.split(".")
    kind, dt, dim = parts[2], parts[3] if len(parts) > 3 else "float64", \
        parts[4] if len(parts) > 4 else "2d"
    if kind == "round_trip":
        return a2a_grad_round_trip(case)
    if kind == "noncontig":
        dim = "2d"
    trailing = {"1d": (), "2d": (3,), "3d": (2, 2)}[dim]
    S = a2a_splits(case, SIZE, {"uneven": "sender_empty", "even": "even",
                                "receiver_empty": "receiver_empty", "splits_tensor": "min1",
                                "noncontig": "min1"}[kind])
    d = tdt(dt)
    xs = [randn(case, k, (sum(S[k]),) + trailing, d) for k in range(SIZE)]
    recv_rows = [sum(S[k][j] for k in range(SIZE)) for j in range(SIZE)]
    ws = [randn(case, j, (recv_rows[j],) + trailing, d, extra=1) for j in range(SIZE)]
    if kind == "noncontig":
        leaf = xs[RANK].t().contiguous().clone().requires_grad_()   # (3, R) leaf
        x = leaf.t()
    else:
        leaf = x = xs[RANK].clone().requires_grad_()

    def run():
        if kind == "even":
            out = hvd.alltoall(x, name=case)
        elif kind == "splits_tensor":
            out, _ = hvd.alltoall(x, splits=torch.tensor(S[RANK]), name=case)
        else:
            out, _ = hvd.alltoall(x, splits=S[RANK], name=case)
        (out * ws[RANK]).sum().backward()
        return out
    out, exc = attempt(run)
    if exc is not None:
        raise exc
    check_same(out.detach(), a2a_expected(xs, S, RANK), "forward")
    assert out.requires_grad
    expected = a2a_grad_expected(ws, S, RANK)
    grad = leaf.grad.t() if kind == "noncontig" else leaf.grad
    assert grad is not None, "no gradient reached the input"
    assert grad.dtype == d, grad.dtype
    check_same(grad, expected, "x.grad")


def a2a_grad_round_trip(case):
    """alltoall there and back (received_splits as the return splits) is the identity; so is
    its gradient."""
    S = a2a_splits(case, SIZE, "sender_empty")
    xs = [randn(case, k, (sum(S[k]), 2)) for k in range(SIZE)]
    ws = [randn(case, k, (sum(S[k]), 2), extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()

    def run():
        mid, received = hvd.alltoall(x * 2.0, splits=S[RANK], name=case + ".there")
        back, back_received = hvd.alltoall(mid, splits=received, name=case + ".back")
        (back * ws[RANK]).sum().backward()
        return back, back_received
    res, exc = attempt(run)
    if exc is not None:
        raise exc
    back, back_received = res
    check_same(back.detach(), xs[RANK] * 2.0, "round trip")
    assert back_received.tolist() == S[RANK], back_received.tolist()
    check_same(x.grad, ws[RANK] * 2.0, "x.grad")


def a2a_received_not_differentiable(case):
    x = randn(case, RANK, (2 * SIZE,)).requires_grad_()
    out, received = hvd.alltoall(x, splits=[2] * SIZE, name=case)
    assert out.requires_grad
    assert not received.requires_grad, "received_splits requires grad"
    assert received.dtype == torch.int32


A2A_FUNCS = {
    "alltoall.splits_tensor_int32": a2a_splits_tensor_int32,
    "alltoall.all_to_self": a2a_all_to_self,
    "alltoall.empty_everywhere": a2a_empty_everywhere,
    "alltoall.one_rank_has_no_rows": a2a_one_rank_has_no_rows,
    "alltoall.zero_width_rows": a2a_zero_width_rows,
    "alltoall.named_changing_splits": a2a_named_changing_splits,
    "alltoall.unnamed_repeated": a2a_unnamed_repeated,
    "alltoall.output_is_new_tensor": a2a_output_is_new_tensor,
    "alltoall.bad_splits_raise": a2a_bad_splits,
    "alltoall.scalar_raises": a2a_scalar_raises,
    "alltoall.even_indivisible_raises": a2a_even_indivisible,
    "alltoall.received_splits_not_differentiable": a2a_received_not_differentiable,
}


def run_alltoall():
    cases = alltoall_cases(SIZE)
    is_async = [c for c in cases if c.split(".")[1].startswith("async")]
    for case in cases:
        if case in is_async:
            continue
        if case in A2A_FUNCS:
            r.case(case, A2A_FUNCS[case], case)
        elif case.startswith("alltoall.grad."):
            r.case(case, a2a_grad, case)
        else:
            r.case(case, alltoall_sync, case)
    run_async_batch(is_async, alltoall_async_submit, alltoall_async_check)


# =================================================================================================
# reducescatter
# =================================================================================================
def rs_shape(key, n):
    return {"even": (2 * n, 3), "uneven": (3 * n - 1, 2), "fewer": (n - 1, 3),
            "1d": (2 * n + 1,), "3d": (n + 1, 2, 2)}[key]


def rs_case(case):
    _, op, dt, sh = case.split(".")
    inputs = [make_input(case, k, dt, op, rs_shape(sh, SIZE)) for k in range(SIZE)]
    x = inputs[RANK].clone()
    res, exc = attempt(hvd.reducescatter, x, op=OP[op], name=case)
    if exc is not None:
        raise exc
    expected = my_rows(C.reduce_reference(inputs, op, dt), SIZE, RANK)
    check_values(res, expected, dt, exact_for(op, dt))
    check_same(x, inputs[RANK], "input")


def rs_async_submit(case):
    _, _, op, dt = case.split(".")
    inputs = [make_input(case, k, dt, op, rs_shape("uneven", SIZE)) for k in range(SIZE)]
    x = inputs[RANK].clone()
    return x, hvd.reducescatter_async(x, op=OP[op], name=case), (op, dt, inputs)


def rs_async_check(x, handle, info):
    op, dt, inputs = info
    res = hvd.synchronize(handle)
    assert hvd.poll(handle)
    check_values(res, my_rows(C.reduce_reference(inputs, op, dt), SIZE, RANK), dt,
                 exact_for(op, dt))
    check_same(x, inputs[RANK], "input")


def rs_scaled(case):
    _, _, op, dt, i = case.split(".")
    pre, post = RS_SCALES[int(i)]
    shape = rs_shape("uneven", SIZE)
    inputs = [make_input(case, k, dt, "Sum", shape, small=True) for k in range(SIZE)]
    res, exc = attempt(hvd.reducescatter, inputs[RANK].clone(), op=OP[op], name=case,
                       prescale_factor=pre, postscale_factor=post)
    if exc is not None:
        raise exc
    factor = post * (1.0 / SIZE) if op == "Average" else post
    if dt in FLOAT_DTYPES:
        full = sum(t.to(F64) * pre for t in inputs) * factor
    else:   # integers: each scaling in float64, truncated toward zero
        pres = [(t.to(F64) * pre).trunc().to(I64) for t in inputs]
        full = (sum(pres).to(F64) * factor).trunc().to(I64)
    check_values(res, my_rows(full, SIZE, RANK), dt, exact=dt not in FLOAT_DTYPES)


def rs_noncontig(case):
    dt = case.split(".")[2]
    R = 3 * SIZE - 1
    bases = [C.op_input(case, k, dt, "Sum", (3, R)) for k in range(SIZE)]
    base = bases[RANK].clone()
    x = base.t()
    res, exc = attempt(hvd.reducescatter, x, op=hvd.Sum, name=case)
    if exc is not None:
        raise exc
    assert not x.is_contiguous()
    expected = my_rows(C.reduce_reference([b.t() for b in bases], "Sum", dt), SIZE, RANK)
    check_values(res, expected, dt)
    check_same(base, bases[RANK], "input storage")


def rs_default_op(case):
    dt = case.split(".")[-1]
    inputs = [make_input(case, k, dt, "Sum", (2 * SIZE + 1, 2)) for k in range(SIZE)]
    res, exc = attempt(hvd.reducescatter, inputs[RANK].clone(), name=case)
    if exc is not None:
        raise exc
    check_values(res, my_rows(C.reduce_reference(inputs, "Average", dt), SIZE, RANK), dt,
                 exact_for("Average", dt))


def rs_zero_rows(case):
    x = torch.zeros((0, 3), dtype=torch.float32)
    res = hvd.reducescatter(x, op=hvd.Sum, name=case)
    check_same(res, torch.zeros((0, 3), dtype=torch.float32))


def rs_zero_width(case):
    res = hvd.reducescatter(torch.zeros((2 * SIZE + 1, 0), dtype=torch.int32), op=hvd.Sum,
                            name=case)
    check_same(res, torch.zeros((split_rows(2 * SIZE + 1, SIZE)[RANK], 0), dtype=torch.int32))


def rs_large(case):
    """Over a MiB per rank (float32), uneven rows."""
    shape = (3 * SIZE + 1, 100_003)
    inputs = [make_input(case, k, "float32", "Sum", shape) for k in range(SIZE)]
    res, exc = attempt(hvd.reducescatter, inputs[RANK], op=hvd.Sum, name=case)
    if exc is not None:
        raise exc
    check_values(res, my_rows(C.reduce_reference(inputs, "Sum", "float32"), SIZE, RANK),
                 "float32")


def rs_one_row(case):
    inputs = [make_input(case, k, "int64", "Sum", (1, 4)) for k in range(SIZE)]
    res = hvd.reducescatter(inputs[RANK].clone(), op=hvd.Sum, name=case)
    full = C.reduce_reference(inputs, "Sum", "int64")
    expected = full if RANK == 0 else full[:0]
    check_values(res, expected, "int64")


def rs_named_repeated(case):
    """One name four times; every rank changes the number of rows at iteration 2."""
    outs = []
    for it in range(4):
        dt = "float32"
        rows = SIZE + 1 if it < 2 else 2 * SIZE - 1
        inputs = [make_input(f"{case}.{it}", k, dt, "Sum", (rows, 3)) for k in range(SIZE)]
        outs.append((attempt(hvd.reducescatter, inputs[RANK].clone(), op=hvd.Sum, name=case),
                     inputs))
    for it, ((res, exc), inputs) in enumerate(outs):
        if exc is not None:
            raise exc
        check_values(res, my_rows(C.reduce_reference(inputs, "Sum", "float32"), SIZE, RANK),
                     "float32", what=f"iteration {it}")


def rs_scalar_raises(case):
    expect_raises(lambda: hvd.reducescatter(torch.tensor(3.0), name=case), ValueError, "scalar")
    follow_up(case)


def rs_adasum_raises(case):
    expect_raises(lambda: hvd.reducescatter(torch.ones(4, 2), op=hvd.Adasum, name=case),
                  ValueError, "Adasum")
    follow_up(case)


def rs_bool_average_raises(case):
    expect_raises(lambda: hvd.reducescatter(torch.ones(4, dtype=torch.bool), name=case),
                  hvd.UnsupportedDtypeError, "bool")
    follow_up(case)


def rs_grad(case):
    parts = case.split(".")
    kind = parts[2]
    if kind == "min_raises":
        return rs_grad_min_raises(case)
    if kind == "chain_allgather":
        return rs_grad_chain(case)
    if kind == "default_op":
        op, dt, sh, pre, post = "Average", "float64", "uneven", 1.0, 1.0
    elif kind == "scaled":
        op, dt, sh, pre, post = parts[3], "float64", "uneven", 2.0, 0.75
    else:
        op, dt, sh, pre, post = kind, parts[3], parts[4], 1.0, 1.0
    d = tdt(dt)
    shape = rs_shape(sh, SIZE)
    rows = split_rows(shape[0], SIZE)
    xs = [randn(case, k, shape, d) for k in range(SIZE)]
    ws = [randn(case, j, (rows[j],) + shape[1:], d, extra=1) for j in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    kwargs = {} if kind == "default_op" else {"op": OP[op]}

    def run():
        y = hvd.reducescatter(x, name=case, prescale_factor=pre, postscale_factor=post, **kwargs)
        (y * ws[RANK]).sum().backward()
        return y
    y, exc = attempt(run)
    if exc is not None:
        raise exc
    div = SIZE if op == "Average" else 1
    tol = 1e-5 if dt == "float32" else 1e-12
    close(y, my_rows(sum(t.to(F64) for t in xs) * pre * post / div, SIZE, RANK), "forward", tol)
    assert x.grad is not None and x.grad.dtype == d
    # Horovod's gradient: every rank's upstream rows gathered, times the set's size for Sum
    # (and, for Average, not divided by it), times prescale and postscale
    times = SIZE if op == "Sum" else 1
    close(x.grad, torch.cat([w.to(F64) for w in ws]) * pre * post * times, "x.grad", tol)


def rs_grad_min_raises(case):
    x = randn(case, RANK, (SIZE, 2)).requires_grad_()
    y = hvd.reducescatter(x, op=hvd.Min, name=case)
    expect_raises(lambda: y.sum().backward(), RuntimeError, "Min")
    follow_up(case)


def rs_grad_chain(case):
    """allgather(reducescatter(x, Sum)) == allreduce(x, Sum).  With Horovod's gradients
    (allgather's averages the upstream gradients, reducescatter's Sum multiplies by the size)
    its gradient is the summed w, as allreduce(Sum)'s."""
    xs = [randn(case, k, (2 * SIZE + 1, 2)) for k in range(SIZE)]
    ws = [randn(case, k, (2 * SIZE + 1, 2), extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()

    def run():
        y = hvd.allgather(hvd.reducescatter(x, op=hvd.Sum, name=case + ".rs"), name=case + ".ag")
        (y * ws[RANK]).sum().backward()
        return y
    y, exc = attempt(run)
    if exc is not None:
        raise exc
    close(y, sum(xs), "forward", 1e-12)
    close(x.grad, sum(ws), "x.grad", 1e-12)


RS_FUNCS = {
    "reducescatter.default_op_is_average.int32": rs_default_op,
    "reducescatter.default_op_is_average.float64": rs_default_op,
    "reducescatter.zero_rows": rs_zero_rows,
    "reducescatter.one_row": rs_one_row,
    "reducescatter.zero_width": rs_zero_width,
    "reducescatter.large": rs_large,
    "reducescatter.named_repeated": rs_named_repeated,
    "reducescatter.scalar_raises": rs_scalar_raises,
    "reducescatter.adasum_raises": rs_adasum_raises,
    "reducescatter.bool_average_raises": rs_bool_average_raises,
    "reducescatter.grad.compression_fp16": lambda c: rs_grad_compressed(c),
}


def run_reducescatter():
    cases = reducescatter_cases(SIZE)
    for case in cases:
        kind = case.split(".")[1]
        if kind == "async":
            continue
        if case in RS_FUNCS:
            r.case(case, RS_FUNCS[case], case)
        elif kind == "grad":
            r.case(case, rs_grad, case)
        elif kind == "scaled":
            r.case(case, rs_scaled, case)
        elif kind == "noncontig":
            r.case(case, rs_noncontig, case)
        else:
            r.case(case, rs_case, case)
    run_async_batch([c for c in cases if c.split(".")[1] == "async"], rs_async_submit,
                    rs_async_check)


# =================================================================================================
# grouped ops
# =================================================================================================
# (dtype, shape): mixed dtypes and shapes, a scalar and an empty member
GROUP_MEMBERS = [("int32", (5,)), ("float32", (2, 3)), ("float64", ()), ("int64", (0,)),
                 ("bfloat16", (4,)), ("float16", (3, 2)), ("uint8", (3,)), ("int8", (2, 2)),
                 ("int16", (1,)), ("float32", (7,)), ("bool", (4,))]


def group_members(op):
    return [(dt, sh) for dt, sh in GROUP_MEMBERS if not (dt == "bool" and op == "Average")]


def group_inputs(case, op, members=None, small=False):
    members = members or group_members(op)
    return members, [[make_input(f"{case}.{i}", k, dt, op, sh, small=small)
                      for i, (dt, sh) in enumerate(members)] for k in range(SIZE)]


def check_group(res, members, inputs, op, what="member", pick=None):
    """``inputs[k][i]``: rank k's member i.  ``pick`` maps a full reduction to this rank's part
    (reducescatter)."""
    assert isinstance(res, list), f"result is a {type(res).__name__}, not a list"
    assert len(res) == len(members), f"{len(res)} results for {len(members)} members"
    for i, (dt, _) in enumerate(members):
        expected = C.reduce_reference([inputs[k][i] for k in range(len(inputs))], op, dt)
        if pick is not None:
            expected = pick(expected)
        check_values(res[i], expected, dt, exact_for(op, dt), what=f"{what} {i} ({dt})")


def grouped_allreduce_variant(case):
    _, variant, op = case.split(".")
    members, inputs = group_inputs(case, op)
    xs = [t.clone() for t in inputs[RANK]]
    if variant == "out":
        res, exc = attempt(hvd.grouped_allreduce, xs, op=OP[op], name=case)
    elif variant == "inplace":
        res, exc = attempt(hvd.grouped_allreduce_, xs, op=OP[op], name=case)
    elif variant == "async":
        res, exc = attempt(lambda: hvd.synchronize(
            hvd.grouped_allreduce_async(xs, op=OP[op], name=case)))
    else:
        res, exc = attempt(lambda: hvd.synchronize(
            hvd.grouped_allreduce_async_(xs, op=OP[op], name=case)))
    if exc is not None:
        raise exc
    check_group(res, members, inputs, op)
    if variant in ("out", "async"):
        for i, x in enumerate(xs):
            check_same(x, inputs[RANK][i], f"input {i}")
            assert res[i] is not x
    else:
        for i, x in enumerate(xs):
            assert res[i] is x, f"in-place result {i} is not the input tensor"


def grouped_reducescatter_variant(case):
    _, variant, op = case.split(".")
    members = [(dt, (SIZE + i,) + ((2,) if i % 2 else ()))
               for i, (dt, _) in enumerate(group_members(op))]
    members, inputs = group_inputs(case, op, members)
    xs = [t.clone() for t in inputs[RANK]]
    if variant == "out":
        res, exc = attempt(hvd.grouped_reducescatter, xs, op=OP[op], name=case)
    else:
        res, exc = attempt(lambda: hvd.synchronize(
            hvd.grouped_reducescatter_async(xs, op=OP[op], name=case)))
    if exc is not None:
        raise exc
    check_group(res, members, inputs, op, pick=lambda full: my_rows(full, SIZE, RANK))
    for i, x in enumerate(xs):
        check_same(x, inputs[RANK][i], f"input {i}")


def grouped_reducescatter_scaled(case):
    members = [("float64", (SIZE + 1, 2)), ("int32", (2 * SIZE - 1,)), ("float32", (SIZE,))]
    members, inputs = group_inputs(case, "Sum", members, small=True)
    pre, post = 2.5, 0.25
    res, exc = attempt(hvd.grouped_reducescatter, [t.clone() for t in inputs[RANK]],
                       op=hvd.Average, name=case, prescale_factor=pre, postscale_factor=post)
    if exc is not None:
        raise exc
    factor = post * (1.0 / SIZE)
    assert len(res) == len(members)
    for i, (dt, _) in enumerate(members):
        ins = [inputs[k][i] for k in range(SIZE)]
        if dt in FLOAT_DTYPES:
            full = sum(t.to(F64) * pre for t in ins) * factor
        else:
            full = (sum((t.to(F64) * pre).trunc().to(I64) for t in ins).to(F64)
                    * factor).trunc().to(I64)
        check_values(res[i], my_rows(full, SIZE, RANK), dt, exact=dt not in FLOAT_DTYPES,
                     what=f"member {i}")


def grouped_unnamed(case):
    members, inputs = group_inputs(case, "Sum")
    results = [attempt(hvd.grouped_allreduce, [t.clone() for t in inputs[RANK]], op=hvd.Sum)
               for _ in range(2)]
    for res, exc in results:
        if exc is not None:
            raise exc
        check_group(res, members, inputs, "Sum")


def grouped_scaled(case):
    op = case.split(".")[-1]
    members = [dt_sh for dt_sh in group_members(op) if dt_sh[0] != "bool"]
    members, inputs = group_inputs(case, "Sum", members, small=True)
    pre, post = 2.5, 0.25
    res, exc = attempt(hvd.grouped_allreduce, [t.clone() for t in inputs[RANK]], op=OP[op],
                       name=case, prescale_factor=pre, postscale_factor=post)
    if exc is not None:
        raise exc
    factor = post * (1.0 / SIZE) if op == "Average" else post
    for i, (dt, _) in enumerate(members):
        ins = [inputs[k][i] for k in range(SIZE)]
        if dt in FLOAT_DTYPES:
            expected = sum(t.to(F64) * pre for t in ins) * factor
        else:
            expected = (sum((t.to(F64) * pre).trunc().to(I64) for t in ins).to(F64)
                        * factor).trunc().to(I64)
        check_values(res[i], expected, dt, exact=dt not in FLOAT_DTYPES, what=f"member {i}")


def grouped_average_flag(case):
    flag = case.endswith("true")
    op = "Average" if flag else "Sum"
    members, inputs = group_inputs(case, op, [("int32", (4,)), ("float64", (3,))])
    res, exc = attempt(hvd.grouped_allreduce, [t.clone() for t in inputs[RANK]], average=flag,
                       name=case)
    if exc is not None:
        raise exc
    check_group(res, members, inputs, op)


def grouped_repeated_named(case):
    outs = []
    for it in range(4):
        members, inputs = group_inputs(f"{case}.{it}", "Sum")
        xs = [t.clone() for t in inputs[RANK]]
        fn = hvd.grouped_allreduce_ if it % 2 else hvd.grouped_allreduce
        outs.append((attempt(fn, xs, op=hvd.Sum, name=case), members, inputs))
    for it, ((res, exc), members, inputs) in enumerate(outs):
        if exc is not None:
            raise exc
        check_group(res, members, inputs, "Sum", what=f"iteration {it} member")


def grouped_repeated_shape_change(case):
    outs = []
    for it in range(4):
        grow = 1 if it >= 2 else 0      # every rank changes its shapes at iteration 2
        members = [("float32", (3 + grow,)), ("int64", (2, 2 + grow)), ("float64", (5,))]
        members, inputs = group_inputs(f"{case}.{it}", "Sum", members)
        outs.append((attempt(hvd.grouped_allreduce, [t.clone() for t in inputs[RANK]],
                             op=hvd.Sum, name=case), members, inputs))
    for it, ((res, exc), members, inputs) in enumerate(outs):
        if exc is not None:
            raise exc
        check_group(res, members, inputs, "Sum", what=f"iteration {it} member")


def grouped_many_members(case):
    members = [("float32" if i % 3 else "int32", (i % 5 + 1,)) for i in range(40)]
    members, inputs = group_inputs(case, "Sum", members)
    res, exc = attempt(lambda: hvd.synchronize(
        hvd.grouped_allreduce_async([t.clone() for t in inputs[RANK]], op=hvd.Sum, name=case)))
    if exc is not None:
        raise exc
    check_group(res, members, inputs, "Sum")


def grouped_large_members(case):
    """Members over the fusion size (reduced on their own) next to small fused ones."""
    members = [("float32", (300_000,)), ("float32", (5,)), ("float64", (200_000,)),
               ("float32", (3, 3)), ("int32", (300_001,))]
    members, inputs = group_inputs(case, "Sum", members)
    res, exc = attempt(hvd.grouped_allreduce, inputs[RANK], op=hvd.Sum, name=case)
    if exc is not None:
        raise exc
    check_group(res, members, inputs, "Sum")


def grouped_single_member(case):
    members, inputs = group_inputs(case, "Max", [("int16", (3, 2))])
    res, exc = attempt(hvd.grouped_allreduce, [inputs[RANK][0].clone()], op=hvd.Max, name=case)
    if exc is not None:
        raise exc
    check_group(res, members, inputs, "Max")


def grouped_noncontig_out(case):
    bases = [[C.op_input(f"{case}.{i}", k, dt, "Sum", (3, 4)) for i, dt in
              enumerate(("float32", "int64"))] for k in range(SIZE)]
    views = [b[:, ::2] for b in bases[RANK]] + [bases[RANK][0].t()]
    members = [("float32", (3, 2)), ("int64", (3, 2)), ("float32", (4, 3))]
    expected_inputs = [[b[:, ::2] for b in bases[k]] + [bases[k][0].t()] for k in range(SIZE)]
    res, exc = attempt(hvd.grouped_allreduce, views, op=hvd.Sum, name=case)
    if exc is not None:
        raise exc
    check_group(res, members, expected_inputs, "Sum")


def grouped_noncontig_inplace_raises(case):
    t = torch.zeros(4, 6)[:, ::2]
    expect_raises(lambda: hvd.grouped_allreduce_([torch.zeros(3), t], name=case), ValueError,
                  "contiguous")
    follow_up(case)


def grouped_empty_lists(case):
    assert hvd.grouped_allreduce([]) == []
    assert hvd.grouped_allreduce([], name=case) == []
    assert hvd.grouped_allgather([]) == []
    assert hvd.grouped_reducescatter([]) == []
    assert hvd.synchronize(hvd.grouped_allreduce_async([])) == []
    follow_up(case)


def grouped_poll(case):
    members, inputs = group_inputs(case, "Sum", [("float64", (4,)), ("int32", (2,))])
    handle, exc = attempt(hvd.grouped_allreduce_async, [t.clone() for t in inputs[RANK]],
                          op=hvd.Sum, name=case)
    if exc is not None:
        raise exc
    while not hvd.poll(handle):
        time.sleep(0.001)
    res = hvd.synchronize(handle)
    check_group(res, members, inputs, "Sum")


def grouped_grad(case):
    kind = case.split(".")[-1]
    members = [("float64", (3,)), ("float32", (2, 2)), ("float64", ()), ("float64", (4,))]
    if kind == "Sum" or kind == "unused_output" or kind == "partial_requires_grad":
        op, pre, post = "Sum", 1.0, 1.0
    elif kind == "Average":
        op, pre, post = "Average", 1.0, 1.0
    else:   # scaled
        op, pre, post = "Average", 2.0, 0.75
    xs = [[randn(case, k, sh, tdt(dt), extra=i) for i, (dt, sh) in enumerate(members)]
          for k in range(SIZE)]
    ws = [[randn(case, k, sh, tdt(dt), extra=100 + i) for i, (dt, sh) in enumerate(members)]
          for k in range(SIZE)]
    mine = [x.clone().requires_grad_(not (kind == "partial_requires_grad" and i == 1))
            for i, x in enumerate(xs[RANK])]
    used = [i for i in range(len(members)) if not (kind == "unused_output" and i == 2)]

    def run():
        ys = hvd.grouped_allreduce(mine, op=OP[op], name=case, prescale_factor=pre,
                                   postscale_factor=post)
        sum((ys[i] * ws[RANK][i]).sum() for i in used).backward()
        return ys
    ys, exc = attempt(run)
    if exc is not None:
        raise exc
    div = SIZE if op == "Average" else 1
    for i, (dt, _) in enumerate(members):
        tol = 1e-5 if dt == "float32" else 1e-12
        close(ys[i], sum(xs[k][i].to(F64) for k in range(SIZE)) * pre * post / div,
              f"forward {i}", tol)
        if not mine[i].requires_grad:
            assert mine[i].grad is None
            continue
        expected = (sum(ws[k][i].to(F64) for k in range(SIZE)) * pre * post / div
                    if i in used else torch.zeros(mine[i].shape, dtype=F64))
        assert mine[i].grad is not None, f"no gradient for member {i}"
        assert mine[i].grad.dtype == tdt(dt)
        close(mine[i].grad, expected, f"grad {i}", tol)


def grouped_grad_min_raises(case):
    xs = [randn(case, RANK, (3,)).requires_grad_(), randn(case, RANK, (2,), extra=1)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Min, name=case)
    expect_raises(lambda: ys[0].sum().backward(), RuntimeError, "Min")
    follow_up(case)


# grouped allgather / reducescatter gradients (Horovod's, member by member as for the single
# ops): members (dtype, trailing shape or None for a scalar), rows per rank from gather_rows
GRAD_GATHER_MEMBERS = [("float64", (2,)), ("float32", None), ("float64", (3,)),
                       ("int32", (2,)), ("float64", (2, 2))]


def grouped_allgather_grad(case):
    kind = case.split(".")[-1]
    members = GRAD_GATHER_MEMBERS
    rows = [[1 if tr is None else gather_rows(k, i) for i, (_, tr) in enumerate(members)]
            for k in range(SIZE)]
    total = [sum(rows[k][i] for k in range(SIZE)) for i in range(len(members))]
    xs = [[(torch.full((rows[k][i],) + tr, k, dtype=torch.int32) if dt == "int32" else
            randn(case, k, () if tr is None else (rows[k][i],) + tr, tdt(dt), extra=i))
           for i, (dt, tr) in enumerate(members)] for k in range(SIZE)]
    ws = [[randn(case, k, (total[i],) + (() if tr is None else tr), tdt(dt), extra=100 + i)
           for i, (dt, tr) in enumerate(members)] for k in range(SIZE)]
    mine = [x.clone().requires_grad_(x.dtype.is_floating_point) for x in xs[RANK]]
    used = [i for i, (dt, _) in enumerate(members)
            if dt != "int32" and not (kind == "unused_output" and i == 2)]

    def run():
        if kind == "compared_with_allgather":   # the same numbers as one allgather each
            ys = [hvd.allgather(t, name=f"{case}.{i}") for i, t in enumerate(mine)]
        else:
            ys = hvd.grouped_allgather(mine, name=case)
        sum((ys[i] * ws[RANK][i]).sum() for i in used).backward()
        return ys
    ys, exc = attempt(run)
    if exc is not None:
        raise exc
    for i, (dt, tr) in enumerate(members):
        full = torch.cat([xs[k][i].reshape(1) if tr is None else xs[k][i] for k in range(SIZE)])
        check_same(ys[i].detach(), full, f"forward {i}")
        if dt == "int32":
            assert not ys[i].requires_grad and mine[i].grad is None
            continue
        # Horovod: the upstream gradients averaged over the ranks, then this rank's rows
        off = sum(rows[k][i] for k in range(RANK))
        avg = sum(ws[k][i].to(F64) for k in range(SIZE)) / SIZE
        expected = (avg[off:off + rows[RANK][i]] if i in used
                    else torch.zeros((rows[RANK][i],) + tr, dtype=F64))
        if tr is None:
            expected = expected.reshape(())
        assert mine[i].grad is not None, f"no gradient for member {i}"
        assert mine[i].grad.dtype == tdt(dt), mine[i].grad.dtype
        close(mine[i].grad, expected, f"grad {i}", 1e-5 if dt == "float32" else 1e-12)


def grouped_reducescatter_grad(case):
    kind = case.split(".")[-1]
    if kind == "min_raises":
        xs = [randn(case, RANK, (SIZE, 2)).requires_grad_(), randn(case, RANK, (SIZE,), extra=1)]
        ys = hvd.grouped_reducescatter(xs, op=hvd.Min, name=case)
        expect_raises(lambda: ys[0].sum().backward(), RuntimeError, "Min")
        follow_up(case)
        return
    op, pre, post = {"Sum": ("Sum", 1.0, 1.0), "Average": ("Average", 1.0, 1.0),
                     "scaled": ("Sum", 2.0, 0.75), "default_op": ("Average", 1.0, 1.0)}[kind]
    members = [("float64", (2 * SIZE + 1, 2)), ("float32", (SIZE - 1,)), ("int32", (SIZE,)),
               ("float64", (3 * SIZE,))]
    xs = [[randn(case, k, sh, tdt(dt), extra=i) if dt != "int32" else
           torch.arange(sh[0], dtype=torch.int32) for i, (dt, sh) in enumerate(members)]
          for k in range(SIZE)]
    rows = [split_rows(sh[0], SIZE) for _, sh in members]
    ws = [[randn(case, k, (rows[i][k],) + sh[1:], tdt(dt), extra=100 + i)
           for i, (dt, sh) in enumerate(members)] for k in range(SIZE)]
    mine = [x.clone().requires_grad_(x.dtype.is_floating_point) for x in xs[RANK]]
    kwargs = {} if kind == "default_op" else {"op": OP[op]}

    def run():
        ys = hvd.grouped_reducescatter(mine, name=case, prescale_factor=pre,
                                       postscale_factor=post, **kwargs)
        sum((ys[i] * ws[RANK][i]).sum() for i, (dt, _) in enumerate(members)
            if dt != "int32").backward()
        return ys
    ys, exc = attempt(run)
    if exc is not None:
        raise exc
    div = SIZE if op == "Average" else 1
    times = SIZE if op == "Sum" else 1   # Horovod: times the size for Sum, no 1/size for Average
    for i, (dt, sh) in enumerate(members):
        if dt == "int32":
            assert mine[i].grad is None
            continue
        tol = 1e-5 if dt == "float32" else 1e-12
        close(ys[i], my_rows(sum(x[i].to(F64) for x in xs) * pre * post / div, SIZE, RANK),
              f"forward {i}", tol)
        assert mine[i].grad is not None and mine[i].grad.dtype == tdt(dt)
        close(mine[i].grad, torch.cat([w[i].to(F64) for w in ws]) * pre * post * times,
              f"grad {i}", tol)


def rs_grad_compressed(case):
    """reducescatter(compression=fp16), Horovod's argument: the wire is float16, the result
    and the gradient float32 (Average: the gathered upstream gradient, not divided)."""
    xs = [randn(case, k, (2 * SIZE, 3), torch.float32) for k in range(SIZE)]
    ws = [randn(case, k, (2, 3), torch.float32, extra=1) for k in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()

    def run():
        y = hvd.reducescatter(x, name=case, compression=hvd.Compression.fp16)
        (y * ws[RANK]).sum().backward()
        return y
    y, exc = attempt(run)
    if exc is not None:
        raise exc
    assert y.dtype == torch.float32 and x.grad.dtype == torch.float32
    close(y, my_rows(sum(t.to(F64) for t in xs) / SIZE, SIZE, RANK), "forward", 5e-3)
    close(x.grad, torch.cat(ws).to(F64), "x.grad", 5e-3)


# grouped allgather: (dtype, trailing shape or None for a scalar member)
GATHER_MEMBERS = [("float32", (3,)), ("int64", ()), ("bool", (2,)), ("bfloat16", (2, 2)),
                  ("float64", None), ("uint8", (0,)), ("int8", (1,))]


def gather_rows(k, i):
    return (k + i) % 3    # uneven, with zero rows on some ranks


def gather_inputs(case, members, rows=gather_rows):
    return [[C.op_input(f"{case}.{i}", k, dt, "Sum",
                        () if tr is None else (rows(k, i),) + tr)
             for i, (dt, tr) in enumerate(members)] for k in range(SIZE)]


def check_gathered(res, members, inputs, what="member"):
    assert isinstance(res, list) and len(res) == len(members), f"result {type(res).__name__}"
    for i, (dt, tr) in enumerate(members):
        expected = torch.cat([inputs[k][i].reshape(1) if tr is None else inputs[k][i]
                              for k in range(len(inputs))])
        check_same(res[i], expected, f"{what} {i} ({dt})")


def grouped_allgather_case(case):
    variant = case.split(".")[-1]
    inputs = gather_inputs(case, GATHER_MEMBERS)
    xs = [t.clone() for t in inputs[RANK]]
    if variant == "out":
        res, exc = attempt(hvd.grouped_allgather, xs, name=case)
    else:
        res, exc = attempt(lambda: hvd.synchronize(hvd.grouped_allgather_async(xs, name=case)))
    if exc is not None:
        raise exc
    check_gathered(res, GATHER_MEMBERS, inputs)
    for i, x in enumerate(xs):
        check_same(x, inputs[RANK][i], f"input {i}")


def grouped_allgather_changing_rows(case):
    members = [("float32", (2,)), ("int32", ())]
    outs = []
    for it in range(4):
        inputs = gather_inputs(f"{case}.{it}", members,
                               rows=lambda k, i, it=it: (k + i + (it // 2 if k == 0 else 0)) % 3)
        outs.append((attempt(hvd.grouped_allgather, [t.clone() for t in inputs[RANK]],
                             name=case), inputs))
    for it, ((res, exc), inputs) in enumerate(outs):
        if exc is not None:
            raise exc
        check_gathered(res, members, inputs, f"iteration {it} member")


def grouped_mismatch(case):
    """Member 1 has a different shape/dtype on rank 1: every member fails with
    TensorMismatchError naming member 1, on every rank; a following op works."""
    _, what, mode = case.split(".")
    bad = RANK == 1
    if what in ("allreduce_shape", "allreduce_inplace_shape"):
        xs = [torch.ones(3), torch.ones(5 if bad else 4), torch.ones(2, dtype=torch.int32)]
        fn = (hvd.grouped_allreduce_async_ if what == "allreduce_inplace_shape"
              else hvd.grouped_allreduce_async)
        sync_fn = hvd.grouped_allreduce
        field = "shape"
    elif what == "allreduce_dtype":
        xs = [torch.ones(3), torch.ones(4, dtype=torch.float64 if bad else torch.float32),
              torch.ones(2, dtype=torch.int32)]
        fn, sync_fn, field = hvd.grouped_allreduce_async, hvd.grouped_allreduce, "dtype"
    elif what == "allgather_trailing":
        xs = [torch.ones(RANK + 1, 2), torch.ones(2, 4 if bad else 3), torch.ones(1)]
        fn, sync_fn, field = hvd.grouped_allgather_async, hvd.grouped_allgather, "shape"
    else:   # reducescatter_shape
        xs = [torch.ones(SIZE, 2), torch.ones(SIZE + (1 if bad else 0)), torch.ones(SIZE)]
        fn, sync_fn, field = (hvd.grouped_reducescatter_async, hvd.grouped_reducescatter,
                              "shape")
    errors = []
    if mode == "async":
        handle, exc = attempt(fn, xs, name=case)
        if exc is not None:
            raise exc
        for h in handle.handles:
            errors.append(attempt(h.wait)[1])
        group_exc = attempt(hvd.synchronize, handle)[1]
    else:
        group_exc = attempt(sync_fn, xs, name=case)[1]
    follow_exc = attempt(follow_up, case)[1]
    if follow_exc is not None:
        raise AssertionError(f"the op after the mismatch failed: {follow_exc}")
    bad_name = f"'{case}.1'"
    for i, exc in enumerate(errors):
        assert isinstance(exc, hvd.TensorMismatchError), \
            f"member {i}: {type(exc).__name__}: {exc}"
        assert bad_name in str(exc), f"member {i}'s error does not name {bad_name}: {exc}"
        assert field in str(exc), f"member {i}'s error does not mention {field}: {exc}"
    assert isinstance(group_exc, hvd.TensorMismatchError), \
        f"the group raised {type(group_exc).__name__}: {group_exc}"
    assert bad_name in str(group_exc), group_exc


def grouped_mismatch_then_same_name_ok(case):
    xs = [torch.ones(2), torch.ones(3 if RANK == 1 else 2)]
    exc = attempt(hvd.grouped_allreduce, xs, op=hvd.Sum, name=case)[1]
    res, exc2 = attempt(hvd.grouped_allreduce, [torch.ones(2), torch.full((2,), float(RANK))],
                        op=hvd.Sum, name=case)
    assert isinstance(exc, hvd.TensorMismatchError), f"{type(exc).__name__}: {exc}"
    if exc2 is not None:
        raise exc2
    assert res[0].tolist() == [float(SIZE)] * 2
    assert res[1].tolist() == [float(sum(range(SIZE)))] * 2


def grouped_allgather_noncontig(case):
    bases = [[C.op_input(f"{case}.{i}", k, dt, "Sum", (3, k + 1)) for i, dt in
              enumerate(("float32", "int16"))] for k in range(SIZE)]
    views = [b.t() for b in bases[RANK]]
    res, exc = attempt(hvd.grouped_allgather, views, name=case)
    if exc is not None:
        raise exc
    check_gathered(res, [("float32", (3,)), ("int16", (3,))],
                   [[b.t() for b in bases[k]] for k in range(SIZE)])
    for i, b in enumerate(bases[RANK]):
        check_same(views[i].t(), b, f"input {i}")


def grouped_reducescatter_noncontig(case):
    bases = [[C.op_input(f"{case}.{i}", k, dt, "Sum", (2, 2 * SIZE + 1)) for i, dt in
              enumerate(("float64", "int32"))] for k in range(SIZE)]
    views = [b.t() for b in bases[RANK]]
    res, exc = attempt(hvd.grouped_reducescatter, views, op=hvd.Sum, name=case)
    if exc is not None:
        raise exc
    check_group(res, [("float64", None), ("int32", None)],
                [[b.t() for b in bases[k]] for k in range(SIZE)], "Sum",
                pick=lambda full: my_rows(full, SIZE, RANK))


def grouped_reducescatter_scalar_raises(case):
    expect_raises(lambda: hvd.grouped_reducescatter([torch.ones(SIZE), torch.tensor(1.0)],
                                                    name=case), ValueError, "scalar")
    follow_up(case)


def grouped_same_name_different_sizes(case):
    """One name used for groups of 2, then 3, then 2 members (member names repeat with a
    different group): each result is right."""
    outs = []
    for it, n_members in enumerate((2, 3, 2, 3)):
        members = [("float32", (i + 2,)) for i in range(n_members)]
        members, inputs = group_inputs(f"{case}.{it}", "Sum", members)
        outs.append((attempt(hvd.grouped_allreduce, [t.clone() for t in inputs[RANK]],
                             op=hvd.Sum, name=case), members, inputs))
    for it, ((res, exc), members, inputs) in enumerate(outs):
        if exc is not None:
            raise AssertionError(f"iteration {it}: {exc!r}")
        check_group(res, members, inputs, "Sum", what=f"iteration {it} member")


GROUPED_FUNCS = {
    "grouped_allgather.noncontig": grouped_allgather_noncontig,
    "grouped_reducescatter.noncontig": grouped_reducescatter_noncontig,
    "grouped_reducescatter.scalar_raises": grouped_reducescatter_scalar_raises,
    "grouped_allreduce.same_name_different_sizes": grouped_same_name_different_sizes,
    "grouped_allreduce.unnamed.Sum": grouped_unnamed,
    "grouped_allreduce.scaled.Sum": grouped_scaled,
    "grouped_allreduce.scaled.Average": grouped_scaled,
    "grouped_allreduce.average_flag_false": grouped_average_flag,
    "grouped_allreduce.average_flag_true": grouped_average_flag,
    "grouped_allreduce.repeated_named": grouped_repeated_named,
    "grouped_allreduce.repeated_named_shape_change": grouped_repeated_shape_change,
    "grouped_allreduce.many_members": grouped_many_members,
    "grouped_allreduce.single_member": grouped_single_member,
    "grouped_allreduce.large_members": grouped_large_members,
    "grouped_allreduce.noncontig_out": grouped_noncontig_out,
    "grouped_allreduce.noncontig_inplace_raises": grouped_noncontig_inplace_raises,
    "grouped.empty_lists": grouped_empty_lists,
    "grouped_allreduce.poll_then_synchronize": grouped_poll,
    "grouped_allreduce.grad.min_raises": grouped_grad_min_raises,
    "grouped_allgather.out": grouped_allgather_case,
    "grouped_allgather.async": grouped_allgather_case,
    "grouped_allgather.repeated_named_changing_rows": grouped_allgather_changing_rows,
    "grouped_reducescatter.scaled.Average": grouped_reducescatter_scaled,
    "grouped_mismatch.then_same_name_ok": grouped_mismatch_then_same_name_ok,
}


def run_grouped():
    for case in grouped_cases(SIZE):
        if case in GROUPED_FUNCS:
            r.case(case, GROUPED_FUNCS[case], case)
        elif case.startswith("grouped_allreduce.grad."):
            r.case(case, grouped_grad, case)
        elif case.startswith("grouped_allgather.grad."):
            r.case(case, grouped_allgather_grad, case)
        elif case.startswith("grouped_reducescatter.grad."):
            r.case(case, grouped_reducescatter_grad, case)

        elif case.startswith("grouped_mismatch."):
            r.case(case, grouped_mismatch, case)
        elif case.startswith("grouped_reducescatter."):
            r.case(case, grouped_reducescatter_variant, case)
        else:
            r.case(case, grouped_allreduce_variant, case)


# =================================================================================================
# join
# =================================================================================================
def join_model():
    g = torch.Generator().manual_seed(4321)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    return model


def join_data(case, k, s):
    g = torch.Generator().manual_seed(C.seed_of(case, k, s))
    return (torch.randn((5, 4), generator=g, dtype=F64),
            torch.randn((5, 1), generator=g, dtype=F64))


def join_loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def join_optimizer(case):
    """Rank k trains steps_of(k) steps with DistributedOptimizer, then joins; the average in a
    step where some ranks have joined is sum(active ranks' gradients) / size."""
    if case.endswith("reverse_steps"):
        epochs = [lambda k: SIZE - k]
    elif case.endswith("idle_first_epoch"):
        # The last rank has no data in the first epoch: it joins before its optimizer's first
        # step, which the others make with its zeros; in the second epoch it trains too.
        epochs = [lambda k: 0 if k == SIZE - 1 else k + 1, lambda k: SIZE - k]
    else:
        epochs = [lambda k: k + 1]
    train_epochs(case, epochs)


def train_epochs(case, epochs):
    """Each epoch, rank k trains ``steps_of(k)`` steps, then joins; the rank with the most
    steps (one per epoch) joins last.  A joined rank misses the others' later steps, so every
    epoch after the first starts from the last joiner's model and optimizer state, broadcast
    (Horovod's idiom: join() returns that rank).  Each rank's parameters are checked against a
    local replay after its own number of steps in the last epoch."""
    lr, momentum = 0.1, 0.9

    def run():
        model = join_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
            named_parameters=[(f"{case}.{n}", p) for n, p in model.named_parameters()])
        lasts = []
        for e, steps_of in enumerate(epochs):
            if lasts:
                hvd.broadcast_parameters(model.state_dict(), root_rank=lasts[-1])
                hvd.broadcast_optimizer_state(opt, root_rank=lasts[-1])
            for s in range(steps_of(RANK)):
                opt.zero_grad()
                join_loss(model, *join_data(case, RANK, 100 * e + s)).backward()
                opt.step()
            lasts.append(hvd.join(device=-1))
        return model, lasts
    res, exc = attempt(run)
    after_exc = attempt(follow_up, case)[1]
    everywhere = COMM.allgather(None if exc else res[1])
    if exc is not None:
        raise exc
    model, lasts = res
    # reference: replay every rank's steps locally
    ref = join_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    snapshots = {}   # the last epoch's steps
    for e, steps_of in enumerate(epochs):
        for s in range(max(steps_of(k) for k in range(SIZE))):
            active = [k for k in range(SIZE) if steps_of(k) > s]
            total = [torch.zeros_like(p) for p in ref.parameters()]
            for k in active:
                ref.zero_grad()
                join_loss(ref, *join_data(case, k, 100 * e + s)).backward()
                for t, p in zip(total, ref.parameters()):
                    t += p.grad
            for t, p in zip(total, ref.parameters()):
                p.grad = t / SIZE
            ref_opt.step()
            snapshots[s + 1] = [p.detach().clone() for p in ref.parameters()]
    expected = [max(range(SIZE), key=steps_of) for steps_of in epochs]
    assert lasts == expected, f"join() returned {lasts} over the epochs, expected {expected}"
    assert everywhere == [expected] * SIZE, f"join() returned {everywhere} on the ranks"
    mine = epochs[-1](RANK)
    for (name, p), want in zip(model.named_parameters(), snapshots[mine]):
        close(p, want, f"parameter {name} after {mine} step(s) of epoch {len(epochs)}", 1e-10)
    if after_exc is not None:
        raise AssertionError(f"allreduce after join failed: {after_exc}")


def identity_like(t, op, dt):
    if dt == "bool":
        return torch.full_like(t, op in ("Min", "Product"))
    if op == "Product":
        return torch.ones_like(t)
    if op in ("Min", "Max"):
        if dt in FLOAT_DTYPES:
            return torch.full_like(t, float("inf") if op == "Min" else float("-inf"))
        info = torch.iinfo(t.dtype)
        return torch.full_like(t, info.max if op == "Min" else info.min)
    return torch.zeros_like(t)


# ops run with prescale/postscale while rank 0 is joined: (op, dtype, prescale, postscale)
SCALED_WHILE_JOINED = {"min_int32": ("Min", "int32", 2.0, 1.0),
                       "max_int64": ("Max", "int64", 2.0, 0.5),
                       "product_float64": ("Product", "float64", 2.0, 3.0),
                       "average_float32": ("Average", "float32", 2.5, 0.25),
                       "min_float16": ("Min", "float16", 2.0, 1.0)}


def join_allreduce_while_joined(case):
    """Rank 0 joins at once; the others allreduce (every op, grouped too) with rank 0
    contributing the identity (zeros for Average, which still divides by size)."""
    specs = [(op, dt) for op in OPS for dt in ("int32", "float32", "bool")
             if not (dt == "bool" and op == "Average")]
    inputs = {spec: [make_input(f"{case}.{spec}", k, spec[1], spec[0], (2, 3))
                     for k in range(SIZE)] for spec in specs}
    scaled_inputs = {key: [make_input(f"{case}.{key}", k, dt, op, (5,), small=True)
                           for k in range(SIZE)]
                     for key, (op, dt, pre, post) in SCALED_WHILE_JOINED.items()}
    gmembers = [("float64", (3,)), ("int16", (2,))]
    ginputs = [[make_input(f"{case}.g{i}", k, dt, "Sum", sh) for i, (dt, sh) in
                enumerate(gmembers)] for k in range(SIZE)]
    results = {}

    def run():
        if RANK != 0:
            for op, dt in specs:
                results[(op, dt)] = attempt(hvd.allreduce, inputs[(op, dt)][RANK].clone(),
                                            op=OP[op], name=f"{case}.{op}.{dt}")
            for key, (op, dt, pre, post) in SCALED_WHILE_JOINED.items():
                results[key] = attempt(hvd.allreduce, scaled_inputs[key][RANK].clone(),
                                       op=OP[op], name=f"{case}.{key}", prescale_factor=pre,
                                       postscale_factor=post)
            results["grouped"] = attempt(hvd.grouped_allreduce,
                                         [t.clone() for t in ginputs[RANK]], op=hvd.Sum,
                                         name=case + ".grouped")
        return hvd.join()
    last, exc = attempt(run)
    lasts = COMM.allgather(last)
    if exc is not None:
        raise exc
    assert lasts == [lasts[0]] * SIZE and lasts[0] in range(1, SIZE), \
        f"join() returned {lasts} on the ranks (rank 0 joined first)"
    if RANK == 0:
        return
    for op, dt in specs:
        res, err = results[(op, dt)]
        if err is not None:
            raise AssertionError(f"{op} {dt} while rank 0 is joined: {err}")
        ins = inputs[(op, dt)]
        ins = [identity_like(ins[0], op, dt)] + ins[1:]
        check_values(res, C.reduce_reference(ins, op, dt), dt, exact_for(op, dt),
                     what=f"{op} {dt}")
    for key, (op, dt, pre, post) in SCALED_WHILE_JOINED.items():
        res, err = results[key]
        if err is not None:
            raise AssertionError(f"{key} while rank 0 is joined: {err}")
        active = scaled_inputs[key][1:]     # the identity (rank 0) must not be scaled in
        if dt in FLOAT_DTYPES:
            pres = [t.to(F64) * pre for t in active]
            factor = post * (1.0 / SIZE) if op == "Average" else post
            expected = C.reduce_reference(pres, "Sum" if op == "Average" else op, "float64")
            check_values(res, expected * factor, dt, exact=False, what=key)
        else:
            pres = [(t.to(F64) * pre).trunc().to(I64) for t in active]
            red = C.reduce_reference(pres, op, "int64")
            check_values(res, (red.to(F64) * post).trunc().to(I64), dt, what=key)
    res, err = results["grouped"]
    if err is not None:
        raise AssertionError(f"grouped allreduce while rank 0 is joined: {err}")
    ins = [[torch.zeros_like(t) for t in ginputs[0]]] + ginputs[1:]
    check_group(res, gmembers, ins, "Sum")


def join_cached_ops_while_joined(case):
    """A named grouped allreduce and a named allreduce run twice on every rank (so they are
    cached), then twice more while rank 0 is joined: the joined rank stands in with zeros."""
    gmembers = [("float64", (3,)), ("int32", (2, 2)), ("float32", ())]

    def inputs_of(it):
        g = [[make_input(f"{case}.{it}.g{i}", k, dt, "Sum", sh)
              for i, (dt, sh) in enumerate(gmembers)] for k in range(SIZE)]
        p = [make_input(f"{case}.{it}.p", k, "int64", "Sum", (4,)) for k in range(SIZE)]
        return g, p
    results = []

    def run():
        for it in range(4):
            if it >= 2 and RANK == 0:
                break
            g, p = inputs_of(it)
            results.append((attempt(hvd.grouped_allreduce, [t.clone() for t in g[RANK]],
                                    op=hvd.Sum, name=case + ".g"),
                            attempt(hvd.allreduce, p[RANK].clone(), op=hvd.Average,
                                    name=case + ".p")))
        return hvd.join()
    last, exc = attempt(run)
    lasts = COMM.allgather(last)
    if exc is not None:
        raise exc
    assert lasts == [lasts[0]] * SIZE, f"join() returned {lasts}"
    for it, ((gres, gexc), (pres, pexc)) in enumerate(results):
        if gexc is not None or pexc is not None:
            raise AssertionError(f"iteration {it}: {gexc!r} {pexc!r}")
        g, p = inputs_of(it)
        if it >= 2:     # rank 0 has joined: it contributes zeros
            g = [[torch.zeros_like(t) for t in g[0]]] + g[1:]
            p = [torch.zeros_like(p[0])] + p[1:]
        check_group(gres, gmembers, g, "Sum", what=f"iteration {it} member")
        check_values(pres, C.reduce_reference(p, "Average", "int64"), "int64",
                     what=f"iteration {it} allreduce")


def join_unsupported_while_joined(case):
    """With rank 0 joined, alltoall / reducescatter / allgather / broadcast / grouped
    reducescatter fail on the other ranks with an error about join; after everyone has joined
    they work again."""
    ops = {
        "alltoall": lambda: hvd.alltoall(torch.ones(SIZE), name=case + ".a2a"),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(SIZE, 2), name=case + ".rs"),
        "allgather": lambda: hvd.allgather(torch.ones(2), name=case + ".ag"),
        "broadcast": lambda: hvd.broadcast(torch.ones(2), SIZE - 1, name=case + ".bc"),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter(
            [torch.ones(SIZE), torch.ones(SIZE, 2)], name=case + ".grs"),
    }
    if _pow2(SIZE):
        ops["adasum"] = lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum, name=case + ".ada")
    errors = {}

    def run():
        if RANK != 0:
            for what, fn in ops.items():
                errors[what] = attempt(fn)[1]
        return hvd.join()
    exc = attempt(run)[1]
    x = torch.arange(2 * SIZE, dtype=torch.float32) + RANK
    after = [attempt(hvd.alltoall, x, name=case + ".after_a2a"),
             attempt(hvd.reducescatter, x, op=hvd.Sum, name=case + ".after_rs")]
    if exc is not None:
        raise exc
    for what, err in errors.items():
        assert isinstance(err, hvd.HvdliteError), \
            f"{what} while rank 0 is joined: expected an HvdliteError, got {err!r}"
        assert "join" in str(err), f"{what}'s error does not mention join(): {err}"
    (a2a, e1), (rs, e2) = after
    if e1 is not None or e2 is not None:
        raise AssertionError(f"ops after join failed: {e1!r} {e2!r}")
    inputs = [torch.arange(2 * SIZE, dtype=torch.float32) + k for k in range(SIZE)]
    check_same(a2a, a2a_expected(inputs, [[2] * SIZE] * SIZE, RANK), "alltoall after join")
    check_values(rs, my_rows(C.reduce_reference(inputs, "Sum", "float32"), SIZE, RANK),
                 "float32", what="reducescatter after join")


def join_immediately(case):
    last, exc = attempt(hvd.join)
    lasts = COMM.allgather(last)
    if exc is not None:
        raise exc
    assert isinstance(last, int), f"join() returned a {type(last).__name__}"
    assert lasts == [lasts[0]] * SIZE and lasts[0] in range(SIZE), f"join() returned {lasts}"
    follow_up(case)


def run_join():
    funcs = {"join.optimizer_uneven_steps": join_optimizer,
             "join.optimizer_reverse_steps": join_optimizer,
             "join.optimizer_idle_first_epoch": join_optimizer,
             "join.allreduce_while_joined": join_allreduce_while_joined,
             "join.cached_ops_while_joined": join_cached_ops_while_joined,
             "join.unsupported_while_joined": join_unsupported_while_joined,
             "join.immediately_everywhere": join_immediately}
    for case in JOIN_CASES:
        r.case(case, funcs[case], case)


# =================================================================================================
# Adasum
# =================================================================================================
def ada_inputs(case, members, shape, dt, kind="normal"):
    """Inputs of the given (global) ranks: correlated, with per-rank scales."""
    common = randn(case, 999, shape)
    out = []
    for idx, k in enumerate(members):
        if kind == "identical":
            x = common.clone()
        elif kind == "orthogonal":
            flat = torch.zeros(common.numel(), dtype=F64)
            sel = torch.arange(common.numel()) % len(members) == idx
            flat[sel] = common.reshape(-1)[sel]
            x = flat.reshape(shape)
        else:
            x = (0.8 * common + 0.6 * randn(case, k, shape)) * (1.0 + idx)
            if kind == "zero" and idx == 1:
                x = torch.zeros(shape, dtype=F64)
        out.append(x.to(tdt(dt)))
    return out


def ada_reference(inputs, dt):
    arrays = [t.detach().to(F64).reshape(-1).numpy().astype(ada.np_dtype(dt)) for t in inputs]
    ref = ada.adasum_reference(arrays, [arrays[0].size])
    return torch.from_numpy(ref.astype(np.float64)).reshape(inputs[0].shape)


def ada_check(res, expected, dt, what="result"):
    assert isinstance(res, torch.Tensor), f"{what} is a {type(res).__name__}"
    assert res.dtype == tdt(dt), f"{what} dtype {res.dtype}, expected {dt}"
    assert tuple(res.shape) == tuple(expected.shape), \
        f"{what} shape {tuple(res.shape)} != {tuple(expected.shape)}"
    got = res.detach().to(F64)
    tol = ada.TOL[dt]
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    bad = (got - expected).abs() > tol * (expected.abs() + scale)
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {expected.numel()} elements off: "
                                 f"got {got[bad][:5].tolist()} want {expected[bad][:5].tolist()}")


ADA_SHAPES = {"vec": (37,), "mat": (6, 5), "cube": (2, 3, 4), "one": (1,)}


def adasum_case(case):
    _, dt, sh = case.split(".")
    inputs = ada_inputs(case, range(SIZE), ADA_SHAPES[sh], dt)
    x = inputs[RANK].clone()
    res, exc = attempt(hvd.allreduce, x, op=hvd.Adasum, name=case)
    same = COMM.allgather(None if exc else bits(res).numpy().tobytes())
    if exc is not None:
        raise exc
    ada_check(res, ada_reference(inputs, dt), dt)
    check_same(x, inputs[RANK], "input")
    assert all(s == same[0] for s in same), "Adasum results differ between ranks"


def adasum_inplace(case):
    dt = "float32"
    inputs = ada_inputs(case, range(SIZE), (11, 3), dt)
    x = inputs[RANK].clone()
    res, exc = attempt(hvd.allreduce_, x, op=hvd.Adasum, name=case)
    if exc is not None:
        raise exc
    assert res is x
    ada_check(x, ada_reference(inputs, dt), dt)


def adasum_async(case):
    dt = "float64"
    inputs = ada_inputs(case, range(SIZE), (20,), dt)
    res, exc = attempt(lambda: hvd.synchronize(
        hvd.allreduce_async(inputs[RANK].clone(), op=hvd.Adasum, name=case)))
    if exc is not None:
        raise exc
    ada_check(res, ada_reference(inputs, dt), dt)


def adasum_async_many(case):
    """Several Adasum allreduces in flight at once (fused into one buffer): each is reduced as
    its own vector."""
    dt = "float32"
    shapes = [(5,), (3, 7), (1,), (40,), (2, 2, 2)]
    inputs = [ada_inputs(f"{case}.{i}", range(SIZE), sh, dt) for i, sh in enumerate(shapes)]
    handles = [attempt(hvd.allreduce_async, inputs[i][RANK].clone(), op=hvd.Adasum,
                       name=f"{case}.{i}") for i in range(len(shapes))]
    results = [attempt(hvd.synchronize, h) if e is None else (None, e) for h, e in handles]
    for i, (res, exc) in enumerate(results):
        if exc is not None:
            raise exc
        ada_check(res, ada_reference(inputs[i], dt), dt, f"tensor {i}")


def adasum_large(case):
    dt = "float32"
    inputs = ada_inputs(case, range(SIZE), (300_001,), dt)
    res, exc = attempt(hvd.allreduce, inputs[RANK], op=hvd.Adasum, name=case)
    if exc is not None:
        raise exc
    ada_check(res, ada_reference(inputs, dt), dt)


def adasum_scaled(case):
    """Adasum is homogeneous of degree 1: the factors scale the result."""
    dt = "float64"
    pre, post = 2.0, 0.25
    inputs = ada_inputs(case, range(SIZE), (15,), dt)
    res, exc = attempt(hvd.allreduce, inputs[RANK].clone(), op=hvd.Adasum, name=case,
                       prescale_factor=pre, postscale_factor=post)
    if exc is not None:
        raise exc
    ada_check(res, ada_reference(inputs, dt) * (pre * post), dt)


def adasum_grouped(case):
    if case.endswith("mixed_dtypes"):
        specs = [("float32", (6,)), ("float64", (2, 3)), ("float32", (9,)), ("float16", (4,)),
                 ("float64", (1,))]
    else:
        specs = [("float32", (6,)), ("float32", (2, 3)), ("float32", (17,))]
    inputs = [ada_inputs(f"{case}.{i}", range(SIZE), sh, dt) for i, (dt, sh) in enumerate(specs)]
    res, exc = attempt(hvd.grouped_allreduce, [inputs[i][RANK].clone() for i in
                                               range(len(specs))], op=hvd.Adasum, name=case)
    if exc is not None:
        raise exc
    assert len(res) == len(specs)
    for i, (dt, _) in enumerate(specs):
        ada_check(res[i], ada_reference(inputs[i], dt), dt, f"member {i}")


def adasum_special(case):
    kind = {"adasum.identical_inputs": "identical", "adasum.orthogonal_inputs": "orthogonal",
            "adasum.zero_on_one_rank": "zero"}[case]
    dt = "float64"
    inputs = ada_inputs(case, range(SIZE), (24,), dt, kind)
    res, exc = attempt(hvd.allreduce, inputs[RANK].clone(), op=hvd.Adasum, name=case)
    if exc is not None:
        raise exc
    ada_check(res, ada_reference(inputs, dt), dt)
    if kind == "identical":
        ada_check(res, inputs[0], dt, "identical inputs -> the input")
    elif kind == "orthogonal":
        ada_check(res, sum(inputs), dt, "orthogonal inputs -> their sum")


def adasum_int32_raises(case):
    expect_raises(lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum,
                                        name=case), hvd.UnsupportedDtypeError, "Adasum")
    follow_up(case)


def adasum_noncontig(case):
    dt = "float64"
    bases = ada_inputs(case, range(SIZE), (4, 6), dt)
    base = bases[RANK].clone()
    res, exc = attempt(hvd.allreduce, base.t(), op=hvd.Adasum, name=case)
    if exc is not None:
        raise exc
    ada_check(res, ada_reference([b.t().contiguous() for b in bases], dt), dt)
    check_same(base, bases[RANK], "input storage")


def adasum_grad_raises(case):
    x = randn(case, RANK, (4,)).requires_grad_()
    y = hvd.allreduce(x, op=hvd.Adasum, name=case)
    expect_raises(lambda: y.sum().backward(), RuntimeError, "Adasum")
    follow_up(case)


def adasum_bad_size(case):
    if "grouped" in case:
        def fn():
            return hvd.grouped_allreduce([torch.ones(3), torch.ones(2)], op=hvd.Adasum,
                                         name=case)
    else:
        def fn():
            return hvd.allreduce(torch.ones(3), op=hvd.Adasum, name=case)
    expect_raises(fn, ValueError, "power-of-two", str(SIZE))
    follow_up(case)


def run_adasum():
    funcs = {"adasum.inplace.float32": adasum_inplace, "adasum.async.float64": adasum_async,
             "adasum.async_many.float32": adasum_async_many,
             "adasum.large.float32": adasum_large, "adasum.scaled.float64": adasum_scaled,
             "adasum.grouped.float32": adasum_grouped,
             "adasum.grouped.mixed_dtypes": adasum_grouped,
             "adasum.identical_inputs": adasum_special, "adasum.orthogonal_inputs": adasum_special,
             "adasum.zero_on_one_rank": adasum_special, "adasum.int32_raises": adasum_int32_raises,
             "adasum.noncontig.float64": adasum_noncontig,
             "adasum.grad_raises": adasum_grad_raises,
             "adasum.non_power_of_two_raises": adasum_bad_size,
             "adasum.grouped_non_power_of_two_raises": adasum_bad_size}
    for case in adasum_cases(SIZE):
        r.case(case, funcs.get(case, adasum_case), case)


# =================================================================================================
# input validation
# =================================================================================================
def validation_case(case):
    """The new ops reject what the adapter does not support with the same clear errors as
    allreduce/allgather/broadcast (tests/torch/workers/torch_errors_worker.py), before anything is
    sent; the next op works."""
    _, op, kind = case.split(".")
    rows = 2 * SIZE
    if kind in ("uint16", "uint32"):
        bad = torch.ones(rows, dtype=getattr(torch, kind))
    elif kind == "sparse":
        bad = torch.ones(rows).to_sparse()
    elif kind == "meta_device":
        bad = torch.ones(rows, device="meta")
    else:
        bad = np.ones(rows, dtype=np.float32)
    fn = {"alltoall": lambda: hvd.alltoall(bad, name=case),
          "reducescatter": lambda: hvd.reducescatter(bad, op=hvd.Sum, name=case),
          "grouped_allreduce": lambda: hvd.grouped_allreduce([torch.ones(2), bad], name=case),
          "grouped_allgather": lambda: hvd.grouped_allgather([torch.ones(2), bad], name=case),
          "grouped_reducescatter": lambda: hvd.grouped_reducescatter(
              [torch.ones(rows), bad], op=hvd.Sum, name=case)}[op]
    cls = TypeError if kind == "not_a_tensor" else hvd.UnsupportedDtypeError
    exc = attempt(expect_raises, fn, cls)[1]
    follow_up(case)
    if exc is not None:
        raise exc


def run_validation():
    for case in validation_cases(SIZE):
        r.case(case, validation_case, case)


# =================================================================================================
# process sets
# =================================================================================================
def nonmember_ops(ps):
    """Every op on ``ps``, for a rank outside it (each must raise ValueError at once)."""
    t = torch.ones(4)
    g = ps.ranks[0]
    return {
        "allreduce": lambda: hvd.allreduce(t, process_set=ps),
        "allreduce_inplace": lambda: hvd.allreduce_(t.clone(), process_set=ps),
        "allreduce_async": lambda: hvd.allreduce_async(t, process_set=ps),
        "allreduce_scaled": lambda: hvd.allreduce(t, prescale_factor=2.0, process_set=ps),
        "allgather": lambda: hvd.allgather(t, process_set=ps),
        "allgather_async": lambda: hvd.allgather_async(t, process_set=ps),
        "broadcast": lambda: hvd.broadcast(t, g, process_set=ps),
        "broadcast_inplace": lambda: hvd.broadcast_(t.clone(), g, process_set=ps),
        "alltoall": lambda: hvd.alltoall(t, splits=[4] + [0] * (ps.size() - 1), process_set=ps),
        "alltoall_async": lambda: hvd.alltoall_async(t, process_set=ps),
        "reducescatter": lambda: hvd.reducescatter(t, process_set=ps),
        "reducescatter_async": lambda: hvd.reducescatter_async(t, process_set=ps),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([t, t], process_set=ps),
        "grouped_allreduce_": lambda: hvd.grouped_allreduce_([t.clone()], process_set=ps),
        "grouped_allreduce_async": lambda: hvd.grouped_allreduce_async([t], process_set=ps),
        "grouped_allgather": lambda: hvd.grouped_allgather([t], process_set=ps),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter([t], process_set=ps),
        "grad": lambda: hvd.allreduce(t.clone().requires_grad_(), process_set=ps),
        "adasum": lambda: hvd.allreduce(t, op=hvd.Adasum, process_set=ps),
        "unnamed_ops": lambda: hvd.allreduce(t, process_set=ps),
        "barrier": lambda: hvd.barrier(process_set=ps),
        "join": lambda: hvd.join(process_set=ps),
    }


def pset_nonmember(case, ps):
    kind = case.split(".")[1]
    if kind == "size_rank_included":
        assert ps.included() is False
        assert ps.size() == len(ps.ranks)
        expect_raises(ps.rank, ValueError, "not a member")
        return
    if kind == "interleaved_with_global":
        return pset_interleaved(case, ps, member=False)
    if kind == "join":    # the members gather join()'s results on COMM_WORLD afterwards
        exc = attempt(expect_raises, lambda: hvd.join(process_set=ps),
                      ValueError, "not a member")[1]
        COMM.allgather(None)
        if exc is not None:
            raise exc
        return
    ops = nonmember_ops(ps)
    fn = ops.get(kind)
    todo = [fn] if fn is not None else list(ops.values())
    if kind == "broadcast":     # every op kind once, on the first broadcast case
        todo = list(ops.values())
    for f in todo:
        expect_raises(f, ValueError, "not a member")


def set_inputs(case, members, dt, op, shape, small=False):
    return [make_input(case, k, dt, op, shape, small=small) for k in members]


def pset_member(case, ps, members):
    me, n = members.index(RANK), len(members)
    parts = case.split(".")
    kind = parts[1]
    if kind in ("allreduce", "allreduce_inplace", "allreduce_async"):
        op, dt = parts[2], parts[3]
        ins = set_inputs(case, members, dt, op, (2, 3))
        x = ins[me].clone()
        if kind == "allreduce":
            res, exc = attempt(hvd.allreduce, x, op=OP[op], name=case, process_set=ps)
        elif kind == "allreduce_inplace":
            res, exc = attempt(hvd.allreduce_, x, op=OP[op], name=case, process_set=ps)
        else:
            res, exc = attempt(lambda: hvd.synchronize(
                hvd.allreduce_async(x, op=OP[op], name=case, process_set=ps)))
        if exc is not None:
            raise exc
        check_values(res, C.reduce_reference(ins, op, dt), dt, exact_for(op, dt))
        if kind == "allreduce_inplace":
            assert res is x
    elif kind == "allreduce_scaled":
        ins = set_inputs(case, members, "float64", "Sum", (5,))
        res, exc = attempt(hvd.allreduce, ins[me].clone(), op=hvd.Average, name=case,
                           prescale_factor=2.0, postscale_factor=0.5, process_set=ps)
        if exc is not None:
            raise exc
        check_values(res, sum(t * 2.0 for t in ins) * (0.5 / n), "float64", exact=False)
    elif kind in ("allgather", "allgather_async"):
        dt = parts[2]
        ins = [C.op_input(case, k, dt, "Sum", (idx + 1, 2)) for idx, k in enumerate(members)]
        if kind == "allgather":
            res, exc = attempt(hvd.allgather, ins[me].clone(), name=case, process_set=ps)
        else:
            res, exc = attempt(lambda: hvd.synchronize(
                hvd.allgather_async(ins[me].clone(), name=case, process_set=ps)))
        if exc is not None:
            raise exc
        check_same(res, torch.cat(ins))
    elif kind in ("broadcast", "broadcast_inplace"):
        if parts[2] == "nonmember_root_raises":
            outside = [g for g in range(SIZE) if g not in members]
            if outside:
                expect_raises(lambda: hvd.broadcast(torch.ones(2), outside[0], name=case,
                                                    process_set=ps), ValueError, "root_rank")
            expect_raises(lambda: hvd.broadcast(torch.ones(2), SIZE, name=case + ".big",
                                                process_set=ps), ValueError, "root_rank")
            follow_up(case, ps)
            return
        root = int(parts[2][4:])
        ins = [C.op_input(case, k, "float32", "Sum", (3, 2)) for k in members]
        x = ins[me].clone()
        if kind == "broadcast":
            res, exc = attempt(hvd.broadcast, x, root, name=case, process_set=ps)
        else:
            res, exc = attempt(hvd.broadcast_, x, root, name=case, process_set=ps)
        if exc is not None:
            raise exc
        check_same(res, ins[members.index(root)])
        if kind == "broadcast_inplace":
            assert res is x
    elif kind in ("alltoall", "alltoall_async"):
        layout, dt = parts[2], parts[3]
        S = a2a_splits(case, n, "even" if layout == "even" else "sender_empty")
        ins = [C.op_input(case, k, dt, "Sum", (sum(S[idx]), 2))
               for idx, k in enumerate(members)]
        x = ins[me].clone()
        if kind == "alltoall_async":
            res, exc = attempt(lambda: hvd.synchronize(
                hvd.alltoall_async(x, splits=S[me], name=case, process_set=ps)))
        elif layout == "even":
            res, exc = attempt(hvd.alltoall, x, name=case, process_set=ps)
        else:
            res, exc = attempt(hvd.alltoall, x, splits=S[me], name=case, process_set=ps)
        if exc is not None:
            raise exc
        out = res if layout == "even" and kind == "alltoall" else res[0]
        check_same(out, a2a_expected(ins, S, me))
        if not (layout == "even" and kind == "alltoall"):
            assert res[1].tolist() == [S[k][me] for k in range(n)], res[1].tolist()
    elif kind in ("reducescatter", "reducescatter_async"):
        op, dt = parts[2], parts[3]
        ins = set_inputs(case, members, dt, op, (2 * n + 1, 2))
        if kind == "reducescatter":
            res, exc = attempt(hvd.reducescatter, ins[me].clone(), op=OP[op], name=case,
                               process_set=ps)
        else:
            res, exc = attempt(lambda: hvd.synchronize(hvd.reducescatter_async(
                ins[me].clone(), op=OP[op], name=case, process_set=ps)))
        if exc is not None:
            raise exc
        check_values(res, my_rows(C.reduce_reference(ins, op, dt), n, me), dt,
                     exact_for(op, dt))
    elif kind.startswith("grouped_allreduce"):
        op = parts[2]
        mem = [("int32", (3,)), ("float32", (2, 2)), ("float64", ()), ("bfloat16", (4,))]
        ins = [[make_input(f"{case}.{i}", k, dt, op, sh) for i, (dt, sh) in enumerate(mem)]
               for k in members]
        xs = [t.clone() for t in ins[me]]
        fn = {"grouped_allreduce": hvd.grouped_allreduce,
              "grouped_allreduce_": hvd.grouped_allreduce_,
              "grouped_allreduce_async": lambda *a, **kw: hvd.synchronize(
                  hvd.grouped_allreduce_async(*a, **kw))}[kind]
        res, exc = attempt(fn, xs, op=OP[op], name=case, process_set=ps)
        if exc is not None:
            raise exc
        check_group(res, mem, ins, op)
        if kind == "grouped_allreduce_":
            assert all(a is b for a, b in zip(res, xs))
    elif kind == "grouped_allgather":
        mem = [("float32", (2,)), ("int64", ()), ("bool", (3,))]
        ins = [[C.op_input(f"{case}.{i}", k, dt, "Sum",
                           () if tr == () and i == 1 else ((idx + i) % 3,) + tr)
                for i, (dt, tr) in enumerate(mem)] for idx, k in enumerate(members)]
        res, exc = attempt(hvd.grouped_allgather, [t.clone() for t in ins[me]], name=case,
                           process_set=ps)
        if exc is not None:
            raise exc
        check_gathered(res, [(dt, None if i == 1 else tr) for i, (dt, tr) in enumerate(mem)],
                       ins)
    elif kind == "grouped_reducescatter":
        mem = [("int32", (n + 1,)), ("float64", (2 * n - 1, 2))]
        ins = [[make_input(f"{case}.{i}", k, dt, "Sum", sh) for i, (dt, sh) in enumerate(mem)]
               for k in members]
        res, exc = attempt(hvd.grouped_reducescatter, [t.clone() for t in ins[me]],
                           op=hvd.Sum, name=case, process_set=ps)
        if exc is not None:
            raise exc
        check_group(res, mem, ins, "Sum", pick=lambda full: my_rows(full, n, me))
    elif kind == "grad":
        pset_grad(case, ps, members, me, n)
    elif kind == "adasum":
        ins = ada_inputs(case, members, (13,), "float64")
        res, exc = attempt(hvd.allreduce, ins[me].clone(), op=hvd.Adasum, name=case,
                           process_set=ps)
        if _pow2(n):
            if exc is not None:
                raise exc
            ada_check(res, ada_reference(ins, "float64"), "float64")
        else:
            assert isinstance(exc, ValueError) and "power-of-two" in str(exc), \
                f"Adasum on a set of {n} ranks: expected ValueError, got {exc!r}"
            follow_up(case, ps)
    elif kind == "unnamed_ops":
        ins = set_inputs(case, members, "int64", "Sum", (3,))
        outs = [attempt(hvd.allreduce, ins[me].clone(), op=hvd.Sum, process_set=ps)
                for _ in range(3)]
        g_out = attempt(hvd.allgather, ins[me].clone(), process_set=ps)
        for res, exc in outs:
            if exc is not None:
                raise exc
            check_values(res, C.reduce_reference(ins, "Sum", "int64"), "int64")
        if g_out[1] is not None:
            raise g_out[1]
        check_same(g_out[0], torch.cat(ins))
    elif kind == "interleaved_with_global":
        pset_interleaved(case, ps, member=True)
    elif kind == "join":
        pset_join(case, ps, members, me, n)
    elif kind == "size_rank_included":
        assert ps.included() is True
        assert ps.size() == n and ps.rank() == me and ps.ranks == members
        ids = hvd.get_process_set_ids_and_ranks()
        assert ids.get(ps.process_set_id) == members, ids
        assert ids.get(0) == list(range(SIZE)), ids
    else:
        raise AssertionError(f"no implementation for {case}")


def pset_interleaved(case, ps, member):
    """A set op and a global op in flight together, submitted in opposite orders on different
    ranks (the set's engine is independent of the global one)."""
    members = ps.ranks
    set_ins = [make_input(case + ".set", k, "float64", "Sum", (4,)) for k in members]
    glob_ins = [make_input(case + ".global", k, "int32", "Sum", (3,)) for k in range(SIZE)]
    handles = {}

    def submit_set():
        handles["set"] = attempt(hvd.allreduce_async, set_ins[members.index(RANK)].clone(),
                                 op=hvd.Sum, name=case + ".set", process_set=ps)

    def submit_global():
        handles["global"] = attempt(hvd.allreduce_async, glob_ins[RANK].clone(), op=hvd.Sum,
                                    name=case + ".global")
    if member and members.index(RANK) % 2 == 0:
        submit_set()
        submit_global()
    else:
        submit_global()
        if member:
            submit_set()
    results = {k: (attempt(hvd.synchronize, h) if e is None else (None, e))
               for k, (h, e) in handles.items()}
    for key, (res, exc) in results.items():
        if exc is not None:
            raise AssertionError(f"{key} op: {exc!r}")
    check_values(results["global"][0], C.reduce_reference(glob_ins, "Sum", "int32"), "int32",
                 what="global result")
    if member:
        check_values(results["set"][0], C.reduce_reference(set_ins, "Sum", "float64"),
                     "float64", what="set result")


def pset_join(case, ps, members, me, n):
    """The set's first member joins at once; the others allreduce on the set (the joined rank
    contributes zeros), then join; every member gets the same last rank, a member."""
    ins = set_inputs(case, members, "int32", "Sum", (3,))

    def run():
        out = None
        if me != 0:
            out = hvd.allreduce(ins[me].clone(), op=hvd.Sum, name=case, process_set=ps)
        return out, hvd.join(process_set=ps)
    res, exc = attempt(run)
    lasts = COMM.allgather(None if exc else res[1])
    if exc is not None:
        raise exc
    out = res[0]
    mine = [lasts[g] for g in members]
    assert mine == [mine[0]] * n and mine[0] in members[1:] + ([members[0]] if n == 1 else []), \
        f"join() on the set returned {mine} on ranks {members}"
    if out is not None:
        check_values(out, C.reduce_reference([torch.zeros_like(ins[0])] + ins[1:], "Sum",
                                             "int32"), "int32")
    follow_up(case, ps)


def pset_grad(case, ps, members, me, n):
    what = ".".join(case.split(".")[2:])
    xs = [randn(case, k, (3, 2)) for k in members]
    x = xs[me].clone().requires_grad_()

    def run():
        if what in ("allreduce.Sum", "allreduce.Average"):
            op = what.split(".")[1]
            y = hvd.allreduce(x, op=OP[op], name=case, process_set=ps)
        elif what == "allgather":
            y = hvd.allgather(x[:me + 1], name=case, process_set=ps)
        elif what == "broadcast":
            y = hvd.broadcast(x, members[-1], name=case, process_set=ps)
        elif what == "alltoall":
            y, _ = hvd.alltoall(x, splits=S[me], name=case, process_set=ps)
        elif what == "reducescatter.Average":
            y = hvd.reducescatter(x, name=case, process_set=ps)
        elif what == "grouped_allreduce.Sum":
            y = hvd.grouped_allreduce([x, x * 2.0], op=hvd.Sum, name=case, process_set=ps)
            y = torch.cat([y[0], y[1]])
        elif what == "grouped_allgather":
            y = hvd.grouped_allgather([x[:me + 1], x * 2.0], name=case, process_set=ps)
            y = torch.cat([y[0], y[1]])
        elif what == "grouped_reducescatter.Sum":
            y = hvd.grouped_reducescatter([x, x * 2.0], op=hvd.Sum, name=case, process_set=ps)
            y = torch.cat([y[0], y[1]])
        (y * ws[me]).sum().backward()
        return y
    # output shapes, hence the weights, depend on the op (shape of set rank idx's output)
    S = [[3 if j == (i + 1) % n else 0 for j in range(n)] for i in range(n)]   # alltoall
    rows = split_rows(3, n)                                                    # reducescatter
    gathered = sum(i + 1 for i in range(n))
    out_shapes = {"allgather": [(gathered, 2)] * n,
                  "grouped_allgather": [(gathered + 3 * n, 2)] * n,
                  "reducescatter.Average": [(rows[idx], 2) for idx in range(n)],
                  "grouped_reducescatter.Sum": [(2 * rows[idx], 2) for idx in range(n)],
                  "grouped_allreduce.Sum": [(6, 2)] * n}.get(what, [(3, 2)] * n)
    ws = [randn(case, k, out_shapes[idx], extra=1) for idx, k in enumerate(members)]
    exc = attempt(run)[1]
    if exc is not None:
        raise exc
    W = sum(ws) if len({w.shape for w in ws}) == 1 else None   # (reducescatter: per rank)
    # Horovod's gradients over the set's n ranks: allgather and broadcast average the upstream
    # gradients, reducescatter(Average) gathers them without dividing by n
    if what == "allreduce.Sum":
        expected = W
    elif what == "allreduce.Average":
        expected = W / n
    elif what in ("allgather", "grouped_allgather"):
        off = sum(i + 1 for i in range(me))
        expected = torch.zeros(3, 2, dtype=F64)
        expected[:me + 1] = W[off:off + me + 1] / n
        if what == "grouped_allgather":   # member 1: 2x, gathered whole (weights' 2nd half)
            expected += 2.0 * W[gathered:].reshape(n, 3, 2)[me] / n
    elif what == "broadcast":
        expected = W / n if RANK == members[-1] else torch.zeros(3, 2, dtype=F64)
    elif what == "alltoall":
        # my 3 rows went to set rank (me + 1) % n, landing at its position 0
        expected = ws[(me + 1) % n]
    elif what == "reducescatter.Average":
        expected = torch.cat(ws)
    elif what == "grouped_reducescatter.Sum":   # [x, 2x], Sum: times n
        expected = n * (torch.cat([w[:rows[i]] for i, w in enumerate(ws)])
                        + 2.0 * torch.cat([w[rows[i]:] for i, w in enumerate(ws)]))
    else:   # grouped Sum of [x, 2x]
        expected = W[:3] + 2.0 * W[3:]
    assert x.grad is not None, "no gradient reached the input"
    close(x.grad, expected, "x.grad", 1e-12)


def run_psets():
    for case in pset_cases(SIZE):
        i = int(case.split(".")[0][4:])
        ps, members = SETS[i], SET_RANKS[i]
        if RANK in members:
            r.case(case, pset_member, case, ps, members)
        else:
            r.case(case, pset_nonmember, case, ps)


# =================================================================================================
def main(mode: str) -> None:
    _setup(mode)
    if mode == "main":
        run_alltoall()
        run_reducescatter()
        run_grouped()
        run_join()
        run_adasum()
        run_validation()
    elif mode == "psets":
        run_psets()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    r.write()
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "main")
