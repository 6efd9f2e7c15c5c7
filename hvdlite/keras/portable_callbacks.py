"""Horovod's Keras callbacks on any Keras 3 backend (used under JAX and torch): broadcast the
initial state, average the epoch metrics, warm up and schedule the learning rate.

Their logic is :mod:`.callback_logic`'s, which :mod:`hvdlite.tensorflow.keras.callbacks` shares;
only the broadcast is this module's own: host arrays through hvdlite's engine, after the JAX
trainer's step state is synced into the variables (:func:`.backends.sync_model_state`).
"""
from __future__ import annotations

from typing import Any

import keras

from .backends import sync_model_state
from .callback_logic import (BestModelCheckpointLogic, LearningRateScheduleLogic,
                             LearningRateWarmupLogic, MetricAverageLogic)
from .collectives import broadcast_variables
from .optimizer import IdentitySet


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from ``root_rank``'s weights and optimizer state: broadcast when
    training begins (when the model is built) and again after the first batch, as Horovod does,
    to cover state that the first step creates.  ``local_variables`` (or
    ``register_local_var(var)``): model-parallel variables left out, with the optimizer slots
    made for them."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local = IdentitySet(local_variables or ())

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast (it is local to each rank)."""
        self._local.add(var)

    def _broadcast(self) -> None:
        sync_model_state(self.model)
        variables = [v for v in self.model.variables if v not in self._local]
        opt = getattr(self.model, "optimizer", None)
        if opt is not None:
            owner = getattr(opt, "slot_owner", lambda slot: None)
            variables += [v for v in opt.variables if owner(v) not in self._local]
        broadcast_variables(variables, root_rank=self.root_rank,
                            name="BroadcastGlobalVariablesCallback")

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.model.built:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.broadcast_done:
            return
        self._broadcast()
        self.broadcast_done = True


class MetricAverageCallback(MetricAverageLogic, keras.callbacks.Callback):
    """Average each epoch's metrics over the ranks (see
    :class:`.callback_logic.MetricAverageLogic`)."""


class LearningRateScheduleCallback(LearningRateScheduleLogic, keras.callbacks.Callback):
    """Schedule the learning rate by epoch (see
    :class:`.callback_logic.LearningRateScheduleLogic`)."""


class LearningRateWarmupCallback(LearningRateWarmupLogic, LearningRateScheduleCallback):
    """Warm the learning rate up from ``initial_lr / size()`` (see
    :class:`.callback_logic.LearningRateWarmupLogic`)."""


class BestModelCheckpoint(BestModelCheckpointLogic, keras.callbacks.ModelCheckpoint):
    """Save the best model on rank 0 only (see
    :class:`.callback_logic.BestModelCheckpointLogic`)."""
