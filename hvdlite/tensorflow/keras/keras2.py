"""Keras 2 (``tf-keras`` under ``TF_USE_LEGACY_KERAS=1``): which Keras an object belongs to, and
the ``DistributedOptimizer`` mixin for Keras 2 optimizers.

TensorFlow >= 2.16 ships Keras 3 as ``tf.keras``; Keras 2 code keeps running through the
``tf-keras`` package when ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` that package.  Keras 2's
optimizers (the current ``tf_keras.optimizers.*`` and the ``tf_keras.optimizers.legacy.*``
ones) have no ``apply`` step to hook as Keras 3's do; Horovod's Keras wrapper
(``horovod/_keras``) averages the gradients where they are computed instead:
``_compute_gradients`` (legacy optimizers; ``minimize`` and ``model.fit`` go through it),
``compute_gradients`` (current ones) and ``get_gradients`` (graph mode).  So does
:class:`Keras2DistributedOptimizer`; gradients handed to ``apply_gradients`` directly (a custom
loop) are averaged there.  ``backward_passes_per_step=N`` sums N passes' gradients in local
variables and reduces and applies on every N-th, as Horovod's LocalGradientAggregationHelper.
"""
from __future__ import annotations

import tensorflow as tf

from .optimizer_setup import DistributedSetup


def keras_of_tf():
    """The Keras package that ``tf.keras`` is (``tf_keras`` or ``keras``)."""
    import importlib
    module = tf.keras.callbacks.Callback.__module__.split(".")[0]
    return importlib.import_module(module)


def is_keras2_class(cls) -> bool:
    """Whether ``cls`` (an optimizer's or a model's class) is tf-keras's (Keras 2)."""
    return any(c.__module__.startswith("tf_keras") for c in cls.__mro__)


class Keras2DistributedOptimizer(DistributedSetup):
    """Mixin placed before a Keras 2 optimizer class in a generated subclass (see the module
    docstring); set up by ``hvdlite.tensorflow.keras.DistributedOptimizer``."""

    def _hvd_reduce(self, grads, variables):
        """The gradients to apply: reduced across ranks (or, with backward passes, the
        aggregated ones on every N-th pass and zeros in between, when nothing is applied)."""
        grads = list(grads)
        variables = list(variables)
        self._hvd_reduced = True
        if self._hvd_passes <= 1:
            return self._hvd_allreduce_grads(grads, variables, self._hvd_local)
        self._hvd_make_accumulators(variables)
        for acc, g in zip(self._hvd_aggregated, grads):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        count = self._hvd_counter.assign_add(1)
        passes = self._hvd_passes
        present = [i for i, g in enumerate(grads) if g is not None]

        def reduce():
            aggregated = [tf.convert_to_tensor(self._hvd_aggregated[i]) for i in present]
            if self._hvd_average_aggregated:
                aggregated = [a / tf.cast(passes, a.dtype) for a in aggregated]
            reduced = self._hvd_allreduce_grads(aggregated, [variables[i] for i in present],
                                                self._hvd_local)
            with tf.control_dependencies([tf.convert_to_tensor(r) for r in reduced]):
                for i in present:
                    self._hvd_aggregated[i].assign(tf.zeros_like(self._hvd_aggregated[i]))
                return [tf.identity(tf.convert_to_tensor(r)) for r in reduced]

        def skip():
            return [tf.zeros_like(self._hvd_aggregated[i]) for i in present]

        self._hvd_apply_now = tf.equal(tf.math.floormod(count, passes), 0)
        reduced = tf.cond(self._hvd_apply_now, reduce, skip)
        out = [None] * len(grads)
        for i, r in zip(present, reduced):
            out[i] = r
        return out

    def _hvd_make_accumulators(self, variables) -> None:
        if self._hvd_aggregated is not None:
            return
        with tf.init_scope():   # once, outside any tf.function being traced
            self._hvd_aggregated = [tf.Variable(tf.zeros_like(v), trainable=False,
                                         name="hvd_aggregated") for v in variables]
            self._hvd_counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="hvd_backward_passes")

    # --- the hooks --------------------------------------------------------------------------
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Legacy optimizers: the gradients of ``minimize`` (and ``model.fit``), reduced."""
        tape = tf.GradientTape() if tape is None else tape
        pairs = super()._compute_gradients(loss, var_list, grad_loss, tape=tape)
        grads, variables = zip(*pairs) if pairs else ((), ())
        return list(zip(self._hvd_reduce(grads, variables), variables))

    def compute_gradients(self, loss, var_list, tape=None):
        """Current Keras 2 optimizers: the gradients of ``minimize`` (and ``model.fit``),
        reduced."""
        pairs = super().compute_gradients(loss, var_list, tape=tape)
        grads, variables = zip(*pairs) if pairs else ((), ())
        return list(zip(self._hvd_reduce(grads, variables), variables))

    def get_gradients(self, loss, params):
        """Graph-mode Keras 2: the gradients, reduced."""
        return self._hvd_reduce(super().get_gradients(loss, params), params)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Apply (every N-th pass with backward passes); gradients that did not come from this
        optimizer's own computation (a custom loop's tape) are reduced here first."""
        pairs = list(grads_and_vars)
        if not getattr(self, "_hvd_reduced", False):
            grads, variables = zip(*pairs) if pairs else ((), ())
            pairs = list(zip(self._hvd_reduce(grads, variables), variables))
        self._hvd_reduced = False
        if self._hvd_passes <= 1:
            return super().apply_gradients(pairs, *args, **kwargs)
        pairs = [(g, v) for g, v in pairs if g is not None]
        variables = [v for _, v in pairs]
        if hasattr(self, "_create_all_weights"):   # slots first: not inside the cond below
            self._create_all_weights(variables)
        elif not getattr(self, "_built", False):
            with tf.init_scope():
                self.build(variables)
        mixin_super = super()

        def apply():
            mixin_super.apply_gradients(pairs, *args, **kwargs)
            return tf.constant(True)

        def skip():
            # Horovod counts the skipped passes as iterations too (LocalGradientAggregation-
            # Helper), so that schedules driven by ``iterations`` see every batch.
            with tf.control_dependencies([self.iterations.assign_add(1)]):
                return tf.constant(False)

        return tf.cond(self._hvd_apply_now, apply, skip)
