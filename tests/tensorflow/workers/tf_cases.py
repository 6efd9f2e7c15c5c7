"""Case names of the ``hvdlite.tensorflow`` worker (pure Python: pytest collects them without
importing TensorFlow)."""
from __future__ import annotations

NP_VALUES = (2, 3)
MODES = ["eager", "graph"]
DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64",
          "float16", "bfloat16", "float32", "float64"]
REDUCE_OPS = ["Sum", "Average", "Min", "Max", "Product"]
KINDS = [f"allreduce_{op}" for op in REDUCE_OPS] + ["allgather", "broadcast"]


def op_cases() -> list[str]:
    return [f"ops.{mode}.{kind}.{dt}" for mode in MODES for kind in KINDS for dt in DTYPES
            if not (dt == "bool" and kind == "allreduce_Average")]


OTHER_CASES = [
    "ops.bool_average_rejected",
    "ops.unsupported_dtypes",
    "ops.scale_factors",
    "ops.grouped_allreduce",
    "ops.compression_fp16",
    "ops.broadcast_variables",
    "ops.broadcast_inplace",
    "ops.barrier_and_rank_ops",
    "ops.objects",
    "ops.graph_retrace_names",
    "grad.eager",
    "grad.graph",
    "errors.mismatch_eager",
    "errors.mismatch_graph",
    "tape.sparse",
    "tape.train_matches_reference_eager",
    "tape.train_matches_reference_graph",
    "tape.steady_state_reuses_result_memory",
    "optimizer.backward_passes_per_step",
    "keras.metric_average_callback",
    "keras.fit_end_to_end",
    "keras.load_model",
    "keras.warmup_schedule",
    "keras.schedule_callback",
    "mixed.torch_and_tf",
]

CASES = op_cases() + OTHER_CASES
