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


def _optimizer_variables(optimizer) -> list:
    if optimizer is None:
        return []
    variables = getattr(optimizer, "variables", [])
    return list(variables() if callable(variables) else variables)


def _optimizer_built(optimizer) -> bool:
    """Whether a Keras optimizer has made its per-variable state (Keras does at the first
    step; an optimizer without the notion counts as built)."""
    return bool(getattr(optimizer, "built", True))


def _build_optimizer(optimizer, model) -> None:
    if not _optimizer_built(optimizer) and hasattr(optimizer, "build"):
        optimizer.build(model.trainable_variables)


def _model_built(model) -> bool:
    return model.built if hasattr(model, "build") else True


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


class TensorFlowKerasState(_VariablesState):
    """State of a Keras model and its optimizer (Horovod's ``TensorFlowKerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        backend: accepted for Horovod's TF1 Keras; TensorFlow 2 runs eagerly without it.
        kwargs: more attributes kept as plain objects (epoch, batch, ...).
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        self.model = model
        if not _model_built(model):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.optimizer = optimizer or model.optimizer
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def sync(self) -> None:
        broadcast_variables(self.model.variables, root_rank=0)
        # Keras makes an optimizer's variables at its first step: a new worker's has none yet
        # while rank 0's (restored) has them.  Every rank makes them where rank 0 has them.
        if broadcast_object(_optimizer_built(self.optimizer), name="elastic.optimizer_built"):
            _build_optimizer(self.optimizer, self.model)
        optimizer_variables = _optimizer_variables(self.optimizer)
        if optimizer_variables:
            broadcast_variables(optimizer_variables, root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        self._saved_model_state = _values(self.model.variables)
        self._saved_optimizer_state = _values(_optimizer_variables(self.optimizer))

    def _load_model(self) -> None:
        for var, value in zip(self.model.variables, self._saved_model_state):
            var.assign(value)
        if len(self._saved_optimizer_state) > len(_optimizer_variables(self.optimizer)):
            # A new process's optimizer makes its variables at its first step: make them now.
            _build_optimizer(self.optimizer, self.model)
        optimizer_variables = _optimizer_variables(self.optimizer)
        if len(optimizer_variables) != len(self._saved_optimizer_state):
            raise ValueError(f"TensorFlowKerasState: the optimizer has "
                             f"{len(optimizer_variables)} variables but "
                             f"{len(self._saved_optimizer_state)} were saved; run one step "
                             f"(or optimizer.build) before making the state, in every world.")
        for var, value in zip(optimizer_variables, self._saved_optimizer_state):
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
