"""Collective operations on numpy arrays: the framework-neutral public API.

This is what a plain numpy program (or a framework without an adapter) uses, and what the
framework adapters build on: they hand zero-copy numpy views of their tensors to :func:`submit`.
Semantics follow Horovod: every rank must call the same operations with the same names (or in the
same order when unnamed); results are identical on every rank.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable

import numpy as np

from . import basics
from .dtypes import check_reduce_op, dtype_info
from .errors import HvdliteError
from .handle import Entry, Handle
from .messages import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, Request
from .reduce_ops import ReduceOp, resolve_op

_counter_lock = threading.Lock()
_counters: dict[str, itertools.count] = {}


def _auto_name(kind: str) -> str:
    with _counter_lock:
        counter = _counters.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"


def _contiguous(x) -> np.ndarray:
    """``x`` as a C-contiguous array, copying only if needed (0-d stays 0-d, unlike
    np.ascontiguousarray)."""
    array = np.asarray(x)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _default_allocate(shape: tuple, dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def submit(kind: str, array: np.ndarray | None, *, name: str | None = None,
           output: np.ndarray | None = None,
           allocate: Callable[[tuple, np.dtype], np.ndarray] | None = None,
           reduce_op: ReduceOp = ReduceOp.Sum, root_rank: int = -1, prescale_factor: float = 1.0,
           postscale_factor: float = 1.0, dtype: str | None = None, device: int = -1) -> Handle:
    """Enqueue one collective on contiguous numpy views; return its handle at once.

    ``array``/``output`` must be C-contiguous.  ``output is array`` means in place.  ``dtype``
    overrides the array's dtype for views of types numpy lacks (a torch bfloat16 tensor arrives
    as a uint16 view with ``dtype="bfloat16"``).  ``allocate(shape, dtype)`` creates an output
    whose shape is known only after negotiation (allgather).
    """
    engine = basics.engine()
    cacheable = name is not None
    if name is None:
        name = _auto_name(kind)
    elif not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    if kind == BARRIER:
        request = Request(name, kind, "uint8", (), cacheable=True)
        entry = Entry(request, None, None, None, engine.new_handle(name))
        return engine.submit(entry)

    array_dtype = array.dtype
    info = dtype_info(dtype if dtype is not None else array_dtype, kind)
    if not array.flags.c_contiguous:
        raise ValueError(f"{kind} of {name!r}: the input array is not contiguous; pass a "
                         f"contiguous array (np.ascontiguousarray) or use the out-of-place "
                         f"operation.")
    if output is not None and output is not array:
        out_flags = output.flags
        if not out_flags.c_contiguous or not out_flags.writeable:
            raise ValueError(f"{kind} of {name!r}: the output array must be contiguous and "
                             f"writable.")
    if array_dtype is not info.np_dtype and array_dtype != info.np_dtype:
        in_place = output is array
        array = array.view(info.np_dtype)
        output = array if in_place else (None if output is None else output.view(info.np_dtype))
    if kind == ALLREDUCE:
        check_reduce_op(info, reduce_op, name)
    elif kind == BROADCAST and not 0 <= root_rank < basics.size():
        raise ValueError(f"{kind} of {name!r}: root_rank={root_rank} is out of range for a job "
                         f"of {basics.size()} ranks.")
    shape = array.shape
    if kind == ALLGATHER and not shape:
        shape = (1,)
        array = array.reshape(1)
    request = Request(name, kind, info.name, shape,
                      int(reduce_op) if kind == ALLREDUCE else -1,
                      root_rank if kind == BROADCAST else -1, device,
                      prescale_factor if type(prescale_factor) is float else float(prescale_factor),
                      postscale_factor if type(postscale_factor) is float
                      else float(postscale_factor), cacheable)
    if output is None and kind != ALLGATHER:
        output = np.empty_like(array)
    entry = Entry(request, array, output, allocate or _default_allocate,
                  engine.new_handle(name))
    return engine.submit(entry)


def _contiguous_in_place(array: np.ndarray, run: Callable[[np.ndarray], Handle]) -> Handle:
    """In-place op on a possibly non-contiguous array: work on a contiguous copy, copy back."""
    if array.flags.c_contiguous:
        return run(array)
    work = _contiguous(array)

    def copy_back(result: np.ndarray) -> np.ndarray:
        array[...] = result
        return array

    return run(work).then(copy_back)


def _check_writable(array: np.ndarray, what: str) -> None:
    if not array.flags.writeable:
        raise ValueError(f"{what} needs a writable array; this one is read-only.")


# --- allreduce -------------------------------------------------------------------------------
def allreduce_async(array, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> Handle:
    """Start an allreduce of ``array`` into a new array; return a handle.

    ``op``: Average (default), Sum, Min, Max or Product.  ``prescale_factor`` multiplies the
    input before the reduction and ``postscale_factor`` the result after it (Average divides by
    size() on top).  Integer results are scaled in float64 and truncated toward zero.
    """
    return submit(ALLREDUCE, _contiguous(array), name=name, reduce_op=resolve_op(op, average),
                  prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_async_(array: np.ndarray, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> Handle:
    """In-place variant of :func:`allreduce_async`: the result overwrites ``array``."""
    flags = array.flags
    reduce_op = resolve_op(op, average)
    if flags.c_contiguous and flags.writeable:   # the common case, without extra layers
        return submit(ALLREDUCE, array, name=name, output=array, reduce_op=reduce_op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    _check_writable(array, "allreduce_")
    return _contiguous_in_place(array, lambda a: submit(
        ALLREDUCE, a, name=name, output=a, reduce_op=reduce_op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor))


def allreduce(array, average: bool | None = None, name: str | None = None,
              op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``array`` across all ranks (default: average) and return the result."""
    return allreduce_async(array, average, name, op, prescale_factor, postscale_factor).wait()


def allreduce_(array: np.ndarray, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> np.ndarray:
    """In-place allreduce; returns ``array``."""
    return allreduce_async_(array, average, name, op, prescale_factor, postscale_factor).wait()


# --- allgather -------------------------------------------------------------------------------
def allgather_async(array, name: str | None = None) -> Handle:
    """Start gathering every rank's ``array`` along the first dimension (which may differ per
    rank; the other dimensions must match).  A scalar counts as one row."""
    return submit(ALLGATHER, _contiguous(array), name=name)


def allgather(array, name: str | None = None) -> np.ndarray:
    """Concatenation of every rank's ``array`` along dimension 0, in rank order."""
    return allgather_async(array, name).wait()


# --- broadcast -------------------------------------------------------------------------------
def broadcast_async(array, root_rank: int, name: str | None = None) -> Handle:
    """Start broadcasting ``root_rank``'s ``array`` into a new array on every rank."""
    return submit(BROADCAST, _contiguous(array), name=name, root_rank=root_rank)


def broadcast_async_(array: np.ndarray, root_rank: int, name: str | None = None) -> Handle:
    """In-place broadcast: ``array`` is overwritten with the root's values on other ranks."""
    _check_writable(array, "broadcast_")
    return _contiguous_in_place(array, lambda a: submit(
        BROADCAST, a, name=name, output=a, root_rank=root_rank))


def broadcast(array, root_rank: int, name: str | None = None) -> np.ndarray:
    """Return ``root_rank``'s ``array`` on every rank."""
    return broadcast_async(array, root_rank, name).wait()


def broadcast_(array: np.ndarray, root_rank: int, name: str | None = None) -> np.ndarray:
    """In-place broadcast; returns ``array``."""
    return broadcast_async_(array, root_rank, name).wait()


# --- barrier and handles ---------------------------------------------------------------------
def barrier() -> None:
    """Block until every rank has called barrier()."""
    submit(BARRIER, None, name="barrier").wait()


def poll(handle: Handle) -> bool:
    """True if the asynchronous operation behind ``handle`` has finished."""
    return handle.poll()


def synchronize(handle: Handle):
    """Wait for ``handle`` and return its result (raises the operation's error, if any)."""
    if not isinstance(handle, Handle):
        raise HvdliteError(f"synchronize() expects a handle returned by an *_async call, "
                           f"got {type(handle).__name__}.")
    return handle.wait()
