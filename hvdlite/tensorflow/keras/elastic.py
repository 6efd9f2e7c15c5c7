"""Horovod's elastic API for Keras (``horovod/tensorflow/keras/elastic.py``): ``KerasState`` and
the callbacks that commit the state and keep its epoch and batch, plus ``run`` and the
TensorFlow states.  See :mod:`hvdlite.tensorflow.elastic` and docs/elastic.md.

Keras 3, and Keras 2 as tf-keras 2.21 ships it, decide the number of steps of an epoch when
``fit`` starts and ignore later changes to ``params['steps']``, so ``UpdateBatchStateCallback``
(which changes them, as Horovod's does) cannot shorten the first epoch after a reset; feed that
epoch only the batches it still needs (examples/keras_elastic_digits.py shows one way).
"""
from __future__ import annotations

from typing import Any

from ..elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,
                       TensorFlowKerasState, TensorFlowState, run)
from .keras2 import keras_of_tf

keras = keras_of_tf()   # tf.keras's Keras: Keras 3, or tf-keras's Keras 2 (TF_USE_LEGACY_KERAS=1)


class KerasState(TensorFlowKerasState):
    """State of a Keras model and its optimizer (Horovod's ``hvd.elastic.KerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        kwargs: more attributes kept as plain objects (epoch, batch, ...).
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches, and at the end of every epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None) -> None:
        self.batches_remaining = self.batches_per_commit   # the same count on every rank

    def on_batch_end(self, batch, logs=None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of the batch just finished (0 after an epoch), and
    ask Keras for an epoch shortened by ``state.batch`` after a reset (Horovod's behaviour;
    Keras 3 and tf-keras ignore the request, see the module docstring)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs finished, counted across resets (Keras
    counts from 0 in every ``fit``)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "State", "ObjectState", "TensorFlowKerasState",
           "TensorFlowState", "HorovodInternalError", "HostsUpdatedInterrupt"]
