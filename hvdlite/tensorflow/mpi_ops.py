"""Horovod-compatible collective ops on TensorFlow tensors: eagerly, inside ``tf.function``, and
in TF1-style graphs run by a ``tf.compat.v1.Session``.

Eagerly, a CPU tensor goes to the core as a numpy view of its buffer and the result comes back as a
tensor sharing the result's memory where TensorFlow allows it (see :mod:`.eager_arrays`); no
gradient is recorded unless a gradient tape or forward accumulator is active. In a graph every call
becomes one stateful ``tf.numpy_function`` node that submits its tensor(s) and waits (a grouped op
is one node that submits the whole group). Each node has a control dependency on the graph's
previous one, so that every rank starts them in the same order (a ``tf.function`` runs them all; in
a TF1 graph, fetching a node also runs the nodes built before it, except the broadcasts of
variables, which stay out of that chain: see ``broadcast_joins_chain``).

Names.  Ranks match collectives by name.  ``name=None`` means:
  * eagerly: the core's per-kind call counter (``allreduce.noname.N``): unnamed ops must be
    issued in the same order on every rank, as in Horovod;
  * in a graph: a name fixed when the op is created, ``<kind>.tf.<function>.<k>``, with ``k``
    counting the hvdlite ops of that graph in program order (ops on a process set other than
    the global one count separately and are named ``<kind>.tf.set<id>.<function>.<k>``, so
    that only members need to run them).  Identical programs trace identically on every rank,
    so the names agree; they are reused on every call of the function, which lets the core's
    response cache skip negotiation in steady state.
Gradient ops are named after their forward op (``<name>.grad``).  Gradients are Horovod's
(see each op); a graph's gradient always runs the collectives it was built with, on every rank.

Process sets.  Every op takes ``process_set`` (default :data:`global_process_set`, all ranks;
``None`` means the same).  Only members of a set may run ops on it; ``root_rank`` of a
broadcast is a global rank that must be a member; ``Average`` divides by the set's size.

Errors are Horovod's ``tf.errors`` classes (see :mod:`.errors`): eagerly a cross-rank mismatch
raises ``FailedPreconditionError`` (also a ``hvd.TensorMismatchError``); argument errors
(unknown process set, non-member rank, bad ``root_rank``, bad ``splits``, scalars where rows
are needed) raise ``InvalidArgumentError`` (also a ``ValueError``) when the op is created, also
while a graph is built.  Inside a graph TensorFlow reports a collective's failure by Python type
(a mismatch as ``InvalidArgumentError``), with hvdlite's message.

Where the code lives (this module keeps every public name, and is what the rest of the adapter
imports): :mod:`.graph` (graph nodes, their ordering chain, trace-time names),
:mod:`.tensor_bridge` (tensors to the core and back), :mod:`.eager_arrays` (eager tensors
to numpy and back without copies), :mod:`.membership` (process-set
members), :mod:`.autodiff` (custom gradients; the differentiable allreduce, allgather and
reducescatter), the public ops in :mod:`.collective_ops` (allreduce, allgather, reducescatter
and their grouped forms), :mod:`.broadcast_ops`, :mod:`.alltoall_ops`, :mod:`.control_ops`
(barrier, join) and :mod:`.topology_ops` (size_op, rank_op, ...); :func:`.errors.public_op` is
the decorator every public op wears.
"""
from hvdlite.common.core import global_process_set, ProcessSet, ReduceOp  # noqa: F401

from .alltoall_ops import alltoall  # noqa: F401
from .broadcast_ops import broadcast, broadcast_, broadcast_variables  # noqa: F401
from .collective_ops import (allgather, allreduce, grouped_allgather,  # noqa: F401
                             grouped_allreduce, grouped_reducescatter, reducescatter)
from .compression import Compression  # noqa: F401
from .control_ops import barrier, join  # noqa: F401
from .topology_ops import (cross_rank_op, cross_size_op, local_rank_op,  # noqa: F401
                           local_size_op, PROCESS_SET_ERROR_UNKNOWN_SET,
                           process_set_included_op, rank_op, size_op)
