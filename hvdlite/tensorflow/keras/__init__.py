"""Keras adapter with Horovod's API: ``import hvdlite.tensorflow.keras as hvd``.

It works with the Keras that ``tf.keras`` is: Keras 3, or Keras 2 from the ``tf-keras``
package when ``TF_USE_LEGACY_KERAS=1`` (:mod:`.keras2`; each optimizer gets the wrapper of the
Keras it belongs to).

A Horovod Keras script runs after changing ``import horovod.tensorflow.keras as hvd`` (or
``horovod.keras``) to this import::

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

On a machine with a GPU, Keras may XLA-compile the train step (``jit_compile="auto"``); hvdlite's
collectives are Python nodes that XLA cannot compile, so pass ``jit_compile=False`` to
``model.compile`` there (CPU-only machines never use XLA by default).
"""
from __future__ import annotations

import tensorflow as tf

from hvdlite.common.core import *  # noqa: F401,F403 - the shared API

from ..compression import Compression
from ..gradient_tape import (check_groups, check_process_set, local_layer_variables,
                             make_allreduce_grads_fn)
from ..mpi_ops import (allreduce as _tf_allreduce, allgather as _tf_allgather,
                       broadcast as _tf_broadcast, reducescatter as _tf_reducescatter,
                       broadcast_variables, barrier)
from . import callbacks
from . import elastic  # noqa: F401 - hvd.elastic.*: Horovod's elastic API
from . import keras2, loss_scale
from .keras2 import Keras2DistributedOptimizer
from .optimizer_setup import DistributedSetup

loss_scale.install()   # mixed precision: see hvdlite.tensorflow.keras.loss_scale


class _DistributedOptimizer(DistributedSetup):
    """Mixin placed before the user's optimizer class in a generated subclass: ``apply``
    (which ``apply_gradients`` and ``model.fit`` go through) averages the gradients first."""

    def _hvd_all_finite(self, finite):
        """True on every rank iff ``finite`` is True on every rank of the process set (a
        LossScaleOptimizer around this one asks; see :mod:`.loss_scale`)."""
        member, set_size = check_process_set(self._hvd_process_set)
        if not member or set_size == 1:
            return finite
        flags = _tf_allreduce(tf.cast(finite, tf.int32), op=Min, name=f"{self._hvd_name}.finite",
                              process_set=self._hvd_process_set)
        return tf.cast(flags, tf.bool)

    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        # Remember which model variable each slot (momentum, ...) belongs to, so that
        # BroadcastGlobalVariablesCallback can leave the slots of local variables alone.
        slot = super().add_variable_from_reference(reference_variable, *args, **kwargs)
        owners = self.__dict__.setdefault("_hvd_slot_owners", {})
        owners[id(slot)] = reference_variable
        return slot

    @tf.autograph.experimental.do_not_convert
    def build(self, variables):
        super().build(variables)
        if getattr(self, "_hvd_passes", 1) > 1 and self._hvd_aggregated is None:
            self._hvd_aggregated = [self.add_variable_from_reference(v, name="hvd_aggregated")
                                    for v in variables]
            self._hvd_counter = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                                  name="hvd_backward_passes")

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if self._hvd_passes <= 1:
            variables = (trainable_variables if trainable_variables is not None
                         else getattr(self, "_trainable_variables", None))
            return super().apply(self._hvd_allreduce_grads(grads, variables, self._hvd_local),
                                 trainable_variables)
        if trainable_variables is None:
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
            if not self.built:
                self.build(variables)
                self.built = True
        index = {id(v): i for i, v in enumerate(self._trainable_variables)}
        for g, v in zip(grads, variables):
            if g is not None:
                self._hvd_aggregated[index[id(v)]].assign_add(tf.convert_to_tensor(g))
        self._hvd_counter.assign_add(1)
        passes = self._hvd_passes
        mixin_super = super(_DistributedOptimizer, self)

        def update():
            aggregated = [tf.convert_to_tensor(self._hvd_aggregated[index[id(v)]])
                          for v in variables]
            if self._hvd_average_aggregated:
                aggregated = [a / tf.cast(passes, a.dtype) for a in aggregated]
            mixin_super.apply(self._hvd_allreduce_grads(aggregated, variables, self._hvd_local),
                              variables)
            for v in variables:
                acc = self._hvd_aggregated[index[id(v)]]
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        tf.cond(tf.equal(tf.math.floormod(tf.convert_to_tensor(self._hvd_counter), passes), 0),
                update, lambda: tf.constant(False))


def _distributed_class(base):
    # Same name and module as the wrapped class: a saved model records the plain optimizer and
    # loads without hvdlite (as with Horovod).  Keras 2 (tf-keras) optimizers get their own
    # mixin: they have no ``apply`` step (see keras2).
    mixin = Keras2DistributedOptimizer if keras2.is_keras2_class(base) else _DistributedOptimizer
    return type(base.__name__, (mixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__})


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Return a copy of the Keras optimizer ``optimizer`` (built from its config, as Horovod
    does) whose gradients are averaged across ranks before being applied.

    ``backward_passes_per_step=N`` accumulates gradients locally for N calls of
    ``apply``/``apply_gradients`` and allreduces + applies on every N-th (summed, or averaged
    over the N passes with ``average_aggregated_gradients=True``).  ``compression``,
    ``sparse_as_dense``, ``op`` and ``gradient_predivide_factor`` are as in
    :func:`hvdlite.tensorflow.DistributedGradientTape` (``Compression.powersgd(...)``: PowerSGD,
    its state kept by this optimizer; see docs/compression.md).  ``num_groups``/``groups`` are
    accepted for compatibility (all gradients already travel as one fused group).  ``process_set``:
    gradients are averaged over its ranks only; ranks outside it apply their local gradients
    (as in Horovod).  ``opt.register_local_var(var)`` keeps ``var``'s gradient local (model
    parallelism; see :func:`PartialDistributedOptimizer`); ``scale_local_gradients`` (default
    True) divides such gradients by the process set's size, as Horovod does.
    """
    check_process_set(process_set)
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    if isinstance(optimizer, DistributedSetup):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    check_groups(num_groups, groups)
    base = optimizer.__class__
    cls = _distributed_class(base)
    try:
        new = cls.from_config(optimizer.get_config())
    except Exception:  # noqa: BLE001 - custom optimizers without a usable config
        new = optimizer
        new.__class__ = cls
    group = f"DistributedOptimizer.{name or f'Distributed{base.__name__}'}"
    new._hvd_setup(group, make_allreduce_grads_fn(group, compression, sparse_as_dense, op,
                                                  gradient_predivide_factor, process_set,
                                                  scale_local_gradients),
                   backward_passes_per_step, average_aggregated_gradients, process_set)
    return new


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A :func:`DistributedOptimizer` that applies the gradients of ``local_layers`` (a Keras
    layer or a collection of them: model-parallel parts whose weights differ per rank) without
    reducing them, as Horovod's API of the same name.  Those gradients are divided by the
    process set's size when ``scale_local_gradients`` is True (the default).  Every rank must
    have the same number of non-local variables.  Pair it with
    ``BroadcastGlobalVariablesCallback(0, local_variables=...)`` so that the start-up broadcast
    leaves the local weights alone too."""
    local_vars = local_layer_variables(local_layers)
    opt = DistributedOptimizer(optimizer, name=name, device_dense=device_dense,
                               device_sparse=device_sparse, compression=compression,
                               sparse_as_dense=sparse_as_dense,
                               gradient_predivide_factor=gradient_predivide_factor, op=op,
                               backward_passes_per_step=backward_passes_per_step,
                               average_aggregated_gradients=average_aggregated_gradients,
                               groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    for v in local_vars:
        opt.register_local_var(v)
    return opt


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """Allreduce a tensor-like value (Horovod Keras: returns a numpy array)."""
    return _tf_allreduce(tf.convert_to_tensor(value), average=average, name=name, op=op,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         compression=compression).numpy()


def allgather(value, name=None):
    """Allgather a tensor-like value (returns a numpy array)."""
    return _tf_allgather(tf.convert_to_tensor(value), name=name).numpy()


def broadcast(value, root_rank, name=None):
    """Broadcast a tensor-like value from ``root_rank`` (returns a numpy array)."""
    return _tf_broadcast(tf.convert_to_tensor(value), root_rank, name=name).numpy()


def reducescatter(value, name=None, op=Average):
    """Reducescatter a tensor-like value (Average by default; returns a numpy array with this
    rank's rows, see :func:`hvdlite.tensorflow.reducescatter`)."""
    return _tf_reducescatter(tf.convert_to_tensor(value), name=name, op=op).numpy()


def broadcast_global_variables(root_rank):
    """Broadcast every global variable from ``root_rank`` and run the broadcast in the Keras
    session (Horovod's ``horovod/_keras``): a graph-mode (TF1) API, for Keras 2 code built in a
    graph.  Eagerly it raises RuntimeError, as Horovod's does; use
    ``hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)`` or
    ``hvd.broadcast_variables(model.variables, root_rank)`` there."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; "
                           "use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                           "hvd.broadcast_variables(model.variables, root_rank) instead.")
    backend = tf.compat.v1.keras.backend
    if not hasattr(backend, "get_session"):
        raise RuntimeError("hvd.broadcast_global_variables() runs the broadcast in Keras 2's "
                           "session, which Keras 3 has not: use "
                           "hvd.broadcast_variables(model.variables, root_rank) instead.")
    op = broadcast_variables(tf.compat.v1.global_variables(), root_rank)
    return backend.get_session().run(op)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
    """Load a saved Keras model whose optimizer (and its state) is turned into a
    :func:`DistributedOptimizer` in place (with the Keras that ``tf.keras`` is: tf-keras's
    Keras 2 under ``TF_USE_LEGACY_KERAS=1``)."""
    keras = keras2.keras_of_tf()
    objects = dict(custom_objects or {})
    for opt_cls in custom_optimizers or []:
        objects[opt_cls.__name__] = opt_cls
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not isinstance(opt, DistributedSetup):
        base = opt.__class__
        opt.__class__ = _distributed_class(base)
        group = f"DistributedOptimizer.Distributed{base.__name__}"
        opt._hvd_setup(group, make_allreduce_grads_fn(group, compression), 1, False)
    return model
