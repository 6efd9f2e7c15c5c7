"""Case lists and deterministic per-rank inputs for the ``hvdlite.torch`` worker scripts.

The case lists are pure Python (no torch import), so pytest can parametrize at collection time;
the input generators import torch lazily and are used by the workers, where every rank builds
*every* rank's input locally and computes its own torch reference for the collective's result.
"""
from __future__ import annotations

import zlib

NP_VALUES = (2, 3)

OPS = ["Average", "Sum", "Min", "Max", "Product"]
DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64",
          "float16", "bfloat16", "float32", "float64"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
INT_DTYPES = ["uint8", "int8", "int16", "int32", "int64"]
SHAPES = {"scalar": (), "vec": (7,), "cube": (2, 3, 4), "empty": (0,)}
EMPTY_3D = (2, 0, 3)     # one extra case runs every op x dtype on it

# allgather: trailing ("row") shape; None = scalar input (each rank contributes one element)
GATHER_SHAPES = {"scalar": None, "vec": (), "mat": (3,), "cube": (2, 2), "zerorows": (3,),
                 "emptyrow": (0,)}

SCALE_FACTORS = [(0.5, 1.0), (2.5, 0.25), (0.5, 3.0)]     # (prescale, postscale)


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def gather_rows(rank: int, shape_key: str) -> int:
    """Rows each rank contributes to an allgather: uneven; with "zerorows" rank 1 sends none."""
    if shape_key == "zerorows":
        return [3, 0, 2, 1][rank % 4]
    return rank + 1


# --- case lists --------------------------------------------------------------------------------
def _op_dtype_pairs():
    return [(op, dt) for op in OPS for dt in DTYPES if not (dt == "bool" and op == "Average")]


ALLREDUCE_VARIANTS = ["out", "inplace", "async", "async_inplace"]
NC_KINDS = {"transposed": ["out", "inplace", "async_inplace"],
            "strided": ["out", "inplace", "async_inplace"],
            "expanded": ["out", "async"]}
BROADCAST_VARIANTS = ["out", "inplace", "async", "async_inplace"]
BROADCAST_SHAPES = ["scalar", "vec", "cube", "empty"]


def allreduce_cases(size: int) -> list[str]:
    return [f"allreduce.{v}.{op}.{dt}.{sh}" for v in ALLREDUCE_VARIANTS
            for op, dt in _op_dtype_pairs() for sh in SHAPES]


def _nc_op_dtype_pairs():
    """Non-contiguous handling does not depend on the op: every dtype with Sum, every other op
    with a few dtypes."""
    return ([("Sum", dt) for dt in DTYPES]
            + [(op, dt) for op in OPS if op != "Sum" for dt in ("int32", "bfloat16", "float32")]
            + [(op, "bool") for op in ("Min", "Max")])


def allreduce_nc_cases(size: int) -> list[str]:
    return [f"allreduce_nc.{kind}.{v}.{op}.{dt}" for kind, variants in NC_KINDS.items()
            for v in variants for op, dt in _nc_op_dtype_pairs()]


def scaled_cases(size: int) -> list[str]:
    return [f"allreduce_scaled.{v}.{op}.{dt}.{i}" for v in ("out", "inplace")
            for op in ("Sum", "Average") for dt in DTYPES if dt != "bool"
            for i in range(len(SCALE_FACTORS))]


def broadcast_cases(size: int) -> list[str]:
    """Every root for 1-D tensors; the last rank as root for the other shapes."""
    return [f"broadcast.{v}.{dt}.{sh}.root{root}" for v in BROADCAST_VARIANTS for dt in DTYPES
            for sh in BROADCAST_SHAPES
            for root in (range(size) if sh == "vec" else [size - 1])]


def broadcast_nc_cases(size: int) -> list[str]:
    return [f"broadcast_nc.{kind}.{v}.{dt}" for kind in ("transposed", "strided")
            for v in ("out", "inplace", "async_inplace") for dt in DTYPES]


def allgather_cases(size: int) -> list[str]:
    return ([f"allgather.{v}.{dt}.{sh}" for v in ("out", "async") for dt in DTYPES
             for sh in GATHER_SHAPES]
            + [f"allgather_nc.transposed.{dt}" for dt in DTYPES])


MISC_OPS_CASES = (
    [f"allreduce_randn.{op}.{dt}" for op in OPS for dt in FLOAT_DTYPES]
    + [f"allreduce_int_trunc.{dt}" for dt in INT_DTYPES]
    + [f"allreduce_compressed.{c}.{dt}.{op}" for c in ("fp16", "bf16")
       for dt in ("float32", "float64") for op in ("Average", "Sum")]
    + [f"allreduce_compressed.{c}.int32.Sum" for c in ("fp16", "bf16")]
    + [f"allreduce_16bit_scaled_in_float32.{dt}.{v}" for dt in ("float16", "bfloat16")
       for v in ("Average", "Average_post0.1", "Sum_post0.3", "inplace_Average_post0.1")]
    + ["allreduce_empty3d_every_op_and_dtype", "allreduce_default_op_is_average",
       "allreduce_average_flag_true", "allreduce_average_flag_false", "allreduce_op_as_int",
       "async_poll_until_done", "async_many_mixed_kinds", "barrier_blocks",
       "allreduce_requires_grad_input_out_of_place", "results_identical_across_ranks",
       "allreduce_fast_path_taken"]
)


def grad_cases(size: int) -> list[str]:
    return ([f"grad.allreduce.{op}.{dt}" for op in ("Average", "Sum")
             for dt in ("float32", "float64")]
            + ["grad.allreduce.scaled.Sum", "grad.allreduce.scaled.Average",
               "grad.allreduce.default_op", "grad.allreduce.nonlinear",
               "grad.allreduce.compressed_fp16", "grad.allreduce.min_backward_raises",
               "grad.allgather.uneven.float32", "grad.allgather.uneven.float64",
               "grad.allgather.zerorows", "grad.allgather.scalar", "grad.allgather.3d"]
            + [f"grad.broadcast.root{root}" for root in range(size)]
            + ["grad.broadcast.inside_graph"])


def ops_cases(size: int) -> list[str]:
    return (allreduce_cases(size) + allreduce_nc_cases(size) + scaled_cases(size)
            + broadcast_cases(size) + broadcast_nc_cases(size) + allgather_cases(size)
            + MISC_OPS_CASES + grad_cases(size))


BUCKET_CASES = [
    "small_gradients_share_buckets",
    "plans_agree",
    "mixed_dtypes",
    "unused_on_some_ranks",
    "frozen_after_planning",
    "compression.fp16",
    "compression.bf16",
    "custom_compressor_goes_alone",
    "registration_order_differs",
    "reshaped_parameter",
    "reshaped_on_one_rank.fewer_elements",
    "reshaped_on_one_rank.same_elements",
    "sparse_stays_out",
    "bpps_with_unused",
    "replan_while_a_rank_has_joined",
    "join_with_reductions_in_flight",
]

OPTIMIZER_CASES = [
    "isinstance_and_api",
    "sgd_momentum.basic",
    "sgd_momentum.no_named_parameters",
    "sgd_momentum.float64",
    "bpps2",
    "bpps2_partial_step",
    "compression.fp16",
    "compression.bf16",
    "op_sum",
    "predivide_factor",
    "groups_int",
    "groups_list",
    "num_groups",
    "unused_param_rank0_only",
    "unused_param_everywhere",
    "unused_param_in_group",
    "noncontiguous_parameter",
    "frozen_parameter_with_groups",
    "clip_grad_norm",
    "steplr_scheduler",
    "adam",
    "broadcast_parameters_then_train",
    "wrap_optimizer_with_existing_state",
    "synchronize_then_step_reduces_once",
    "zero_grad_after_step_then_train",
    "gradients_take_fast_path",
    "add_param_group.named",
    "add_param_group.positional",
    "add_param_group.parameters_without_names",
    "set_backward_passes_per_step",
    "load_state_dict_restarts_accumulation",
    "rewrap_same_parameters",
    "dropped_optimizer_is_freed",
    "two_models_named_alike",
    "gan_without_freezing",
    "grads_reduced_when_backward_returns",
    "grad_scaler_recipe",
    "clip_grad_norm_without_synchronize",
    "backward_failure_then_synchronize",
    "reentrant_checkpoint",
    "names_of_a_dropped_optimizer",
    "step_with_closure.sgd",
    "step_with_closure.lbfgs",
    "torch_compile",
    "parameter_names",
]

STATE_OPTIMIZERS = ["sgd_momentum", "adam", "adamw", "rmsprop", "adagrad"]
# which ranks step before the broadcast (and how often): see torch_state_worker.pre_steps
STATE_CONDITIONS = ["fresh", "stepped", "root_only", "others_only"]
STATE_ORDERS = ["plain", "wrapped"]   # broadcast on the plain optimizer, or after wrapping


def state_cases(size: int) -> list[str]:
    return ([f"state.{opt}.{cond}.{order}.root{root}" for opt in STATE_OPTIMIZERS
             for cond in STATE_CONDITIONS for order in STATE_ORDERS for root in (0, 1)]
            + [f"params.state_dict_with_buffers.root{root}" for root in range(size)]
            + [f"params.named_parameters.root{root}" for root in range(size)]
            + ["scheduler.made_before.fresh", "scheduler.made_before.restored",
               "scheduler.made_before.plain_broadcast"]
            + ["lazy_state.sparse_adam", "lazy_state.sgd_sparse_embedding_model",
               "lazy_state.existing_grads_replaced", "lazy_state.stateless_sgd"]
            + ["params.list_of_pairs", "params.list_of_tensors", "params.noncontiguous_tensor",
               "params.bad_input"]
            + [f"object.broadcast.root{root}" for root in range(size)]
            + ["object.broadcast_large", "object.broadcast_none", "object.broadcast_custom_class",
               "object.allgather_nested", "object.allgather_uneven_sizes",
               "object.allgather_none_and_empty", "object.allgather_custom_class"])


ERROR_CASES = [
    "error_classes",
    "mismatch.allreduce_shape", "mismatch.allreduce_dtype", "mismatch.allreduce_op",
    "mismatch.allreduce_prescale", "mismatch.allreduce_unnamed_shape",
    "mismatch.allreduce_async", "mismatch.allreduce_inplace_dtype",
    "mismatch.broadcast_shape", "mismatch.broadcast_root", "mismatch.broadcast_dtype",
    "mismatch.allgather_trailing_shape", "mismatch.allgather_ndim", "mismatch.allgather_dtype",
    "mismatch.kind_allreduce_vs_broadcast", "mismatch.then_same_name_ok",
    "mismatch.optimizer_param_shapes",
    "mismatch.optimizer_error_frees_the_graph",
    "duplicate.allreduce_in_flight", "duplicate.across_kinds", "duplicate.after_completion_ok",
    "unsupported.complex64", "unsupported.complex128", "unsupported.complex_broadcast",
    "unsupported.complex_allgather", "unsupported.uint16", "unsupported.uint32",
    "unsupported.uint64", "unsupported.bool_average", "unsupported.non_cpu_device",
    "unsupported.sparse_inplace_and_allgather", "unsupported.sparse_out_of_place",
    "args.average_and_op", "args.broadcast_root_out_of_range", "args.not_a_tensor",
    "args.predivide_with_sum", "args.bpps_zero",
    "optimizer.zero_grad_in_flight", "optimizer.too_many_backward_passes",
    "optimizer.too_many_backward_passes_bpps2", "optimizer.duplicate_named_parameters",
    "optimizer.named_parameters_missing_param", "optimizer.named_parameters_not_pairs",
    "optimizer.sparse_grad_unsupported_op", "optimizer.sparse_as_dense",
    "optimizer.sync_error_waits_for_the_rest",
    "horovod_class.reducescatter_adasum", "horovod_class.unsupported_tensor_is_value_error",
    "horovod_class.adasum_ranks", "horovod_class.gradient_of_max",
    "horovod_class.poll_not_a_handle",
    "unnamed.not_a_tensor", "unnamed.sparse_allgather_async", "unnamed.average_and_op",
    "unnamed.grouped_member", "unnamed.reducescatter_adasum",
]


# --- deterministic inputs (workers only; torch imported lazily) --------------------------------
def torch_dtype(name: str):
    import torch
    return getattr(torch, name)


def op_input(case: str, rank: int, dtype: str, op: str, shape: tuple, small: bool = False):
    """Rank ``rank``'s input for ``case``.  Float values are multiples of 1/4 (or, for Product,
    from {+-0.5, +-1, +-1.5, +-2}), so Sum/Min/Max/Product are exact in every float dtype and
    every reduction order; integers are small enough that no reduction overflows."""
    import torch
    g = torch.Generator().manual_seed(seed_of(case, rank))
    shape = tuple(shape)
    if dtype == "bool":
        return torch.rand(shape, generator=g) < 0.5
    tdt = torch_dtype(dtype)
    if dtype in FLOAT_DTYPES:
        if op == "Product":
            choices = torch.tensor([-2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0],
                                   dtype=torch.float64)
            vals = choices[torch.randint(0, 8, shape, generator=g)]
        else:
            vals = torch.randint(-32, 33, shape, generator=g).to(torch.float64) / 4.0
        return vals.to(tdt)
    signed = dtype != "uint8"
    if op == "Product":
        lo, hi = (-4, 4) if signed else (0, 4)
    else:
        lo, hi = (-10, 10) if small else (-20, 20)
        if not signed:
            lo = 0
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(tdt)


def reduce_reference(inputs: list, op: str, dtype: str):
    """Torch reference for an allreduce over ``inputs`` (one per rank), in a wide dtype:
    int64 for integers and bool (0/1), float64 for floats."""
    import torch
    n = len(inputs)
    is_float = dtype in FLOAT_DTYPES
    wide = torch.float64 if is_float else torch.int64
    stk = torch.stack([t.to(wide) for t in inputs])
    if op == "Sum" or op == "Average":
        res = stk.sum(0)
    elif op == "Min":
        res = stk.amin(0)
    elif op == "Max":
        res = stk.amax(0)
    elif op == "Product":
        res = stk.prod(0)
    else:
        raise ValueError(op)
    if dtype == "bool":
        return (res > 0).to(torch.int64)    # Sum/Max = or, Min/Product = and on 0/1 values
    if op == "Average":
        if is_float:
            res = res / n
        else:   # integers: scaled by 1/size in float64, truncated toward zero
            res = (res.to(torch.float64) * (1.0 / n)).trunc().to(torch.int64)
    return res


FLOAT_TOL = {  # (rtol, atol) for results that involve rounding
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
    "float32": (2e-6, 1e-6),
    "float64": (1e-12, 1e-12),
}


# --- keeping the ranks in step -----------------------------------------------------------------
# A case that fails on some ranks only (say, an assertion before the case's next collective) would
# leave the other ranks waiting in that collective forever.  Workers therefore line the ranks up
# after every case (SyncedReporter), and jobs run with a stall timeout
# (tests.mpi_harness.STALL_SAFETY_NET_ENV), so a rank left waiting gets a StallError, its case
# fails, and the job goes on to the next case.


def synced_reporter(rank: int, comm):
    """A ``_report.Reporter`` whose ``case`` ends with an mpi4py barrier on ``comm``."""
    from tests.workers._report import Reporter

    class SyncedReporter(Reporter):
        def case(self, name, fn, *args, **kwargs):
            super().case(name, fn, *args, **kwargs)
            comm.Barrier()

    return SyncedReporter(rank)


# --- pytest side -------------------------------------------------------------------------------
def pytest_params(cases_for, xfail: dict | None = None, nps=NP_VALUES):
    """``pytest.param(np, case)`` for every np in ``nps`` and every case of ``cases_for(np)``
    (a function of np, or a fixed list); ``xfail`` maps case names to a known-bug reason."""
    import pytest
    out = []
    for np_ in nps:
        cases = cases_for(np_) if callable(cases_for) else cases_for
        for case in cases:
            marks = ()
            if xfail and case in xfail:
                marks = pytest.mark.xfail(strict=True, reason=xfail[case])
            out.append(pytest.param(np_, case, id=f"np{np_}-{case}", marks=marks))
    return out


def check_case(job, np_, case):
    """Fail unless every rank ran the job to the end and reported ``case`` as passed."""
    from tests.mpi_harness import case_failures, check_job
    check_job(job, np_)
    problems = case_failures(job, case)
    assert not problems, "\n".join(problems)


def check_reported_cases(job, np_, expected):
    """Every rank reported exactly the expected case names (no case silently missing)."""
    from tests.mpi_harness import check_job
    check_job(job, np_)
    for rank, report in enumerate(job.results):
        missing = sorted(set(expected) - set(report))
        extra = sorted(set(report) - set(expected))
        assert not missing and not extra, f"rank {rank}: missing {missing[:10]}, extra {extra[:10]}"


# --- checking trained models in workers -------------------------------------------------------
def bits(t) -> bytes:
    """The raw bytes of a tensor: equality of these is bitwise equality."""
    import torch
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_on_all_ranks(model, comm) -> None:
    """Every parameter bitwise identical on every rank (compared through mpi4py's ``comm``,
    independently of hvdlite)."""
    for name, p in model.named_parameters():
        gathered = comm.allgather(bits(p))
        assert all(g == gathered[0] for g in gathered), f"parameter {name!r} differs between ranks"


def close_to(model, ref, tol, what="parameter") -> None:
    """``model``'s parameters within ``tol`` of ``ref``'s, pairwise in order."""
    import torch
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach().double(), rtol=0, atol=tol,
                                   msg=lambda m, name=name: f"{what} {name!r}: {m}")


def moved(model, init, names=None) -> None:
    """Guard against vacuous comparisons: training must actually have changed the params."""
    import torch
    init_params = dict(init.named_parameters())
    for name, p in model.named_parameters():
        if names is None or name in names:
            assert not torch.equal(p, init_params[name]), f"{name!r} never changed"


# --- checking collectives in workers -------------------------------------------------------
def attempt(fn, *args, **kwargs):
    """(result, None) or (None, exception): run a collective, check afterwards."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - re-raised or checked by the caller
        return None, exc


def expect_raises(fn, cls, *needles):
    """``fn()`` must raise ``cls`` with every needle in the message; return the exception."""
    try:
        fn()
    except cls as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in the message: {exc}"
        return exc
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"expected {cls.__name__}, got {type(exc).__name__}: {exc}")
    raise AssertionError(f"expected {cls.__name__}, nothing was raised")
