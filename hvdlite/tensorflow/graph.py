"""Graph-mode plumbing of the TensorFlow ops: the graph node each collective becomes, the chain
that orders those nodes, and the names fixed when a graph is traced.

Eagerly :func:`graph_node` runs its function at once.  In a graph (``tf.function``, a TF1 graph) it
builds one stateful ``tf.numpy_function`` node, labelled ``hvdlite_<kind>_<name>`` (cut to 60
characters), with a control dependency on the graph's previous hvdlite node (see the ordering
note below).  :func:`op_name` gives an unnamed op its trace-time name,
``<kind>.tf.<function>.<k>`` (``<kind>.tf.set<id>.<function>.<k>`` on another process set), and
:func:`sub_name` the names of its parts and its gradient (``<name>.grad``); the scheme is
described in :mod:`hvdlite.tensorflow.mpi_ops`.  Each graph keeps its counters and its last node
in a :class:`_GraphState`, dropped with the graph.
"""
from __future__ import annotations

import itertools
import re
import weakref
from typing import Callable

import numpy as np
import tensorflow as tf

try:   # TensorFlow internals: tells whether a graph is being built for XLA
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:   # moved in some release: XLA then reports it itself
    GraphOrParentsInXlaContext = None

from . import errors as tf_errors
from .eager_arrays import as_tensor, host_array
from .membership import id_of

_graph_state: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _GraphState:
    __slots__ = ("counters", "last")

    def __init__(self) -> None:
        self.counters: dict[int, itertools.count] = {}   # process set id -> op counter
        self.last = None       # last chained hvdlite node of this graph (see broadcast_joins_chain)

    def next_index(self, set_id: int) -> int:
        counter = self.counters.get(set_id)
        if counter is None:
            counter = self.counters[set_id] = itertools.count()
        return next(counter)


def _state_of(graph) -> _GraphState:
    state = _graph_state.get(graph)
    if state is None:
        state = _graph_state[graph] = _GraphState()
    return state


def _graph_label(graph) -> str:
    name = getattr(graph, "name", "graph") or "graph"
    # Drop a trailing unique id (cond/while branch graphs get one) to stay equal across ranks.
    return re.sub(r"_\d+$", "", re.sub(r"[^A-Za-z0-9_.]", "_", name))


# --- ordering of the graph nodes -------------------------------------------------------------
# A node blocks a TensorFlow thread while its collective waits for the other ranks, so every
# rank must start its nodes in the same order: each node gets a control dependency on the
# graph's previous node (its chain).  TensorFlow's own order of independent nodes can differ
# between ranks (a TF1 session's executor does), so the chain is needed in TF1 graphs too,
# although there it makes a session.run that fetches a node also run the nodes built before it.
# The broadcasts of variables (broadcast_variables, broadcast_global_variables, broadcast_) stay
# out of a TF1 graph's chain: they are run on their own, typically once after the training step
# is built, and must not run (or need the feeds of) that step's collectives.
def broadcast_joins_chain(graph) -> bool:
    """Whether a variables broadcast built now joins the chain (see above)."""
    return getattr(graph, "building_function", False)


def last_node(graph):
    """The last hvdlite node chained in ``graph`` (None before the first)."""
    return _state_of(graph).last


def op_name(kind: str, name, process_set=None) -> str | None:
    """The name the core sees: the user's, or (inside tf.function) a trace-time derived one."""
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        return name
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    set_id = id_of(process_set)
    scope = "" if set_id == 0 else f"set{set_id}."
    return f"{kind}.tf.{scope}{_graph_label(graph)}.{_state_of(graph).next_index(set_id)}"


def sub_name(name: str | None, suffix: str) -> str | None:
    """The name of a part of op ``name`` (``<name>.<suffix>``), None for an unnamed op."""
    return None if name is None else f"{name}.{suffix}"


def node_label(kind: str, name) -> str:
    """The graph node's label, ``hvdlite_<kind>_<name>`` as a TF op name (60 characters)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", f"hvdlite_{kind}_{name or ''}")[:60]


def graph_node(label: str, fn: Callable[..., list], inputs: list, touts: list,
               chained: bool = True) -> list:
    """Run ``fn(*numpy inputs) -> list of numpy outputs`` now (eagerly) or as one stateful
    ``tf.numpy_function`` node, chained after the graph's previous hvdlite node unless
    ``chained`` is False (see broadcast_joins_chain).  Eager failures are raised as Horovod's TF
    error classes."""
    if tf.executing_eagerly():
        try:
            outs = fn(*[host_array(t) for t in inputs])
        except Exception as exc:  # noqa: BLE001 - re-raised as Horovod's class
            converted = tf_errors.to_tf_error(exc)
            if converted is exc:
                raise
            raise converted from None
        return [as_tensor(o, d) for o, d in zip(outs, touts)]

    def run(*arrays):
        return [np.asarray(o) for o in fn(*arrays)]

    graph = tf.compat.v1.get_default_graph()
    _refuse_xla(graph, label)
    state = _state_of(graph)
    deps = [state.last] if chained and state.last is not None else []
    with tf.control_dependencies(deps):
        outs = tf.numpy_function(run, inputs, touts, stateful=True, name=label)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if outs and chained:
        state.last = outs[0].op
    return outs


def _refuse_xla(graph, label: str) -> None:
    """Fail when traced for XLA (every rank traces alike, so every rank fails, before any
    collective): XLA cannot compile the Python node, and TensorFlow's own error (tf2xla
    conversion failed, deep in the first step) does not say why."""
    if GraphOrParentsInXlaContext is not None and GraphOrParentsInXlaContext(graph):
        raise NotImplementedError(
            f"hvdlite: the collective {label!r} cannot run inside an XLA-compiled function: "
            f"hvdlite's collectives run in Python, which XLA cannot compile. Pass "
            f"jit_compile=False to tf.function, or to model.compile (Keras's default "
            f"jit_compile=\"auto\" may pick XLA on a GPU).")


def set_static_shapes(outs, shapes) -> None:
    """In a graph, give each output its promised static shape (None: leave it unknown)."""
    if tf.executing_eagerly():
        return
    for out, shape in zip(outs, shapes):
        if shape is not None:
            out.set_shape(shape)
