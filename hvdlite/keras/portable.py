"""The ``hvdlite.keras`` API under Keras 3's JAX and torch backends: the shared hvdlite API,
the backend adapter's ``Compression``, :func:`.optimizer.DistributedOptimizer`, the Keras
collectives, the callbacks and ``elastic``."""
from __future__ import annotations

from typing import Any

from hvdlite.common import core
from hvdlite.common.core import *  # noqa: F401,F403 - the shared API

from .backends import adapter
from .collectives import (allgather, allreduce, broadcast, broadcast_variables,  # noqa: F401
                          reducescatter)
from .optimizer import (DistributedOptimizer, PartialDistributedOptimizer,  # noqa: F401
                        DistributedOptimizerMixin, make_distributed)
from . import portable_callbacks as callbacks  # noqa: F401
from . import portable_elastic as elastic  # noqa: F401

Compression = adapter().Compression
barrier = adapter().barrier   # (process_set=...): every rank waits for the others

__all__ = list(core.__all__) + [
    "Compression", "DistributedOptimizer", "DistributedOptimizerMixin",
    "PartialDistributedOptimizer", "allgather", "allreduce", "barrier", "broadcast",
    "broadcast_global_variables", "broadcast_variables", "callbacks", "elastic", "load_model",
    "reducescatter"]


def load_model(filepath: str, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = None) -> Any:
    """Load a saved Keras model whose optimizer is turned into a :func:`DistributedOptimizer`
    in place (its saved state kept)."""
    import keras
    objects = dict(custom_objects or {})
    for opt_cls in custom_optimizers or []:
        objects[opt_cls.__name__] = opt_cls
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not isinstance(opt, DistributedOptimizerMixin):
        make_distributed(opt, compression=compression)
    return model


def broadcast_global_variables(root_rank: int) -> None:
    """Horovod's TF1 graph-mode API: Keras 3 has no global variables; raises, as Horovod's does
    eagerly."""
    raise RuntimeError("hvd.broadcast_global_variables() needs a TF1 graph; use "
                       "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                       "hvd.broadcast_variables(model.variables, root_rank) instead.")
