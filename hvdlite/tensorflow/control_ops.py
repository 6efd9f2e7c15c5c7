"""The public barrier and join ops: collectives without tensors, each an int32 scalar graph node
inside ``tf.function`` (eagerly, ``barrier`` returns None)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from hvdlite.common import core
from hvdlite.common.core import global_process_set, ProcessSet

from .errors import public_op
from .graph import graph_node, set_static_shapes
from .membership import members_of


def _control_op(label: str, fn: Callable[[], int]):
    """Eager: run ``fn`` now; graph: one chained node.  Returns an int32 scalar tensor."""
    out = graph_node(label, lambda: [np.int32(fn())], [], [tf.int32])[0]
    set_static_shapes([out], [tf.TensorShape([])])
    return out


@public_op
def barrier(process_set: ProcessSet | None = global_process_set):
    """Block until every rank of ``process_set`` reaches the barrier.  Eagerly returns None;
    inside ``tf.function`` it is a graph node (returned, an int32 scalar)."""
    members_of(process_set, "barrier")
    if tf.executing_eagerly():
        core.barrier(process_set)
        return None

    def run() -> int:
        core.barrier(process_set)
        return 0

    return _control_op("hvdlite_barrier", run)


@public_op
def join(process_set: ProcessSet | None = global_process_set):
    """Declare that this rank has run out of data and block until every rank (of
    ``process_set``) has joined.

    Until then this rank keeps taking part in the other ranks' allreduces, contributing zeros
    (so Average still divides by the full number of ranks, as in Horovod); other collectives
    cannot run while a rank is joined.  Returns an int32 scalar tensor: the global rank of the
    last rank to join (eagerly and inside ``tf.function``).
    """
    members_of(process_set, "join")
    return _control_op("hvdlite_join", lambda: core.join(process_set))
