"""Case lists and deterministic inputs shared by the core worker scripts and the pytest side.

Pure Python + numpy: importable without MPI, so pytest can parametrize at collection time and the
workers (which run on every rank) generate exactly the same inputs for every rank locally, which
lets each rank compute its own numpy reference for the collective's result.
"""
from __future__ import annotations

import os
import zlib

import numpy as np

OPS = ["Average", "Sum", "Min", "Max", "Product"]
DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "bfloat16", "float32", "float64"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
INT_DTYPES = [d for d in DTYPES if d not in FLOAT_DTYPES and d != "bool"]
SHAPES = {"scalar": (), "vec": (7,), "cube": (2, 3, 4), "empty": (0,), "empty3d": (2, 0, 3)}

# allgather: trailing ("row") shapes; the first dimension differs per rank (see gather_rows)
GATHER_SHAPES = {"scalar": None, "vec": (), "mat": (3,), "cube": (2, 2), "emptyrow": (0, 2),
                 "allzero": (4,)}

SCALE_FACTORS = [(0.5, 1.0), (1.0, 3.0), (2.5, 0.25), (0.5, 3.0)]   # (prescale, postscale)
WRAP_DTYPES = INT_DTYPES

NP_VALUES = (2, 3)


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rng_for(case: str, rank: int, extra=0) -> np.random.Generator:
    return np.random.default_rng([seed_of(case, extra), rank])


def op_input(case: str, rank: int, dtype: str, op: str, shape: tuple) -> np.ndarray:
    """Per-rank input whose reduction cannot overflow and, for floats, is exactly representable
    (so Sum/Min/Max/Product results are exact whatever order MPI reduces in)."""
    rng = rng_for(case, rank)
    dt = np_dtype(dtype)
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype in FLOAT_DTYPES:
        if op == "Product":
            vals = rng.choice([-2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0], size=shape)
        else:
            vals = rng.integers(-32, 33, size=shape) / 4.0
        return np.asarray(vals).astype(dt)
    signed = dt.kind == "i"
    if op == "Product":
        lo, hi = (-4, 4) if signed else (0, 4)
    else:
        lo, hi = (-20, 20) if signed else (0, 20)
    return np.asarray(rng.integers(lo, hi + 1, size=shape)).astype(dt)


def allreduce_cases(size: int) -> list[str]:
    return [f"allreduce.{op}.{dt}.{sh}" for op in OPS for dt in DTYPES for sh in SHAPES
            if not (dt == "bool" and op == "Average")]


def scaled_cases(size: int) -> list[str]:
    return [f"allreduce_scaled.{op}.{dt}" for op in OPS for dt in DTYPES if dt != "bool"]


def random_float_cases(size: int) -> list[str]:
    return [f"allreduce_randfloat.{op}.{dt}" for op in OPS for dt in FLOAT_DTYPES]


def wrap_cases(size: int) -> list[str]:
    return ([f"allreduce_wrap.Sum.{dt}" for dt in WRAP_DTYPES]
            + [f"allreduce_wrap.Product.{dt}" for dt in ("int8", "uint8", "int16", "uint16")])


def gather_rows(rank: int, size: int, shape_key: str) -> int:
    """First dimension of rank's allgather input: differs per rank, rank 1 contributes 0 rows."""
    if shape_key == "allzero":
        return 0
    return 0 if rank == 1 else rank + 2


def allgather_cases(size: int) -> list[str]:
    return [f"allgather.{dt}.{sh}" for dt in DTYPES for sh in GATHER_SHAPES]


def broadcast_cases(size: int) -> list[str]:
    return [f"broadcast.{dt}.{sh}.root{root}" for dt in DTYPES for sh in SHAPES
            for root in range(size)]


MISC_OPS_CASES = [
    "scalar_shape.allreduce", "scalar_shape.allreduce_async", "scalar_shape.allreduce_inplace",
    "scalar_shape.broadcast", "scalar_shape.broadcast_inplace", "scalar_shape.allgather",
    "legacy_average_flag", "op_as_int", "default_op_is_average",
    "noncontiguous_allgather", "noncontiguous_broadcast_out_of_place",
    "barrier", "handle_poll_and_repeat_wait", "unnamed_ops_in_order",
    "order.reversed", "order.shuffled_200_mixed_kinds", "order.many_async_200",
    "order.wait_in_reverse", "order.interleaved_with_sync",
    "large_tensor", "results_bitwise_identical_across_ranks",
]


def ops_cases(size: int) -> list[str]:
    return (allreduce_cases(size) + scaled_cases(size) + random_float_cases(size)
            + wrap_cases(size) + allgather_cases(size) + broadcast_cases(size) + MISC_OPS_CASES)


# cases the library is known to fail (see the BUG notes in tests/core/test_ops.py)

# --- steady state / fusion / cache -------------------------------------------------------------
STEADY_CASES = [
    "config_applied",
    "steady.same_names_mixed",
    "steady.many_steps_cached",
    "steady.shape_change",
    "steady.shape_change_one_rank_first_dim",
    "steady.dtype_change",
    "steady.op_change",
    "steady.scale_change",
    "steady.kind_change",
    "steady.root_change",
    "steady.large_and_small",
    "steady.fused_scaled",
    "steady.inplace_and_noncontiguous_fused",
    "steady.unnamed",
    "steady.more_names_than_cache",
    "steady.out_of_order_repeated",
    "steady.pooled_results",
    "steady.shared_fusion",
    "steady.large_single",
]

# name -> extra environment for the steady-state worker
STEADY_CONFIGS = {
    "default": {},
    "fusion_off": {"HVDLITE_FUSION_THRESHOLD": "0"},
    "fusion_4096": {"HVDLITE_FUSION_THRESHOLD": "4096"},
    "cache_off": {"HVDLITE_CACHE_CAPACITY": "0"},
    "cache_3_fusion_4096": {"HVDLITE_CACHE_CAPACITY": "3", "HVDLITE_FUSION_THRESHOLD": "4096"},
    "horovod_alias_fusion_off": {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CACHE_CAPACITY": "0"},
    "result_pool_off": {"HVDLITE_RESULT_POOL_MB": "0"},
    "shm_fusion_off": {"HVDLITE_SHM_WINDOW_MB": "0"},
    "cma_off": {"HVDLITE_DIRECT_COPIES": "0"},
    "intranode_off": {"HVDLITE_DIRECT_COPIES": "0", "HVDLITE_SHM_WINDOW_MB": "0"},
    # A long cycle gathers longer but must not slow every wait on peers down to it (that made
    # each step take seconds, and a lost probe answer made a rank wait forever).
    "cycle_500ms": {"HVDLITE_CYCLE_TIME": "500"},
}

# --- errors ------------------------------------------------------------------------------------
ERROR_CASES = [
    "mismatch.shape", "mismatch.dtype", "mismatch.op", "mismatch.root", "mismatch.prescale",
    "mismatch.postscale", "mismatch.kind_allreduce_vs_broadcast",
    "mismatch.kind_allgather_vs_allreduce", "mismatch.allgather_trailing_shape",
    "mismatch.allgather_ndim", "mismatch.async_with_good_neighbours", "mismatch.after_cached",
    "mismatch.error_types", "mismatch.rank0_is_odd_one",
    "duplicate.all_ranks", "duplicate.one_rank", "duplicate.after_completion_ok",
    "unsupported.complex", "unsupported.object", "unsupported.str", "unsupported.adasum",
    "unsupported.bool_average", "unsupported.bool_default_op",
    "broadcast.root_out_of_range", "broadcast.root_negative",
    "args.average_and_op", "args.unknown_op", "args.readonly_inplace",
    "synchronize_non_handle", "objects.unpicklable_root", "objects.unpicklable_some_ranks",
    "unnamed.core_check", "unnamed.argument_check", "unnamed.async",
    "unnamed.alltoall_splits", "unnamed.grouped_before_submit", "unnamed.grouped_member",
    "unnamed.all_ranks", "after_shutdown.ops_raise", "after_shutdown.reinit_works",
]


def direct_copies_expected(backend) -> bool:
    """Whether the single large allreduces of a worker must have gone by direct copies between
    the ranks' memory.  Where the kernel forbade them (the probe failed) that is a failure,
    unless the machine is declared to forbid them: HVDLITE_TEST_CMA_OPTIONAL=1 (for instance
    where /proc/sys/kernel/yama/ptrace_scope is 2 or more; at 1 hvdlite lets the job's
    launcher in)."""
    direct = backend.direct
    if direct is None:
        return False
    if direct.available:
        return True
    if os.environ.get("HVDLITE_TEST_CMA_OPTIONAL") == "1":
        return False
    raise AssertionError(f"direct copies between ranks were found unavailable "
                         f"({direct.unavailable_reason}); if this machine forbids them, set "
                         f"HVDLITE_TEST_CMA_OPTIONAL=1")
