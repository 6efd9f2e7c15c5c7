"""Case names of the TensorFlow Horovod-fidelity worker (pure Python: pytest collects them
without importing TensorFlow).  See tests/tensorflow/workers/tf_fidelity_worker.py.

Modes: ``session`` (a TF1 graph run by ``tf.compat.v1.Session``, gradients by
``tf.compat.v1.gradients``), ``outer`` (forward inside ``tf.function``, gradient by a tape
outside it), ``graph`` (tape and forward inside one ``tf.function``) and ``eager``.  The worker
runs the graph modes first and eager last, the order in which a graph gradient that skipped a
collective on some ranks used to hang.
"""
from __future__ import annotations

NP_VALUES = (2, 3)
MODES = ["session", "outer", "graph", "eager"]
GRAPH_BUILD_MODES = ["session", "graph", "eager"]   # no gradient involved: no "outer"

GRAD_CASES = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
              "reducescatter", "grouped_reducescatter", "alltoall", "alltoall_fewer_rows",
              "process_set"]
SPARSE_CASES = ["grouped_mixed_average", "integer_average", "scale_factors_rejected",
                "ops_rejected"]
ERROR_CASES = ["mismatch", "arguments"]

PER_MODE = [f"grad.{c}" for c in GRAD_CASES]
PER_BUILD_MODE = ([f"sparse.{c}" for c in SPARSE_CASES] + [f"errors.{c}" for c in ERROR_CASES]
                  + ["alltoall.fewer_rows"])

OTHER_CASES = [
    "errors.reducescatter_adasum",
    "errors.graph_run_time",
    "ops.process_set_codes",
    "session.broadcast_inplace",
    "session.broadcast_variables_after_train_op",
    "session.legacy_optimizer",
    "eager.legacy_optimizer",
    "nonmember.tape",
    "nonmember.keras",
    "nonmember.legacy_optimizer",
    "tape.horovod_signature",
    "optimizer.groups_arguments",
    "unnamed.eager_dtype",
    "unnamed.eager_root_rank",
    "unnamed.eager_splits",
    "unnamed.eager_grouped_member",
    "eager.zero_copy",
    "eager.records_only_under_a_tape",
]

CASES = ([f"{c}.{m}" for m in MODES for c in PER_MODE]
         + [f"{c}.{m}" for m in GRAPH_BUILD_MODES for c in PER_BUILD_MODE]
         + OTHER_CASES)
