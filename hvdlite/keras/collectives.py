"""Horovod's Keras collectives for any Keras 3 backend: ``allreduce``, ``allgather``,
``broadcast``, ``reducescatter`` on the backend's tensors (or anything array-like), and
``broadcast_variables`` for Keras variables.

As in ``horovod.keras`` (and :mod:`hvdlite.tensorflow.keras`), the results are numpy arrays.
On JAX a traced value (inside ``jax.jit``) gives a traced result instead: the collective then
runs in the compiled step (``hvdlite.jax``).
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from hvdlite.common import core
from hvdlite.common.core import Average, ProcessSet, ReduceOp, global_process_set

from .backends import adapter


def _backend_tensor(value: Any) -> Any:
    import keras
    return keras.ops.convert_to_tensor(value)


def _to_numpy(value: Any) -> Any:
    """``value`` as numpy, unless it is a JAX tracer (inside ``jax.jit``): kept as is."""
    if "Tracer" in type(value).__name__:
        return value
    import keras
    return keras.ops.convert_to_numpy(value)


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: ReduceOp | None = None, compression: Any = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``value`` across ranks (default: average); a numpy array (Horovod Keras)."""
    bridge = adapter()
    return _to_numpy(bridge.allreduce(
        _backend_tensor(value), average=average, name=name,
        compression=compression or bridge.Compression.none, op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set))


def allgather(value: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Every rank's ``value`` concatenated along the first axis, in rank order (numpy)."""
    return _to_numpy(adapter().allgather(_backend_tensor(value), name=name,
                                         process_set=process_set))


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``value`` on every rank (numpy)."""
    return _to_numpy(adapter().broadcast(_backend_tensor(value), root_rank, name=name,
                                         process_set=process_set))


def reducescatter(value: Any, name: str | None = None, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set) -> np.ndarray:
    """This rank's rows of ``value`` reduced across ranks (Average by default; numpy).  Runs on
    host arrays, eagerly."""
    return core.reducescatter(np.array(_to_numpy(value), order="C"), name=name, op=op,
                              process_set=process_set)


def broadcast_variables(variables: Iterable[Any], root_rank: int,
                        name: str = "broadcast_variables") -> None:
    """Assign ``root_rank``'s value of every Keras variable in ``variables`` to it on every
    rank (eagerly, on any backend: the values travel as host arrays, one broadcast each, named
    by position)."""
    for i, var in enumerate(variables):
        value = np.array(var.numpy(), order="C")
        var.assign(core.broadcast(value, root_rank, name=f"{name}.{i}").reshape(value.shape))
