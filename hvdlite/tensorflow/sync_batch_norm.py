"""Horovod-compatible synchronous batch normalisation for Keras 3 (TensorFlow backend):
``hvd.SyncBatchNormalization``.

Batch statistics are computed over the batch of *every* rank together, as if one
``keras.layers.BatchNormalization`` saw the concatenation of all ranks' inputs.  The statistics
travel in one small differentiable allreduce, so TensorFlow derives the backward pass (itself one
allreduce, the registered gradient of :func:`hvdlite.tensorflow.allreduce`).
"""
from __future__ import annotations

import itertools

import keras
import tensorflow as tf

from hvdlite.common import core
from hvdlite.common.core import ReduceOp

from .mpi_ops import allreduce

# How many SyncBatchNormalization layers have run a synchronised training-mode call so far.
_first_use_counter = itertools.count()


@keras.saving.register_keras_serializable(package="hvdlite")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalisation whose training-mode statistics span all ranks
    (``horovod.tensorflow.SyncBatchNormalization``).

    A drop-in replacement for ``keras.layers.BatchNormalization``: same arguments, weights
    (``gamma``, ``beta``, ``moving_mean``, ``moving_variance``), config and outputs; it is an
    instance of ``keras.layers.BatchNormalization``.  It needs the TensorFlow backend of Keras 3
    and ``hvd.init()`` before its first training-mode call.  Semantics:

    * Training mode (``training=True``, e.g. under ``model.fit``, and the layer trainable): every
      channel (``axis``) is normalised with the mean and the biased variance over the reduction
      axes of the union of all ranks' batches, exactly as a single ``BatchNormalization`` on the
      concatenated global batch (up to rounding), and ``moving_mean``/``moving_variance`` are
      updated with these global statistics using ``momentum`` (Keras' rule, biased variance), so
      they stay identical on every rank.  Ranks may hold different batch sizes: each rank
      contributes its element count, sum and sum of squares, so every element weighs the same
      (Horovod averages the per-rank means, which is only right for equal batches).  A rank may
      hold an empty batch (its output is empty); if every rank's batch is empty the moving
      statistics are left unchanged.  ``mask`` works as in Keras (masked-out elements are left
      out of the statistics, over all ranks).  ``renorm=True`` works too (on the global
      statistics).
    * Gradients flow through the synchronised statistics: they are those of one
      ``BatchNormalization`` over the concatenated batch with loss = sum of the ranks' losses;
      the ``gamma``/``beta`` gradients are each rank's share, which ``DistributedOptimizer``
      combines.
    * Inference mode (``training`` false, ``predict``/``evaluate``, or the layer frozen with
      ``trainable=False``) uses the moving statistics and does no communication.  With a single
      rank the layer is exactly ``keras.layers.BatchNormalization``.
    * A training-mode call is a collective: every rank must make it the same number of times
      and in the same order relative to other collectives, and a backward pass through it (also
      one collective) must run on every rank or on none.  A rank with no data must still call
      the layer, with an empty batch.  Each call sends ONE allreduce of ``3 * channels`` float64
      values (count, sum, sum of squares per channel); its name,
      ``sync_batch_normalization.tf.<k>``, numbers layers in the order of their first
      synchronised call, which agrees on every rank because the collective order must, and
      stays fixed afterwards (eagerly and inside any ``tf.function``).
    * ``synchronized``: Keras' own argument synchronises over ``tf.distribute`` replicas.  Here
      the statistics are always synchronised over the hvdlite ranks, so the argument is
      accepted (``True`` or ``False``, for code written for Keras' layer) and has no further
      effect; the layer records ``synchronized=False`` in its config, as Keras' replica
      all-reduce is never used (one hvdlite rank is one replica).
    * ``fused``: Horovod's argument; only ``fused=False`` (its default) is accepted, as in
      Horovod.  Unlike Horovod, a layer without ``name`` gets Keras' unique default name
      (``sync_batch_normalization``, ``sync_batch_normalization_1``, ...), so several of them can
      live in one functional model.
    """

    def __init__(self, *args, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if keras.backend.backend() != "tensorflow":
            raise ValueError(f"hvdlite.tensorflow.SyncBatchNormalization needs Keras' TensorFlow "
                             f"backend, not {keras.backend.backend()!r} (set "
                             f"KERAS_BACKEND=tensorflow).")
        kwargs.pop("synchronized", None)   # always synchronised over the ranks (see docstring)
        super().__init__(*args, **kwargs)
        self.synchronized = False   # (also if it came positionally): no tf.distribute all-reduce
        self._hvd_allreduce_name = None

    def _moments(self, inputs, mask):
        """Mean and biased variance per channel over the reduction axes, over all ranks (Keras'
        hook for the training-mode statistics; ``inputs`` is already in the compute dtype)."""
        if core.size() == 1:
            return super()._moments(inputs, mask)
        return self._global_moments(inputs, mask)

    def _global_moments(self, x, mask):
        """One pass: each rank reduces its own batch to centred moments (accurate in float32),
        turns them into float64 count, sum and sum of squares per channel, and ONE allreduce
        (Sum) of the ``3C`` values yields the global moments; ``var = sumsq/n - mean**2`` loses
        about ``1e-16 * (mean/std)**2`` relative accuracy, far below float32's resolution
        unless ``|mean| > 2e4 * std`` (see hvdlite.torch's SyncBatchNorm for the trade-off)."""
        axes = self._reduction_axes
        channels = int(self.moving_mean.shape[0])
        if mask is None:
            keep = None
            local = tf.reduce_prod(tf.gather(tf.shape(x), axes))
            count = tf.fill([channels], tf.cast(local, x.dtype))
        else:   # as Keras: the mask lacks the last dimension of the input
            keep = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), tf.bool)
            count = tf.reduce_sum(tf.cast(keep, x.dtype), axes)
        denom = tf.maximum(count, tf.ones_like(count))   # an empty batch gives zero sums
        kept = x if keep is None else tf.where(keep, x, tf.zeros_like(x))
        mean = tf.reduce_sum(kept, axes) / denom
        centred = tf.square(x - self._per_channel(mean, x))
        if keep is not None:
            centred = tf.where(keep, centred, tf.zeros_like(centred))
        var = tf.reduce_sum(centred, axes) / denom

        count64 = tf.cast(count, tf.float64)
        sums, sumsq = core.moment_sums(count64, tf.cast(mean, tf.float64), tf.cast(var, tf.float64))
        total = allreduce(tf.concat([count64, sums, sumsq], 0), op=ReduceOp.Sum,
                          name=self._collective_name())
        n, s, ss = total[:channels], total[channels:2 * channels], total[2 * channels:]

        if mask is None:
            g_mean, g_var = core.global_moments(tf.maximum(n, tf.ones_like(n)), s, ss)
            g_var = tf.maximum(g_var, tf.zeros_like(ss))
            # every rank empty: the moving statistics stay as they are (Keras would get NaN)
            seen = n > 0
            g_mean = tf.where(seen, g_mean, tf.cast(self.moving_mean, tf.float64))
            g_var = tf.where(seen, g_var, tf.cast(self.moving_variance, tf.float64))
        else:
            # Keras' masked moments: sums over the kept elements divided by (count + epsilon)
            d = n + keras.backend.epsilon()
            g_mean = s / d
            g_var = tf.maximum((ss - 2.0 * g_mean * s + n * tf.square(g_mean)) / d,
                               tf.zeros_like(ss))
        return tf.cast(g_mean, x.dtype), tf.cast(g_var, x.dtype)

    def _per_channel(self, stat, x):
        """``stat`` (one value per channel) shaped to broadcast against ``x``."""
        shape = [1] * len(x.shape)
        shape[self.axis] = -1
        return tf.reshape(stat, shape)

    def _collective_name(self) -> str:
        """This layer's allreduce name, fixed at its first synchronised call.

        Numbering layers in order of first use gives every rank the same name for the same
        layer, because that order is part of the collective call order that must already agree
        (Keras' auto-generated layer names would not do: they count every layer a process has
        created, e.g. also a model built on rank 0 only).  A fixed name per layer lets the
        engine's response cache serve it in steady state.
        """
        if self._hvd_allreduce_name is None:
            self._hvd_allreduce_name = f"sync_batch_normalization.tf.{next(_first_use_counter)}"
        return self._hvd_allreduce_name
