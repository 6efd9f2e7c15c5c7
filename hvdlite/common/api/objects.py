"""Broadcast / allgather of arbitrary picklable Python objects (framework-neutral)."""
from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from hvdlite.common.api import ops
from hvdlite.common.errors import HvdliteError
from hvdlite.common.runtime import state
from hvdlite.common.runtime.process_sets import ProcessSet


def _dumps(obj: Any) -> np.ndarray:
    buf = io.BytesIO()
    try:
        import cloudpickle  # lambdas and local classes, as Horovod allows
        cloudpickle.dump(obj, buf)
    except ImportError:
        pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def _try_dumps(obj: Any) -> tuple[np.ndarray, Exception | None]:
    """``obj`` pickled, or, if it cannot be, the error's text as bytes and the error.  A rank
    whose object fails to pickle still takes part in every collective (sending the error's
    text instead), so that every rank raises instead of the others waiting for it for ever."""
    try:
        return _dumps(obj), None
    except Exception as exc:   # noqa: BLE001 - pickling raises TypeError, PicklingError, ...
        text = f"{type(exc).__name__}: {exc}"
        return np.frombuffer(text.encode("utf-8", "replace"), dtype=np.uint8), exc


def _pickling_failed(what: str, failed: dict[int, str], own: Exception | None) -> HvdliteError:
    ranks = sorted(failed)
    error = HvdliteError(
        f"{what}: the object of rank(s) {ranks} could not be pickled "
        f"({failed[ranks[0]]}), so no rank received anything. Pass an object that pickle (or "
        f"cloudpickle, if installed) can serialize, e.g. convert tensors and handles to plain "
        f"values first.")
    error.__cause__ = own
    return error


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled; other ranks may pass None).
    With ``process_set``, only its ranks take part and ``root_rank`` is a (global) rank of
    the set, as in :func:`hvdlite.broadcast`.  If the root's object cannot be pickled, every
    rank raises :class:`HvdliteError` saying why (the root's chained to the pickling error)."""
    base = "broadcast_object" if name is None else f"broadcast_object.{name}"
    is_root = state.rank() == root_rank
    payload, failure = _try_dumps(obj) if is_root else (np.empty(0, dtype=np.uint8), None)
    # [0]: 1 if the root's object could not be pickled (then the data is the error's text)
    header = ops.broadcast(np.array([failure is not None, payload.size], dtype=np.int64),
                           root_rank, name=f"{base}.len", process_set=process_set)
    data = payload if is_root else np.empty(int(header[1]), dtype=np.uint8)
    data = ops.broadcast(data, root_rank, name=f"{base}.data", process_set=process_set)
    if header[0]:
        raise _pickling_failed(base, {root_rank: data.tobytes().decode("utf-8", "replace")},
                               failure)
    return pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet | None = None) -> list:
    """List of every rank's ``obj``, in rank order (of ``process_set``'s ranks, if given).  If
    some rank's object cannot be pickled, every rank raises :class:`HvdliteError` naming the
    ranks and why."""
    base = "allgather_object" if name is None else f"allgather_object.{name}"
    payload, failure = _try_dumps(obj)
    # One row per rank: [1 if its object could not be pickled (its data is the error's text),
    # its byte count].
    headers = ops.allgather(np.array([[failure is not None, payload.size]], dtype=np.int64),
                            name=f"{base}.len", process_set=process_set)
    data = ops.allgather(payload, name=f"{base}.data", process_set=process_set).tobytes()
    ranks = list(range(state.size())) if process_set is None else process_set.ranks
    out, failed, offset = [], {}, 0
    for rank, (bad, n) in zip(ranks, headers.tolist()):
        piece = data[offset:offset + n]
        if bad:
            failed[rank] = piece.decode("utf-8", "replace")
        elif not failed:
            out.append(pickle.loads(piece))
        offset += n
    if failed:
        raise _pickling_failed(base, failed, failure)
    return out
