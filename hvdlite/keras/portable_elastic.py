"""Horovod's elastic API for Keras 3 on any backend (used under JAX and torch): ``KerasState``,
the callbacks that commit it and keep its epoch and batch, and ``run``.  See docs/elastic.md.

The state's logic is :mod:`.elastic_logic`'s (shared with TensorFlow's); ``sync`` broadcasts rank
0's variables through hvdlite's engine.
As under TensorFlow, Keras decides an epoch's number of steps when ``fit`` starts, so the
first epoch after a reset is not shortened by ``UpdateBatchStateCallback``.
"""
from __future__ import annotations

from typing import Callable

import keras

from hvdlite.common.core import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State

from .backends import adapter
from .collectives import broadcast_variables
from .elastic_logic import KerasVariablesState


def run(func: Callable) -> Callable:
    """Decorator running ``func(state, ...)`` elastically (Horovod's ``hvd.elastic.run``): on
    a failed collective or a host change the state is restored (or synced) and ``func`` runs
    again in the new world.  It is the backend adapter's ``run`` (``hvdlite.jax``'s knows a
    collective that failed inside the jitted step by JAX's runtime error)."""
    return adapter().elastic.run(func)


class KerasState(KerasVariablesState):
    """State of a Keras model and its optimizer (Horovod's ``hvd.elastic.KerasState``; see
    :class:`.elastic_logic.KerasVariablesState`): rank 0's variables reach the other ranks as
    host arrays through hvdlite's engine.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``); build it (one step, or
            ``optimizer.build(model.trainable_variables)``) before making the state.
        kwargs: more attributes kept as plain objects (epoch, batch, ...).
    """

    def broadcast_variables(self, variables: list, name: str) -> None:
        """Assign rank 0's values of ``variables`` on every rank."""
        broadcast_variables(variables, 0, name=name)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches, and at the end of every epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit   # the same count on every rank

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of the batch just finished (0 after an epoch)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs finished, counted across resets."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "State", "ObjectState", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
