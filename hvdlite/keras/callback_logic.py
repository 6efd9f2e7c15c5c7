"""What Horovod's Keras callbacks do, once for every Keras: metric averaging, learning-rate
schedules and warmup, best-model checkpoints on rank 0.

The classes here are mixins without a Keras base: each Keras gets its callbacks by putting one
before its own ``Callback`` (or ``ModelCheckpoint``): :mod:`.portable_callbacks` for Keras 3 on
JAX and torch, :mod:`hvdlite.tensorflow.keras.callbacks` for the Keras that ``tf.keras`` is
(Keras 3, or tf-keras's Keras 2).  Variables are read and assigned through
:func:`.backends.sync_model_state` first, which makes the JAX trainer's step state the
variables' (a no-op elsewhere).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from hvdlite.common import core

from .backends import sync_model_state


class MetricAverageLogic:
    """Replace each epoch's metrics (``logs``) by their average over all ranks.

    Put it before callbacks that read the metrics (checkpointing, early stopping, ...); the
    History and progress-bar callbacks already come after it.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.isscalar(
            np.asarray(v).item()) and isinstance(np.asarray(v).item(), (int, float)))
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = core.allreduce(values, name="MetricAverageCallback.epoch")
        for k, v in zip(keys, averaged.tolist()):
            logs[k] = v


class LearningRateScheduleLogic:
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until
    ``end_epoch`` (exclusive).  ``multiplier`` is a number or a function of the (fractional,
    when ``staircase=False``) epoch.  With ``momentum_correction``, a momentum held in a variable
    is scaled by new_lr/old_lr for the batch where the rate changes (Keras 3's built-in
    optimizers keep momentum as a Python float, compiled into the step: left unchanged then).
    """

    def __init__(self, initial_lr: float | None, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
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

    def _lr_variable(self) -> Any:
        lr = self.model.optimizer.learning_rate
        if not hasattr(lr, "assign"):
            raise ValueError(f"{type(self).__name__} needs an optimizer whose learning_rate is "
                             f"a variable, not a LearningRateSchedule.")
        return lr

    def _lr_value(self) -> float:
        sync_model_state(self.model)
        lr = self._lr_variable()
        return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch: float) -> None:
        old_lr = self._lr_value()
        new_lr = self.initial_lr * self.multiplier(epoch)
        self._lr_variable().assign(new_lr)
        momentum = getattr(self.model.optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr:
            self.restore_momentum = float(momentum.numpy())
            momentum.assign(self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            sync_model_state(self.model)
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = self._lr_value()
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if (self.current_epoch < self.start_epoch
                or (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = self._lr_value()


class LearningRateWarmupLogic(LearningRateScheduleLogic):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, per batch (Goyal et al., "Accurate, Large Minibatch SGD")."""

    def __init__(self, initial_lr: float | None, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # Shift so the rate reaches round values at the end of each epoch, as Horovod does.
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / core.size() * (epoch * (core.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and core.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self._lr_value():g}.")


class BestModelCheckpointLogic:
    """Keras's ``ModelCheckpoint`` with ``save_best_only=True`` that writes on rank 0 only
    (Horovod's callback of the same name).

    The whole model is saved to ``filepath`` (``.keras`` or ``.h5``; pass it here or set
    ``callback.filepath`` before ``fit``) whenever ``monitor`` improves on rank 0.  Put the
    MetricAverageCallback before it so that the decision uses the average over ranks.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        super().__init__(filepath="unset.keras" if filepath is None else filepath,
                         monitor=monitor, verbose=verbose if core.rank() == 0 else 0,
                         save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        path = self.filepath
        if path is None or not str(path).endswith((".keras", ".h5")):
            raise ValueError(f"BestModelCheckpoint needs a filepath ending in .keras or .h5 "
                             f"(got {path!r}): pass filepath=... or set callback.filepath "
                             f"before model.fit.")
        super().on_train_begin(logs)

    def _save_model(self, epoch, batch, logs):
        if core.rank() == 0:   # other ranks hold the same weights; one writer
            super()._save_model(epoch, batch, logs)
