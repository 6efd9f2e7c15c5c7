"""Horovod's Keras callbacks: broadcast initial state, average metrics, learning-rate warmup and
schedules.  All but the broadcast are :mod:`hvdlite.keras.callback_logic`'s, on ``tf.keras``'s
Keras."""
from __future__ import annotations

from hvdlite.keras.callback_logic import (BestModelCheckpointLogic, LearningRateScheduleLogic,
                                          LearningRateWarmupLogic, MetricAverageLogic)
from hvdlite.keras.elastic_logic import optimizer_variables

from ..gradient_tape import LocalVariables
from ..mpi_ops import broadcast_variables
from .keras2 import keras_of_tf

keras = keras_of_tf()   # tf.keras's Keras: Keras 3, or tf-keras's Keras 2 (TF_USE_LEGACY_KERAS=1)


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
            variables += [v for v in optimizer_variables(opt)
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


class MetricAverageCallback(MetricAverageLogic, keras.callbacks.Callback):
    """Replace each epoch's metrics (``logs``) by their average over all ranks (see
    :class:`hvdlite.keras.callback_logic.MetricAverageLogic`)."""


class LearningRateScheduleCallback(LearningRateScheduleLogic, keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and
    ``end_epoch`` (see :class:`hvdlite.keras.callback_logic.LearningRateScheduleLogic`)."""


class LearningRateWarmupCallback(LearningRateWarmupLogic, LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs (see :class:`hvdlite.keras.callback_logic.LearningRateWarmupLogic`)."""


class BestModelCheckpoint(BestModelCheckpointLogic, keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint`` with ``save_best_only=True`` that writes on rank 0 only (see
    :class:`hvdlite.keras.callback_logic.BestModelCheckpointLogic`)."""
