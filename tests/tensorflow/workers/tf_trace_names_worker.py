"""The names ``hvdlite.tensorflow`` gives what it traces, recorded and compared with the names
pinned in ``tf_trace_names_cases.py``: the graph nodes (name, and the node before it in the
chain that orders them), the gradient functions ``tf.custom_gradient`` registers (the ops that
carry them), the constants of the topology ops, and the names the core is handed
(``<kind>.tf.<function>.<k>``, ``<name>.grad``, ...).  Ranks match collectives by these names,
so they must not change when the adapter's code moves.

A registered gradient's type is ``CustomGradient-<uid>``, with a process-wide TensorFlow counter
that differs between ranks (a broadcast's gradient builds one more op off its root): checked is
the pattern, and that TensorFlow's gradient registry holds a function under that name.

Set HVDLITE_TRACE_NAMES_DUMP to a directory to also write what each case recorded there
(``rank<r>.<case>.json``), e.g. to pin the names again after a TensorFlow upgrade.
"""
import json
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework import ops as tf_ops  # noqa: E402 - the gradient registry

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import hvdlite.tensorflow as hvd  # noqa: E402
from hvdlite.common import core  # noqa: E402
from tests.workers._report import Reporter  # noqa: E402
from tf_trace_names_cases import CASES, EXPECTED, SET_RANKS  # noqa: E402

PAIR = hvd.ProcessSet(list(SET_RANKS))
hvd.init(process_sets=[PAIR])
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)

# Every name the core is handed, in submission order: (kind, name), "group:" marking a group.
SUBMITTED: list = []
_submit, _submit_group = core.submit, core.submit_group


def _recording_submit(kind, array, name=None, **kwargs):
    SUBMITTED.append([kind, name])
    return _submit(kind, array, name=name, **kwargs)


def _recording_submit_group(kind, arrays, name=None, **kwargs):
    SUBMITTED.append([f"group:{kind}", name])
    return _submit_group(kind, arrays, name=name, **kwargs)


core.submit, core.submit_group = _recording_submit, _recording_submit_group


def graph_names(graph) -> dict:
    """The hvdlite nodes of ``graph`` as ``[name, the node it is chained after or None]``, and
    the ops that carry a registered gradient function, in creation order."""
    nodes, gradients = [], []
    for op in graph.get_operations():
        if op.type in ("PyFunc", "EagerPyFunc"):
            assert len(op.control_inputs) <= 1, (op.name, op.control_inputs)
            nodes.append([op.name, op.control_inputs[0].name if op.control_inputs else None])
        if "_gradient_op_type" in op.node_def.attr:
            kind = op.node_def.attr["_gradient_op_type"].s.decode()
            assert re.fullmatch(r"CustomGradient-\d+", kind), (op.name, kind)
            assert callable(tf_ops.gradient_registry.lookup(kind)), (op.name, kind)
            gradients.append(op.name)
    return {"nodes": nodes, "gradients": gradients}


def compare(case: str, got: dict) -> None:
    dump = os.environ.get("HVDLITE_TRACE_NAMES_DUMP")
    if dump:
        with open(os.path.join(dump, f"rank{RANK}.{case}.json"), "w") as f:
            json.dump(got, f, indent=1)
    want = EXPECTED[case] if RANK in SET_RANKS or case != "names.process_set" else {}
    want = json.loads(json.dumps(want))   # tuples as the lists JSON gives back
    for key in sorted(set(got) | set(want)):
        assert got.get(key) == want.get(key), (
            f"{case}: {key} differ\n got: {got.get(key)}\nwant: {want.get(key)}")


def tf_function_names():
    """One tf.function with every op kind and its gradients; then run it twice."""
    v = tf.Variable([1.0, 2.0, 3.0])
    w = tf.Variable([4.0])
    rows = [2] * SIZE

    @tf.function
    def step(x, values):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            tiled = tf.tile(x, [SIZE])
            outs = [hvd.allreduce(x), hvd.allreduce(x * 2, op=hvd.Sum, name="named_sum"),
                    hvd.allgather(x), *hvd.grouped_allgather([x, x + 1]),
                    hvd.broadcast(x, 0), hvd.reducescatter(tiled, op=hvd.Sum),
                    *hvd.grouped_reducescatter([tiled, tiled * 2]),
                    hvd.alltoall(tiled, splits=rows)[0], hvd.alltoall(tiled),
                    *hvd.grouped_allreduce([x, x * 3], compression=hvd.Compression.fp16)]
            loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        grad = tape.gradient(loss, x)
        sparse = hvd.allreduce(tf.IndexedSlices(values, tf.constant([0, 1], tf.int64),
                                                dense_shape=tf.constant([4, 2], tf.int64)))
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(x * x) + tf.reduce_sum(w * w)
        tape_grads = hvd.DistributedGradientTape(inner).gradient(y, [x, w])
        updated = hvd.broadcast_([v], 0, name="bcast_inplace")
        hvd.broadcast_variables([w], 0)
        joined = hvd.join()
        hvd.barrier()
        return grad, sparse.values, tape_grads, updated, joined

    args = (tf.constant([1.0, 2.0]), tf.ones([2, 2]))
    graph = step.get_concrete_function(*args).graph
    got = graph_names(graph)
    for _ in range(2):
        del SUBMITTED[:]
        step(*args)
    got["submitted"] = list(SUBMITTED)
    compare("names.tf_function", got)


def topology_names():
    """The topology ops' constants keep the names they are given, also inside tf.function."""
    @tf.function
    def topo():
        return [hvd.size_op(name="topo_size"), hvd.rank_op(name="topo_rank"),
                hvd.local_size_op(name="topo_local_size"),
                hvd.local_rank_op(name="topo_local_rank"),
                hvd.cross_size_op(name="topo_cross_size"),
                hvd.cross_rank_op(name="topo_cross_rank"),
                hvd.size_op(PAIR.process_set_id, name="topo_set_size"),
                hvd.process_set_included_op(PAIR.process_set_id, name="topo_included")]

    graph = topo.get_concrete_function().graph
    consts = [[op.name, op.type] for op in graph.get_operations() if op.name.startswith("topo")]
    values = [int(t) for t in topo()]
    assert values[:2] == [SIZE, RANK], values
    compare("names.topology", {"consts": consts})


def process_set_names():
    """Ops on another process set are named and counted apart (members only)."""
    if RANK not in SET_RANKS:
        compare("names.process_set", {})
        return

    @tf.function
    def on_set(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            a = hvd.allreduce(x, process_set=PAIR)
            b = hvd.allgather(x, process_set=PAIR)
        return tape.gradient(tf.reduce_sum(a) + tf.reduce_sum(b), x)

    x = tf.constant([1.0, 2.0])
    got = graph_names(on_set.get_concrete_function(x).graph)
    del SUBMITTED[:]
    on_set(x)
    got["submitted"] = list(SUBMITTED)
    compare("names.process_set", got)


def tf1_graph_names():
    """A TF1 graph run by a Session: the chain, and the variables broadcast outside it."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2])
        tf.compat.v1.Variable([1.0, 2.0], name="tf1_var")
        a = hvd.allreduce(x)
        b = hvd.allgather(x, name="tf1_named")
        grads = tf.gradients(tf.reduce_sum(a) + tf.reduce_sum(b), [x])
        bcast = hvd.broadcast_global_variables(0)
        init = tf.compat.v1.global_variables_initializer()
    got = graph_names(graph)
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        del SUBMITTED[:]
        session.run(bcast)
        session.run([a, b, grads], feed_dict={x: [1.0, 2.0]})
    got["submitted"] = list(SUBMITTED)
    compare("names.tf1_graph", got)


def eager_names():
    """Eagerly, unnamed ops leave naming to the core; named ones and their parts keep theirs."""
    del SUBMITTED[:]
    x = tf.constant([1.0, 2.0])
    hvd.allreduce(x)
    hvd.allreduce(x, name="eager_named")
    hvd.grouped_allreduce([x, x], name="eager_group")
    hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0], tf.int64),
                                   dense_shape=tf.constant([3, 2], tf.int64)), name="eager_sparse")
    hvd.broadcast_variables([tf.Variable([1.0])], 0)
    hvd.broadcast_([tf.Variable([1.0])], 0, name="eager_inplace")
    compare("names.eager", {"submitted": list(SUBMITTED)})


CASE_FUNCTIONS = {"names.tf_function": tf_function_names, "names.topology": topology_names,
                  "names.process_set": process_set_names, "names.tf1_graph": tf1_graph_names,
                  "names.eager": eager_names}
assert list(CASE_FUNCTIONS) == CASES
for name in CASES:
    r.case(name, CASE_FUNCTIONS[name])
r.write()
hvd.shutdown()
