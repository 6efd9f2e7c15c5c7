"""Horovod's ``DistributedOptimizer`` for TF1-style optimizers (``tf.compat.v1.train.Optimizer``),
in TF1 graphs run by a session and eagerly.

``compute_gradients`` (which ``minimize`` calls) returns the gradients averaged across the
ranks of the process set, all of them in one group (one graph node); ``apply_gradients`` and the
slot accessors are the wrapped optimizer's.  Gradients of variables registered with
``register_local_var`` are not reduced (divided by the set's size when
``scale_local_gradients``), and ranks outside the process set get their local gradients, as in
Horovod.
"""
from __future__ import annotations

import tensorflow as tf

from .gradient_tape import LocalVariables


class DistributedLegacyOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``; build it with
    :func:`hvdlite.tensorflow.DistributedOptimizer`."""

    def __init__(self, optimizer, name: str | None, use_locking: bool, allreduce_grads) -> None:
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._allreduce_grads = allreduce_grads
        self._local_vars = LocalVariables()

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient local to this rank (model parallelism), as in Horovod."""
        self._local_vars.add(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients averaged across
        ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        reduced = self._allreduce_grads(list(grads), list(variables), self._local_vars)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's ``apply_gradients``."""
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                               name=name)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
