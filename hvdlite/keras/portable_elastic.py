"""Horovod's elastic API for Keras 3 on any backend (used under JAX and torch): ``KerasState``,
the callbacks that commit it and keep its epoch and batch, and ``run``.  See docs/elastic.md.

Saved states are numpy copies of the model's and optimizer's variables (on JAX, synced from the
trainer's step state first); ``sync`` broadcasts rank 0's variables through hvdlite's engine.
As under TensorFlow, Keras decides an epoch's number of steps when ``fit`` starts, so the
first epoch after a reset is not shortened by ``UpdateBatchStateCallback``.
"""
from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np

from hvdlite.common.core import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState,
                                 State, broadcast_object, rank)

from .backends import adapter, sync_model_state
from .collectives import broadcast_variables


def run(func: Callable) -> Callable:
    """Decorator running ``func(state, ...)`` elastically (Horovod's ``hvd.elastic.run``): on
    a failed collective or a host change the state is restored (or synced) and ``func`` runs
    again in the new world.  It is the backend adapter's ``run`` (``hvdlite.jax``'s knows a
    collective that failed inside the jitted step by JAX's runtime error)."""
    return adapter().elastic.run(func)


def _values(variables: list) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


class KerasState(ObjectState):
    """State of a Keras model and its optimizer (Horovod's ``hvd.elastic.KerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``); build it (one step, or
            ``optimizer.build(model.trainable_variables)``) before making the state.
        kwargs: more attributes kept as plain objects (epoch, batch, ...).
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _optimizer_variables(self) -> list:
        return list(getattr(self.optimizer, "variables", []) or [])

    def _build_optimizer(self) -> None:
        if not getattr(self.optimizer, "built", True):
            self.optimizer.build(self.model.trainable_variables)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        sync_model_state(self.model)
        broadcast_variables(self.model.variables, 0, name="KerasState.model")
        if broadcast_object(bool(getattr(self.optimizer, "built", True)),
                            name="elastic.optimizer_built"):
            self._build_optimizer()
        broadcast_variables(self._optimizer_variables(), 0, name="KerasState.optimizer")
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        sync_model_state(self.model)
        self._saved_model_state = _values(self.model.variables)
        self._saved_optimizer_state = _values(self._optimizer_variables())

    def _load_model(self) -> None:
        sync_model_state(self.model)
        for var, value in zip(self.model.variables, self._saved_model_state):
            var.assign(value)
        if len(self._saved_optimizer_state) > len(self._optimizer_variables()):
            self._build_optimizer()   # a new process's optimizer is built at its first step
        variables = self._optimizer_variables()
        if len(variables) != len(self._saved_optimizer_state):
            raise ValueError(f"KerasState: the optimizer has {len(variables)} variables but "
                             f"{len(self._saved_optimizer_state)} were saved; run one step "
                             f"(or optimizer.build) before making the state, in every world.")
        for var, value in zip(variables, self._saved_optimizer_state):
            var.assign(value)

    def committed_state(self) -> Any:
        committed = super().committed_state()
        committed["model"] = list(self._saved_model_state)
        committed["optimizer"] = list(self._saved_optimizer_state)
        return committed

    def load_committed_state(self, committed: Any) -> None:
        self._saved_model_state = list(committed["model"])
        self._saved_optimizer_state = list(committed["optimizer"])
        self._load_model()
        super().load_committed_state(committed)


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
