"""The public broadcast ops on TensorFlow tensors and variables: ``broadcast`` (differentiable,
with Horovod's gradient), ``broadcast_variables`` and the in-place ``broadcast_``.  In a TF1
graph the variables broadcasts stay out of the chain that orders the other ops (see
:func:`.graph.broadcast_joins_chain`)."""
from __future__ import annotations

import tensorflow as tf

from hvdlite.common import core
from hvdlite.common.core import BROADCAST, global_process_set, ProcessSet, ReduceOp

from .autodiff import differentiable_allreduce, with_custom_gradient
from .errors import public_op
from .graph import broadcast_joins_chain, op_name, sub_name
from .membership import members_of
from .tensor_bridge import collective_per_tensor


def _check_root(root_rank, members, what: str) -> int:
    try:
        root = int(root_rank)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: root_rank must be an int, got {root_rank!r}") from None
    if members is None:
        if not 0 <= root < core.size():
            raise ValueError(f"{what}: root_rank={root} is out of range for a job of "
                             f"{core.size()} ranks.")
    elif root not in members:
        raise ValueError(f"{what}: root_rank={root} is not a member of the process set "
                         f"(global ranks {members}); root_rank is a global rank.")
    return root


@public_op(kind=BROADCAST)
def broadcast(tensor, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet | None = global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank of ``process_set`` (``root_rank`` is a
    global rank, a member of the set).  Differentiable, as in Horovod: the root receives the
    average over the set of the upstream gradients, the other ranks that average times 0."""
    what = f"broadcast of {name or 'a tensor'}"
    members = members_of(process_set, what)
    root_rank = _check_root(root_rank, members, what)
    tensor = tf.convert_to_tensor(tensor)
    nm = op_name("broadcast", name, process_set)
    kwargs = {"root_rank": root_rank}

    def forward(xs):
        return collective_per_tensor(BROADCAST, xs, [nm], kwargs, process_set)

    def backward(xs, ys, dys):
        averaged = differentiable_allreduce(dys, sub_name(nm, "grad"), ReduceOp.Average, 1.0, 1.0,
                                            process_set, grouped=False)[0]
        # "* 0", not zeros: Horovod's numbers (a non-finite average stays NaN).
        return [averaged if core.rank() == root_rank else averaged * 0]

    return with_custom_gradient(forward, backward, [tensor])[0]


def _var_label(v, i: int) -> str:
    label = getattr(v, "path", None) or getattr(v, "name", None) or "var"
    return f"{i}.{label}"


def _broadcast_assign(variables: list, root_rank, base: str, process_set, what: str) -> list:
    """Broadcast every variable's value from ``root_rank`` (submitted together) and assign it;
    returns the assign ops (None where the variable type returns none)."""
    members = members_of(process_set, what)
    root_rank = _check_root(root_rank, members, what)
    names = [f"{base}.{_var_label(v, i)}" for i, v in enumerate(variables)]
    chained = tf.executing_eagerly() or broadcast_joins_chain(tf.compat.v1.get_default_graph())
    values = collective_per_tensor(BROADCAST, [_read(v) for v in variables], names,
                                   {"root_rank": root_rank}, process_set, chained)
    return [v.assign(x) for v, x in zip(variables, values)]


@public_op
def broadcast_variables(variables, root_rank: int,
                        process_set: ProcessSet | None = global_process_set,
                        inplace: bool = False):
    """Assign ``root_rank``'s value to every variable (tf.Variable or Keras variable) on every
    rank of ``process_set``.  All broadcasts are submitted together.  The variable list must be
    the same (same order, shapes, dtypes) on every rank.  Returns the group of assign ops in
    graph mode.  ``inplace`` is accepted for Horovod compatibility: hvdlite always assigns in
    place."""
    variables = list(variables)
    if not variables:
        return None
    base = op_name("broadcast_variables", None, process_set) or "broadcast_variables"
    assigns = _broadcast_assign(variables, root_rank, base, process_set, "broadcast_variables")
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


@public_op
def broadcast_(variables, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = global_process_set) -> list:
    """In-place broadcast (Horovod's ``hvd.broadcast_``): assign ``root_rank``'s value of every
    variable in ``variables`` (a list of tf.Variable or Keras variables, or one variable) to
    that variable on every rank of ``process_set``, and return the updated values as a list of
    tensors (in graph mode they read the variables after the assignments).  The ops are keyed
    by ``name`` combined with each variable's position and name, so the list must be the same
    (same order, shapes, dtypes) on every rank."""
    variables = list(variables) if isinstance(variables, (list, tuple)) else [variables]
    if not variables:
        return []
    base = op_name("broadcast_", name, process_set) or "broadcast_"
    assigns = _broadcast_assign(variables, root_rank, base, process_set, f"broadcast_ {base}")
    if tf.executing_eagerly():
        return [_read(v) for v in variables]
    with tf.control_dependencies([a for a in assigns if a is not None]):
        return [tf.identity(_read(v)) for v in variables]


def _read(v):
    value = getattr(v, "value", None)
    if value is not None and not callable(value):
        v = value   # Keras 3 variable -> its tf.Variable
    return tf.convert_to_tensor(v)
