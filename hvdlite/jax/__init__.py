"""JAX adapter with Horovod's API: ``import hvdlite.jax as hvd``.

Collectives on ``jax.Array``s and pytrees, eagerly and inside ``jax.jit`` (one ordered
``io_callback`` per operation), differentiable under ``jax.grad`` with the torch adapter's
gradients; ``broadcast_parameters`` for pytrees; ``DistributedOptimizer`` wrapping an
``optax.GradientTransformation``; ``hvd.elastic.JaxState``.  Arrays travel through host
memory (see docs/jax.md).  Needs ``pip install hvdlite[jax]``.
"""
import importlib as _importlib

try:
    for _module in ("jax", "optax"):
        _importlib.import_module(_module)
except ImportError as _missing:   # pragma: no cover - exercised without jax installed
    raise ImportError(
        f"hvdlite.jax needs JAX and optax ({_missing}); install them with "
        f"`pip install hvdlite[jax]`.") from _missing

from hvdlite.common.core import *  # noqa: F401,F403 - the shared, framework-neutral API

from .compression import Compression
from .mpi_ops import (allreduce, grouped_allreduce, allgather, grouped_allgather, broadcast,
                      alltoall, reducescatter, grouped_reducescatter, barrier, join,
                      original_error)
from .functions import broadcast_parameters, broadcast_optimizer_state
from .optimizer import DistributedOptimizer, DistributedState
from . import elastic  # noqa: F401 - hvd.elastic.*: Horovod's elastic API

from hvdlite.common.core import __all__ as _shared

__all__ = list(_shared) + [
    "Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather",
    "broadcast", "alltoall", "reducescatter", "grouped_reducescatter", "barrier", "join",
    "original_error", "broadcast_parameters", "broadcast_optimizer_state",
    "DistributedOptimizer", "DistributedState", "elastic"]
