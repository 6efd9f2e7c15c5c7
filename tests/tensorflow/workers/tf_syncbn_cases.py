"""Case names of the ``hvdlite.tensorflow.SyncBatchNormalization`` worker (pure Python: pytest
collects them without importing TensorFlow).  tests/tensorflow/workers/tf_syncbn_worker.py runs
exactly ``cases_for(size)`` and reports each case per rank."""
from __future__ import annotations

NP_VALUES = (2, 3)

COMMON_CASES = [
    "forward.eager.equal",
    "forward.graph.equal",
    "forward.eager.unequal",
    "forward.graph.unequal",
    "forward.float32.unequal",
    "forward.empty_rank",
    "forward.mask",
    "forward.renorm",
    "moving_stats.eager",
    "moving_stats.graph",
    "grads.eager",
    "grads.graph",
    "conv4d.nhwc_axis_last",
    "conv4d.nchw_axis1",
    "inference.no_collective",
    "collectives.one_forward_one_backward",
    "api.synchronized_argument",
    "api.fused_argument",
    "api.keras_layer_config_save_load",
    "fit.distributed_optimizer",
]
MULTI_RANK_CASES = ["forward.all_ranks_empty"]     # one rank: Keras' own (NaN) behaviour
SINGLE_RANK_CASES = ["single_rank.identical_to_keras"]


def cases_for(size: int) -> list[str]:
    return COMMON_CASES + (SINGLE_RANK_CASES if size == 1 else MULTI_RANK_CASES)
