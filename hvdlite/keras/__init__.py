"""``import hvdlite.keras as hvd``: Horovod's ``horovod.keras`` for Keras 3 on every backend.

With ``KERAS_BACKEND=tensorflow`` (Keras 3's default, or tf-keras's Keras 2 under
``TF_USE_LEGACY_KERAS=1``) this is :mod:`hvdlite.tensorflow.keras` under Horovod's other name:
the same functions, classes and callbacks.  With ``KERAS_BACKEND=jax`` or ``torch`` it is
:mod:`.portable`: the same API (``DistributedOptimizer``, the callbacks, ``elastic``,
``allreduce``/``allgather``/``broadcast``, ``broadcast_variables``) with the gradients reduced by
the backend's own hvdlite adapter (``hvdlite.jax`` inside the jitted step, ``hvdlite.torch``).
A script written for ``horovod.keras`` runs after changing only its import.

The names are looked up in that module when first used (PEP 562), so that importing this
package costs nothing: the TensorFlow adapter uses its backend-neutral pieces
(:mod:`.callback_logic`, :mod:`.elastic_logic`) without loading Keras or another adapter.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from .backends import TENSORFLOW, backend_name

_SUBMODULES = ("callbacks", "elastic")   # hvd.callbacks.*, hvd.elastic.*: for the backend


def api() -> ModuleType:
    """The module whose names ``hvdlite.keras`` offers for the running Keras backend."""
    if backend_name() == TENSORFLOW:
        import hvdlite.tensorflow.keras as tf_keras
        return tf_keras
    # (not ``from . import portable``: that asks this module for the name first, which would
    # come back here)
    return importlib.import_module(f"{__name__}.portable")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = api()
    if name == "__all__":
        return sorted(set(getattr(module, "__all__", None)
                          or [n for n in dir(module) if not n.startswith("_")])
                      | set(_SUBMODULES))
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(dir(api())) | set(_SUBMODULES) | set(globals()))
