"""Broadcast / allgather of arbitrary picklable Python objects (framework-neutral)."""
from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from . import basics, ops
from .process_sets import ProcessSet


def _dumps(obj: Any) -> np.ndarray:
    buf = io.BytesIO()
    try:
        import cloudpickle  # lambdas and local classes, as Horovod allows
        cloudpickle.dump(obj, buf)
    except ImportError:
        pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled; other ranks may pass None).
    With ``process_set``, only its ranks take part and ``root_rank`` is a (global) rank of
    the set, as in :func:`hvdlite.broadcast`."""
    base = "broadcast_object" if name is None else f"broadcast_object.{name}"
    payload = _dumps(obj) if basics.rank() == root_rank else np.empty(0, dtype=np.uint8)
    length = ops.broadcast(np.array([payload.size], dtype=np.int64), root_rank,
                           name=f"{base}.len", process_set=process_set)
    data = payload if basics.rank() == root_rank else np.empty(int(length[0]), dtype=np.uint8)
    data = ops.broadcast(data, root_rank, name=f"{base}.data", process_set=process_set)
    return pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet | None = None) -> list:
    """List of every rank's ``obj``, in rank order (of ``process_set``'s ranks, if given)."""
    base = "allgather_object" if name is None else f"allgather_object.{name}"
    payload = _dumps(obj)
    sizes = ops.allgather(np.array([payload.size], dtype=np.int64), name=f"{base}.len",
                          process_set=process_set)
    data = ops.allgather(payload, name=f"{base}.data", process_set=process_set).tobytes()
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[offset:offset + n]))
        offset += n
    return out
