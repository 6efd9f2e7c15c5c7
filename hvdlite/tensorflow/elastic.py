"""Horovod's elastic API for TensorFlow: ``hvd.elastic.run``, ``TensorFlowKerasState``,
``TensorFlowState`` (``horovod/tensorflow/elastic.py``).

Run the script with ``hvdlite run --min-np N --max-np M (-H ... | --host-discovery-script S)``;
see docs/elastic.md.  Saved states are numpy copies of the variables; the last commit outlives
the processes through the elastic driver (:mod:`hvdlite.common.api.elastic`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from hvdlite.common.core import (HorovodInternalError, HostsUpdatedInterrupt, HvdliteError,
                                 ObjectState, State, broadcast_object, departed_ranks,
                                 elastic_run_fn, rank)

from hvdlite.keras.elastic_logic import KerasVariablesState

from .mpi_ops import broadcast_variables

# What a failed hvdlite collective says inside a graph, where TensorFlow reports a Python
# node's exception by its type only (see hvdlite.tensorflow.errors).
_FAILURE_WORDS = ("HorovodInternalError", "HvdliteError", "RankExitedError", "ShutdownError",
                  "StallError", "exited without shutting down")


def _translate(exc: BaseException) -> BaseException | None:
    """A TensorFlow error that stands for a failed collective, as ``HorovodInternalError``
    (Horovod's ``run`` does the same with its ops' ``UnknownError``)."""
    if isinstance(exc, HvdliteError):
        return exc
    if isinstance(exc, tf.errors.OpError) and (
            departed_ranks() or any(word in str(exc) for word in _FAILURE_WORDS)):
        return HorovodInternalError(str(exc))
    return None


def run(func):
    """Decorator running ``func(state, ...)`` elastically (Horovod's ``hvd.elastic.run``; see
    :func:`hvdlite.torch.elastic.run`).  TensorFlow errors raised by a failed collective inside
    a graph count as ``HorovodInternalError``."""
    return elastic_run_fn(func, translate=_translate)


def _values(variables) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


class _VariablesState(ObjectState):
    """An ObjectState that also keeps variables' values: ``save``/``restore`` copy them
    (``_save_model``/``_load_model``, which each state defines) beside the plain attributes."""

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()


class TensorFlowKerasState(KerasVariablesState):
    """State of a Keras model and its optimizer (Horovod's ``TensorFlowKerasState``; see
    :class:`hvdlite.keras.elastic_logic.KerasVariablesState`): rank 0's variables reach the
    other ranks by TensorFlow broadcasts.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        backend: accepted for Horovod's TF1 Keras; TensorFlow 2 runs eagerly without it.
        kwargs: more attributes kept as plain objects (epoch, batch, ...).
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        self.backend = backend
        super().__init__(model, optimizer=optimizer, **kwargs)

    def broadcast_variables(self, variables: list, name: str) -> None:
        """Assign rank 0's values of ``variables`` on every rank."""
        broadcast_variables(variables, root_rank=0)


class TensorFlowState(_VariablesState):
    """State of a list of TensorFlow variables (Horovod's ``TensorFlowState``).

    Args:
        variables: the ``tf.Variable`` objects to track (default: the TF1 graph's global
            variables).
        session: for TF1 graphs, the session that runs them (default: the default session).
        kwargs: more attributes kept as plain objects.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = list(variables or tf.compat.v1.global_variables())
        eager = tf.executing_eagerly()
        self.session = None if eager else (session or tf.compat.v1.get_default_session())
        self._bcast_op = None if eager else broadcast_variables(self.variables, root_rank=0)
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def sync(self) -> None:
        if self.session is not None:
            self.session.run(self._bcast_op)
        else:
            broadcast_variables(self.variables, root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        if self.session is not None:
            self._values = [np.array(v, copy=True) for v in self.session.run(self.variables)]
        else:
            self._values = _values(self.variables)

    def _load_model(self) -> None:
        for var, value in zip(self.variables, self._values):
            if self.session is not None:
                var.load(value, self.session)
            else:
                var.assign(value)

    def committed_state(self) -> Any:
        committed = super().committed_state()
        committed["variables"] = list(self._values)
        return committed

    def load_committed_state(self, committed: Any) -> None:
        self._values = list(committed["variables"])
        self._load_model()
        super().load_committed_state(committed)


__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
