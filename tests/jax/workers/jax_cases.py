"""Case names of tests/jax/workers/jax_worker.py (pure Python: pytest parametrizes over them at
collection time without importing JAX)."""
from __future__ import annotations

NP_VALUES = (2, 3)
MODES = ("eager", "jit")
OPS = ("Average", "Sum", "Min", "Max", "Product")
DTYPES = ("float32", "float16", "bfloat16", "int32", "uint8", "bool")


def _per_mode() -> list[str]:
    cases = [f"allreduce.{op}.{dt}" for op in OPS for dt in DTYPES
             if not (dt == "bool" and op == "Average")]
    cases += ["allreduce.scaled", "allreduce.compressed", "allreduce.average_flag",
              "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
              "alltoall", "reducescatter", "grouped_reducescatter", "process_set",
              "broadcast_parameters", "pytree",
              "grad.allreduce", "grad.allgather", "grad.broadcast", "grad.alltoall",
              "grad.reducescatter", "grad.grouped", "grad.min_raises",
              "optimizer.sgd", "optimizer.adam_bpps2"]
    # compression and process sets take the same path eagerly and in jit: jit only
    return [f"{c}.{mode}" for mode in MODES for c in cases] + [
        "optimizer.fp16.jit", "optimizer.process_set.jit"]


CASES = _per_mode() + [
    "allgather.uneven_eager",
    "alltoall.splits_eager",
    "mismatch.shape_in_jit",
    "mismatch.dtype_in_jit",
    "mismatch.allgather_rows_in_jit",
    "mismatch.eager",
    "mismatch.eager_failure_announced",
    "jit.independent_collectives_in_order",
    "jit.retrace_on_one_rank",
    "jit.eager_and_jit_interleaved",
    "jit.named_repeated",
    "jit.cond_and_scan",
    "jit.not_a_member_raises_at_trace",
    "optimizer.powersgd_refused",
    "elastic.state",
    "elastic.run_without_driver",
    "timeline.records_jit_collectives",
]
