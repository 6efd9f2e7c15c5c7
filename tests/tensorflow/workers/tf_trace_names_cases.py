"""Case names and pinned names of tests/tensorflow/workers/tf_trace_names_worker.py (pure Python:
pytest collects them without importing TensorFlow).

The names below were recorded from the adapter before tensorflow/mpi_ops.py was split by
concern (issue 34), and agree with the scheme mpi_ops documents: ``<kind>.tf.<function>.<k>``
for an unnamed op traced in ``<function>`` (``k`` counting that graph's ops in program order,
``set<id>.`` before the function for another process set, counted apart), the user's name
otherwise, ``<name>.grad`` for its gradient (``.rows``, ``.values``, ``.indices`` for the parts
of one op), ``graph`` for a TF1 graph, ``None`` eagerly (the core names those).  A graph node is
``hvdlite_<kind>_<name>`` cut to 60 characters, chained after the node built before it, except
a TF1 graph's variables broadcast.  Every rank records the same names.
"""
from __future__ import annotations

NP_VALUES = (2, 3)
SET_RANKS = (1,)   # a process set that is not the global one at 2 and 3 ranks
CASES = ["names.tf_function", "names.topology", "names.process_set", "names.tf1_graph",
         "names.eager"]

EXPECTED: dict = {
    "names.tf_function": {
        "nodes": [
            ("hvdlite_allreduce_allreduce.tf.step.0", None),
            ("hvdlite_allreduce_named_sum", "hvdlite_allreduce_allreduce.tf.step.0"),
            ("hvdlite_allgather_allgather.tf.step.1", "hvdlite_allreduce_named_sum"),
            ("hvdlite_grouped_allgather_grouped_allgather.tf.step.2",
             "hvdlite_allgather_allgather.tf.step.1"),
            ("hvdlite_broadcast_broadcast.tf.step.3",
             "hvdlite_grouped_allgather_grouped_allgather.tf.step.2"),
            ("hvdlite_reducescatter_reducescatter.tf.step.4",
             "hvdlite_broadcast_broadcast.tf.step.3"),
            ("hvdlite_grouped_reducescatter_grouped_reducescatter.tf.step.",
             "hvdlite_reducescatter_reducescatter.tf.step.4"),
            ("hvdlite_alltoall_alltoall.tf.step.6",
             "hvdlite_grouped_reducescatter_grouped_reducescatter.tf.step."),
            ("hvdlite_alltoall_alltoall.tf.step.7", "hvdlite_alltoall_alltoall.tf.step.6"),
            ("hvdlite_grouped_allreduce_grouped_allreduce.tf.step.8",
             "hvdlite_alltoall_alltoall.tf.step.7"),
            ("hvdlite_allreduce_allreduce.tf.step.0.grad",
             "hvdlite_grouped_allreduce_grouped_allreduce.tf.step.8"),
            ("hvdlite_allreduce_named_sum.grad", "hvdlite_allreduce_allreduce.tf.step.0.grad"),
            ("hvdlite_allreduce_allgather.tf.step.1.grad", "hvdlite_allreduce_named_sum.grad"),
            ("hvdlite_allgather_allgather.tf.step.1.grad.rows",
             "hvdlite_allreduce_allgather.tf.step.1.grad"),
            ("hvdlite_grouped_allreduce_grouped_allgather.tf.step.2.grad",
             "hvdlite_allgather_allgather.tf.step.1.grad.rows"),
            ("hvdlite_grouped_allgather_grouped_allgather.tf.step.2.grad.r",
             "hvdlite_grouped_allreduce_grouped_allgather.tf.step.2.grad"),
            ("hvdlite_allreduce_broadcast.tf.step.3.grad",
             "hvdlite_grouped_allgather_grouped_allgather.tf.step.2.grad.r"),
            ("hvdlite_allgather_reducescatter.tf.step.4.grad",
             "hvdlite_allreduce_broadcast.tf.step.3.grad"),
            ("hvdlite_grouped_allgather_grouped_reducescatter.tf.step.5.gr",
             "hvdlite_allgather_reducescatter.tf.step.4.grad"),
            ("hvdlite_alltoall_alltoall.tf.step.6.grad",
             "hvdlite_grouped_allgather_grouped_reducescatter.tf.step.5.gr"),
            ("hvdlite_alltoall_alltoall.tf.step.7.grad",
             "hvdlite_alltoall_alltoall.tf.step.6.grad"),
            ("hvdlite_grouped_allreduce_grouped_allreduce.tf.step.8.grad",
             "hvdlite_alltoall_alltoall.tf.step.7.grad"),
            ("hvdlite_allgather_allreduce.tf.step.9.values",
             "hvdlite_grouped_allreduce_grouped_allreduce.tf.step.8.grad"),
            ("hvdlite_allgather_allreduce.tf.step.9.indices",
             "hvdlite_allgather_allreduce.tf.step.9.values"),
            ("hvdlite_grouped_allreduce_DistributedGradientTape.allreduce",
             "hvdlite_allgather_allreduce.tf.step.9.indices"),
            ("hvdlite_broadcast_bcast_inplace.0.Variable_0",
             "hvdlite_grouped_allreduce_DistributedGradientTape.allreduce"),
            ("hvdlite_broadcast_broadcast_variables.tf.step.10.0.Variable_",
             "hvdlite_broadcast_bcast_inplace.0.Variable_0"),
            ("hvdlite_join", "hvdlite_broadcast_broadcast_variables.tf.step.10.0.Variable_"),
            ("hvdlite_barrier", "hvdlite_join"),
        ],
        "gradients": [
            "IdentityN", "IdentityN_1", "IdentityN_2", "IdentityN_3", "IdentityN_4",
            "IdentityN_5", "IdentityN_6", "IdentityN_7", "IdentityN_8", "IdentityN_9",
            "IdentityN_10", "IdentityN_11", "IdentityN_12", "IdentityN_13", "IdentityN_14",
            "IdentityN_15", "IdentityN_16", "IdentityN_17", "IdentityN_18", "IdentityN_19"
        ],
        "submitted": [
            ("allreduce", "allreduce.tf.step.0"),
            ("allreduce", "named_sum"),
            ("allgather", "allgather.tf.step.1"),
            ("group:allgather", "grouped_allgather.tf.step.2"),
            ("broadcast", "broadcast.tf.step.3"),
            ("reducescatter", "reducescatter.tf.step.4"),
            ("group:reducescatter", "grouped_reducescatter.tf.step.5"),
            ("alltoall", "alltoall.tf.step.6"),
            ("alltoall", "alltoall.tf.step.7"),
            ("group:allreduce", "grouped_allreduce.tf.step.8"),
            ("allreduce", "allreduce.tf.step.0.grad"),
            ("allreduce", "named_sum.grad"),
            ("allreduce", "allgather.tf.step.1.grad"),
            ("allgather", "allgather.tf.step.1.grad.rows"),
            ("group:allreduce", "grouped_allgather.tf.step.2.grad"),
            ("group:allgather", "grouped_allgather.tf.step.2.grad.rows"),
            ("allreduce", "broadcast.tf.step.3.grad"),
            ("allgather", "reducescatter.tf.step.4.grad"),
            ("group:allgather", "grouped_reducescatter.tf.step.5.grad"),
            ("alltoall", "alltoall.tf.step.6.grad"),
            ("alltoall", "alltoall.tf.step.7.grad"),
            ("group:allreduce", "grouped_allreduce.tf.step.8.grad"),
            ("allgather", "allreduce.tf.step.9.values"),
            ("allgather", "allreduce.tf.step.9.indices"),
            ("group:allreduce", "DistributedGradientTape.allreduce"),
            ("broadcast", "bcast_inplace.0.Variable:0"),
            ("broadcast", "broadcast_variables.tf.step.10.0.Variable:0"),
        ],
    },
    "names.topology": {
        "consts": [
            ("topo_size", "Const"),
            ("topo_rank", "Const"),
            ("topo_local_size", "Const"),
            ("topo_local_rank", "Const"),
            ("topo_cross_size", "Const"),
            ("topo_cross_rank", "Const"),
            ("topo_set_size", "Const"),
            ("topo_included", "Const"),
        ],
    },
    "names.process_set": {
        "nodes": [
            ("hvdlite_allreduce_allreduce.tf.set1.on_set.0", None),
            ("hvdlite_allgather_allgather.tf.set1.on_set.1",
             "hvdlite_allreduce_allreduce.tf.set1.on_set.0"),
        ],
        "gradients": [
            "IdentityN", "IdentityN_1"
        ],
        "submitted": [
            ("allreduce", "allreduce.tf.set1.on_set.0"),
            ("allgather", "allgather.tf.set1.on_set.1"),
        ],
    },
    "names.tf1_graph": {
        "nodes": [
            ("hvdlite_allreduce_allreduce.tf.graph.0", None),
            ("hvdlite_allgather_tf1_named", "hvdlite_allreduce_allreduce.tf.graph.0"),
            ("gradients/IdentityN_grad/hvdlite_allreduce_allreduce.tf.graph.0.grad",
             "hvdlite_allgather_tf1_named"),
            ("gradients/IdentityN_1_grad/hvdlite_allreduce_tf1_named.grad",
             "gradients/IdentityN_grad/hvdlite_allreduce_allreduce.tf.graph.0.grad"),
            ("gradients/IdentityN_1_grad/hvdlite_allgather_tf1_named.grad.rows",
             "gradients/IdentityN_1_grad/hvdlite_allreduce_tf1_named.grad"),
            ("hvdlite_broadcast_broadcast_variables.tf.graph.1.0.tf1_var_0", None),
        ],
        "gradients": [
            "IdentityN", "IdentityN_1", "gradients/IdentityN_grad/IdentityN",
            "gradients/IdentityN_1_grad/IdentityN"
        ],
        "submitted": [
            ("broadcast", "broadcast_variables.tf.graph.1.0.tf1_var:0"),
            ("allreduce", "allreduce.tf.graph.0"),
            ("allgather", "tf1_named"),
            ("allreduce", "allreduce.tf.graph.0.grad"),
            ("allreduce", "tf1_named.grad"),
            ("allgather", "tf1_named.grad.rows"),
        ],
    },
    "names.eager": {
        "submitted": [
            ("allreduce", None),
            ("allreduce", "eager_named"),
            ("group:allreduce", "eager_group"),
            ("allgather", "eager_sparse.values"),
            ("allgather", "eager_sparse.indices"),
            ("broadcast", "broadcast_variables.0.Variable:0"),
            ("broadcast", "eager_inplace.0.Variable:0"),
        ],
    },
}
