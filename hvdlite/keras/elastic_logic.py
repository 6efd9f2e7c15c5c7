"""The elastic state of a Keras model and its optimizer, once for every Keras: numpy copies of
their variables saved at each commit, restored after a failure, committed to the elastic driver,
and synchronized from rank 0 in a new world.

:class:`KerasVariablesState` leaves only the broadcast of variables to its subclasses
(:class:`hvdlite.tensorflow.elastic.TensorFlowKerasState` broadcasts with TensorFlow ops,
:class:`.portable_elastic.KerasState` through hvdlite's engine on any Keras 3 backend).  On JAX
the trainer's step state is synced into the variables before they are read or assigned
(:func:`.backends.sync_model_state`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hvdlite.common.core import ObjectState, broadcast_object, rank

from .backends import sync_model_state


def optimizer_variables(optimizer: Any) -> list:
    """The variables of a Keras optimizer (a property in Keras 3, a method in Keras 2)."""
    if optimizer is None:
        return []
    variables = getattr(optimizer, "variables", [])
    return list(variables() if callable(variables) else variables)


def optimizer_built(optimizer: Any) -> bool:
    """Whether a Keras optimizer has made its per-variable state (Keras does at the first
    step; an optimizer without the notion counts as built)."""
    return bool(getattr(optimizer, "built", True))


def _values(variables: Sequence[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


class KerasVariablesState(ObjectState):
    """State of a Keras model and its optimizer: their variables' values beside the plain
    attributes (``kwargs``: epoch, batch, ...).  Subclasses define :meth:`broadcast_variables`.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        kwargs: more attributes kept as plain objects.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        if hasattr(model, "build") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.optimizer = optimizer or model.optimizer
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def broadcast_variables(self, variables: list, name: str) -> None:
        """Assign rank 0's values of ``variables`` on every rank."""
        raise NotImplementedError

    def _build_optimizer(self) -> None:
        if not optimizer_built(self.optimizer) and hasattr(self.optimizer, "build"):
            self.optimizer.build(self.model.trainable_variables)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        sync_model_state(self.model)
        self.broadcast_variables(self.model.variables, "KerasState.model")
        # Keras makes an optimizer's variables at its first step: a new worker's has none yet
        # while rank 0's (restored) has them.  Every rank makes them where rank 0 has them.
        if broadcast_object(optimizer_built(self.optimizer), name="elastic.optimizer_built"):
            self._build_optimizer()
        variables = optimizer_variables(self.optimizer)
        if variables:
            self.broadcast_variables(variables, "KerasState.optimizer")
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        sync_model_state(self.model)
        self._saved_model_state = _values(self.model.variables)
        self._saved_optimizer_state = _values(optimizer_variables(self.optimizer))

    def _load_model(self) -> None:
        sync_model_state(self.model)
        for var, value in zip(self.model.variables, self._saved_model_state):
            var.assign(value)
        if len(self._saved_optimizer_state) > len(optimizer_variables(self.optimizer)):
            # A new process's optimizer makes its variables at its first step: make them now.
            self._build_optimizer()
        variables = optimizer_variables(self.optimizer)
        if len(variables) != len(self._saved_optimizer_state):
            raise ValueError(f"{type(self).__name__}: the optimizer has {len(variables)} "
                             f"variables but {len(self._saved_optimizer_state)} were saved; run "
                             f"one step (or optimizer.build) before making the state, in every "
                             f"world.")
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
