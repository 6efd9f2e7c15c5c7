"""Keras mixed precision (``LossScaleOptimizer``) around a hvdlite ``DistributedOptimizer``.

With the ``"mixed_float16"`` dtype policy, ``model.compile`` wraps the optimizer in a
``keras.optimizers.LossScaleOptimizer`` (users also wrap it by hand).  Before each update that
wrapper checks the gradients for inf/NaN and skips the inner optimizer when it finds any.  Keras
assumes the gradients are already all-reduced at that point (its ``tf.distribute`` path reduces
them earlier), but a hvdlite ``DistributedOptimizer`` reduces them *inside* the inner
optimizer.  So the check read each rank's own gradients: a rank whose gradients overflowed
skipped the update and its gradient allreduce while the others waited in it, and the ranks'
loss scales drifted apart.

:func:`install` makes the wrapper's check agree across ranks when its inner optimizer is a
hvdlite ``DistributedOptimizer``: every rank skips the update, and halves its loss scale,
when any rank's gradients overflowed.  That costs one one-element allreduce per step.  Every
other ``LossScaleOptimizer`` is left exactly as Keras made it.  (Wrapping the other way round,
``hvd.DistributedOptimizer(LossScaleOptimizer(opt))``, needs no agreement: the gradients are
averaged before the check, so an overflow on any rank reaches every rank.)
"""
from __future__ import annotations

import warnings

from keras.optimizers import LossScaleOptimizer

# (None if a Keras release renamed it: then install() warns and leaves Keras alone, and the
# mixed precision tests, which check installed(), fail in hvdlite's CI.)
_original_check_finite = getattr(LossScaleOptimizer, "check_finite", None)


def _check_finite_on_every_rank(self, grads):
    finite = _original_check_finite(self, grads)
    agree = getattr(self.inner_optimizer, "_hvd_all_finite", None)
    return finite if agree is None else agree(finite)


def install() -> None:
    """Make ``LossScaleOptimizer.check_finite`` agree across ranks for wrapped hvdlite
    optimizers (idempotent)."""
    if _original_check_finite is None:
        warnings.warn("hvdlite cannot hook this Keras version's LossScaleOptimizer (no "
                      "check_finite): with mixed_float16, wrap the other way round, "
                      "hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt)), "
                      "and pass that to model.compile; a LossScaleOptimizer around a hvdlite "
                      "DistributedOptimizer can leave ranks waiting for each other.")
        return
    LossScaleOptimizer.check_finite = _check_finite_on_every_rank


def installed() -> bool:
    return getattr(LossScaleOptimizer, "check_finite", None) is _check_finite_on_every_rank
