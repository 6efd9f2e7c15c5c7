"""Which Keras 3 backend runs, and the hvdlite adapter whose collectives work on its tensors.

Keras 3 runs on TensorFlow, JAX or PyTorch (``KERAS_BACKEND``).  hvdlite's Keras support is one
backend-neutral layer (:mod:`.optimizer`, :mod:`.portable_callbacks`, :mod:`.portable_elastic`)
over this small bridge: the adapter returned by :func:`adapter` reduces, gathers and broadcasts
the backend's own tensors (``hvdlite.torch`` for torch tensors, ``hvdlite.jax`` for jax arrays,
eagerly and inside ``jax.jit``).  TensorFlow keeps its own Keras adapter,
:mod:`hvdlite.tensorflow.keras` (graph nodes, Keras 2 through tf-keras).
"""
from __future__ import annotations

from types import ModuleType

TENSORFLOW, JAX, TORCH = "tensorflow", "jax", "torch"


def backend_name() -> str:
    """The running Keras 3 backend (``"tensorflow"``, ``"jax"`` or ``"torch"``); TensorFlow's
    when Keras 3 is not installed (tf-keras alone)."""
    try:
        import keras
    except ImportError:
        return TENSORFLOW
    backend = getattr(keras, "backend", None)
    name = getattr(backend, "backend", None)
    return name() if callable(name) else TENSORFLOW


def adapter() -> ModuleType:
    """The hvdlite adapter for the JAX or torch backend's tensors (``allreduce``,
    ``grouped_allreduce``, ``allgather``, ``broadcast``, ``barrier``, ``elastic.run``,
    ``Compression``, with one signature)."""
    name = backend_name()
    if name == TORCH:
        import hvdlite.torch as torch_adapter
        return torch_adapter
    if name == JAX:
        import hvdlite.jax as jax_adapter
        return jax_adapter
    if name == TENSORFLOW:   # (hvdlite.tensorflow.keras has its own graph-node collectives)
        raise NotImplementedError("under the TensorFlow backend hvdlite.keras is "
                                  "hvdlite.tensorflow.keras, which uses hvdlite.tensorflow")
    raise NotImplementedError(f"hvdlite.keras supports the tensorflow, jax and torch Keras "
                              f"backends, not {name!r}.")


def sync_model_state(model) -> None:
    """Write the JAX trainer's step state back into ``model``'s variables (a no-op on the other
    backends).  Inside ``fit`` on JAX the variables hold nothing between steps: the state travels
    through the jitted step, so a callback that reads or assigns variables must sync first; the
    next step then starts from the variables, assigned values included."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()
