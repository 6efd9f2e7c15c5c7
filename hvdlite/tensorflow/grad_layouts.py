"""Gradients that some ranks have and others lack (``None``), or hold in another layout
(``tf.IndexedSlices`` on one rank, a dense tensor on another).

Every rank must submit the same collectives for a list of gradients, but ``tape.gradient``
returns ``None`` for a variable the loss did not reach on that rank (rank-dependent control
flow, a branch that this rank's data skipped) and ``tf.IndexedSlices`` for an embedding that
only a gather reached.  A rank that left such a gradient out while the others sent theirs made
every rank wait for ever.

Eagerly, the ranks first agree with one small allreduce on what each position holds
somewhere (dense, sparse with int32 or int64 indices, or nothing: the vote of
:mod:`hvdlite.common.api.grad_layouts`, which the PyTorch adapter shares), and each rank brings its
gradient to that layout: zeros where it has none, an empty ``IndexedSlices`` where the others'
are sparse, a dense tensor where any rank's is dense.  A gradient that no rank has stays
``None``.  Inside ``tf.function`` the layout of each gradient is fixed when the function is
traced, so it cannot follow the other ranks; there every position still takes part in the
gradient group, a missing or sparse one as an empty placeholder, so that ranks that traced
different layouts get a TensorMismatchError (with a hint naming the variables) instead of a
hang.
"""
from __future__ import annotations

import tensorflow as tf

from hvdlite.common import core

# Numbered for the vote: the highest that any rank holds wins (a joined rank votes NONE).
NONE, SPARSE32, SPARSE64, DENSE = range(4)
_LABELS = {NONE: "None", DENSE: "dense", SPARSE32: "tf.IndexedSlices", SPARSE64: "tf.IndexedSlices"}


def kind_of(grad, sparse_as_dense: bool) -> int:
    if grad is None:
        return NONE
    if isinstance(grad, tf.IndexedSlices) and not sparse_as_dense:
        return SPARSE64 if grad.indices.dtype == tf.int64 else SPARSE32
    return DENSE


def agree(kinds: list[int], name: str, process_set) -> list[int]:
    """The layout of each position across the ranks (eager only): dense if any rank's is
    dense, else sparse if any rank's is (int64 indices if any rank's are), else NONE."""
    return core.vote_layouts(kinds, f"{name}.layouts", process_set)


def conform(grad, kind: int, variable, what: str):
    """``grad`` (possibly None) in the agreed layout ``kind``."""
    if kind == NONE:
        return None
    if grad is None and variable is None:
        raise ValueError(f"{what}: this rank has no gradient but other ranks have one, and "
                         f"without the variables there is no shape to send zeros of; pass "
                         f"the variables along with the gradients.")
    if kind == DENSE:
        if grad is None:
            return tf.zeros_like(variable)
        return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad
    index_dtype = tf.int64 if kind == SPARSE64 else tf.int32
    if grad is None:
        shape = tf.TensorShape(variable.shape)
        return tf.IndexedSlices(tf.zeros([0] + shape.as_list()[1:], variable.dtype),
                                tf.zeros([0], index_dtype), dense_shape=tf.shape(variable))
    if grad.indices.dtype != index_dtype:
        return tf.IndexedSlices(grad.values, tf.cast(grad.indices, index_dtype),
                                grad.dense_shape)
    return grad


def placeholder(kind: int) -> tf.Tensor:
    """What a traced gradient group carries at a position without a dense gradient: empty, and
    shaped differently for a missing and a sparse one, so that any disagreement between the
    ranks is a shape mismatch."""
    return tf.zeros([0] if kind == NONE else [0, 0], tf.float32)


def mismatch_hint(kinds: list[int], variables, name: str) -> str:
    """Added to a traced gradient group's TensorMismatchError: how placeholders show in it,
    and this rank's gradients that are not dense."""
    odd = [i for i, k in enumerate(kinds) if k != DENSE]

    def label(i):
        var = getattr(variables[i], "name", None) if variables is not None else None
        return f"{name}.{i}" + (f" ({var})" if var else "")

    mine = "none"
    if odd:
        mine = ", ".join(f"{label(i)}: {_LABELS[kinds[i]]}" for i in odd[:5])
        mine += f" and {len(odd) - 5} more" if len(odd) > 5 else ""
    return (f"Inside tf.function, a gradient that is None on a rank (the loss does not reach "
            f"its variable there) takes part as an empty placeholder of shape (0,), a "
            f"tf.IndexedSlices one as (0, 0): each rank's traced function fixes which "
            f"gradients are None or sparse, and these ranks traced different ones. This "
            f"rank's gradients that are not dense tensors: {mine}. Make every rank compute "
            f"the same gradients, or pass unconnected_gradients=tf.UnconnectedGradients.ZERO "
            f"to tape.gradient (and sparse_as_dense=True); run eagerly, hvdlite reconciles "
            f"them by itself.")
