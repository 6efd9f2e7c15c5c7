"""Horovod's Keras callbacks: broadcast initial state, average metrics, learning-rate warmup and
schedules."""
from __future__ import annotations

import numpy as np

from hvdlite.common import core

from ..gradient_tape import LocalVariables
from ..mpi_ops import broadcast_variables
from .keras2 import keras_of_tf

keras = keras_of_tf()   # tf.keras's Keras: Keras 3, or tf-keras's Keras 2 (TF_USE_LEGACY_KERAS=1)


def _optimizer_variables(optimizer):
    variables = getattr(optimizer, "variables", [])
    return list(variables() if callable(variables) else variables)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from ``root_rank``'s weights and optimizer state.

    Model weights are broadcast when training begins; optimizer variables (created by then in
    Keras 3) are broadcast too, and once more after the first batch, as Horovod does, to cover
    state created lazily by the first step.

    ``local_variables`` (or ``register_local_var(var)``): model-parallel variables whose values
    differ per rank; they are not broadcast, and neither are the optimizer slots (momentum, ...)
    that hvdlite's DistributedOptimizer created for them.
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local = LocalVariables(local_variables or ())

    def register_local_var(self, var) -> None:
        """Leave ``var`` out of the broadcast (it is local to each rank)."""
        self._local.add(var)

    def _broadcast(self):
        local = self._local
        variables = [v for v in self.model.variables if v not in local]
        opt = getattr(self.model, "optimizer", None)
        if opt is not None:
            owners = getattr(opt, "_hvd_slot_owners", {})
            variables += [v for v in _optimizer_variables(opt)
                          if not (id(v) in owners and owners[id(v)] in local)]
        broadcast_variables(variables, root_rank=self.root_rank)

    def on_train_begin(self, logs=None):
        if self.model.built:
            self._broadcast()

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self._broadcast()
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's metrics (``logs``) by their average over all ranks.

    Put it before callbacks that read the metrics (checkpointing, early stopping, ...); the
    History and progress-bar callbacks already come after it.
    """

    def __init__(self, device=""):
        super().__init__()

    def _average(self, logs, tag):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.isscalar(
            np.asarray(v).item()) and isinstance(np.asarray(v).item(), (int, float)))
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = core.allreduce(values, name=f"MetricAverageCallback.{tag}")
        for k, v in zip(keys, averaged.tolist()):
            logs[k] = v

    def on_epoch_end(self, epoch, logs=None):
        self._average(logs, "epoch")


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until
    ``end_epoch`` (exclusive).  ``multiplier`` is a number or a function of the (fractional,
    when ``staircase=False``) epoch.  With ``momentum_correction``, a momentum held in a variable
    is scaled by new_lr/old_lr for the batch where the rate changes (Keras 3's built-in
    optimizers keep momentum as a Python float, compiled into the step: left unchanged then).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        if not callable(multiplier):
            self.staircase = True
            self.multiplier = lambda epoch: multiplier
        else:
            self.multiplier = multiplier

    def _lr_variable(self):
        lr = self.model.optimizer.learning_rate
        if not hasattr(lr, "assign"):
            raise ValueError(f"{type(self).__name__} needs an optimizer whose learning_rate is "
                             f"a variable, not a LearningRateSchedule.")
        return lr

    def _autodetect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch):
        lr = self._lr_variable()
        old_lr = float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))
        new_lr = self.initial_lr * self.multiplier(epoch)
        lr.assign(new_lr)
        momentum = getattr(self.model.optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr:
            self.restore_momentum = float(momentum.numpy())
            momentum.assign(self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = float(self._lr_variable().numpy())
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch
                or (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(self._lr_variable().numpy())


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, per batch (Goyal et al., "Accurate, Large Minibatch SGD")."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Shift so the rate reaches round values at the end of each epoch, as Horovod does.
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / core.size() * (epoch * (core.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and core.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(self._lr_variable().numpy()):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint`` with ``save_best_only=True`` that writes on rank 0 only
    (Horovod's callback of the same name).

    The whole model is saved to ``filepath`` (``.keras`` or ``.h5``; pass it here or set
    ``callback.filepath`` before ``fit``) whenever ``monitor`` improves on rank 0.  Put
    :class:`MetricAverageCallback` before it so that the decision uses the average over ranks.
    """

    def __init__(self, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch",
                 filepath=None):
        super().__init__(filepath="unset.keras" if filepath is None else filepath,
                         monitor=monitor, verbose=verbose if core.rank() == 0 else 0,
                         save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        path = self.filepath
        if path is None or not str(path).endswith((".keras", ".h5")):
            raise ValueError(f"BestModelCheckpoint needs a filepath ending in .keras or .h5 "
                             f"(got {path!r}): pass filepath=... or set callback.filepath "
                             f"before model.fit.")
        super().on_train_begin(logs)

    def _save_model(self, epoch, batch, logs):
        if core.rank() == 0:   # other ranks hold the same weights; one writer
            super()._save_model(epoch, batch, logs)
