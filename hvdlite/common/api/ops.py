"""Collective operations on numpy arrays: the framework-neutral public API.

This is what a plain numpy program (or a framework without an adapter) uses, and what the
framework adapters build on: they hand zero-copy numpy views of their tensors to :func:`submit`.
Semantics follow Horovod: every rank must call the same operations with the same names (or in the
same order when unnamed); results are identical on every rank.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
from typing import Callable, Iterator

import numpy as np

from hvdlite.common.dtypes import check_reduce_op, dtype_info
from hvdlite.common.engine.handle import Entry, GroupHandle, Handle
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST,
                                            FAILED, JOIN, REDUCESCATTER, Request)
from hvdlite.common.errors import (DuplicateNameError, HvdliteError, NotInitializedError,
                                   ShutdownError, UnsupportedOperationError)
from hvdlite.common.memory import result_empty
from hvdlite.common.reduce_ops import ReduceOp, resolve_op
from hvdlite.common.runtime import lifecycle, registry, state
from hvdlite.common.runtime.process_sets import ProcessSet, global_process_set

_counter_lock = threading.Lock()
_counters: dict[tuple[str, int], itertools.count] = {}


def _auto_name(kind: str, set_id: int = 0) -> str:
    # One counter per process set: unnamed ops in a set must not shift the global set's names.
    with _counter_lock:
        counter = _counters.setdefault((kind, set_id), itertools.count())
        n = next(counter)
    return f"{kind}.noname.{n}" if set_id == 0 else f"{kind}.set{set_id}.noname.{n}"


# Errors after which no stand-in can be submitted (nothing runs any more, or the name is busy).
_NOTHING_TO_ANNOUNCE = (DuplicateNameError, ShutdownError, NotInitializedError)
# The cause sent to the other ranks with a FAILED stand-in is cut to this many characters.
_FAILURE_TEXT_LIMIT = 600


def reset_auto_names() -> None:
    """Restart the unnamed-op counters (at shutdown: process set ids restart with a new init)."""
    with _counter_lock:
        _counters.clear()


# Every rank re-initializes together after a shutdown, so unnamed operations restart in step.
lifecycle.on_shutdown(reset_auto_names)


def _contiguous(x) -> np.ndarray:
    """``x`` as a C-contiguous array, copying only if needed (0-d stays 0-d, unlike
    np.ascontiguousarray)."""
    if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
        return x if x.flags.c_contiguous else x.copy()   # a CuPy array stays on its GPU
    array = np.asarray(x)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _default_allocate(shape: tuple, dtype: np.dtype) -> np.ndarray:
    return result_empty(shape, dtype)


# Host allreduces whose (numpy dtype, reduce op) passed make_entry's checks once, mapped to what
# their request carries: (canonical dtype name, op as int).  The fast path below needs no dtype
# lookup or op check for a pair seen before; it runs for every gradient of every step.
_checked_host_allreduce: dict[tuple, tuple[str, int]] = {}
_new_request = tuple.__new__   # builds a Request without NamedTuple.__new__'s Python frame


def fast_host_allreduce(array, output, name, reduce_op, prescale_factor, postscale_factor,
                        process_set) -> Handle | None:
    """Submit a named allreduce of a contiguous host array on the global set when its dtype and
    op were validated before; ``None`` if anything is unusual (the caller takes the general
    path, which also raises the errors).  ``output is array`` means in place, ``None`` a new
    result.  Same checks and entry as :func:`make_entry`, in fewer steps.  Framework adapters
    call it too, with a zero-copy numpy view of their tensor."""
    if process_set is not None or type(array) is not np.ndarray:
        return None
    checked = _checked_host_allreduce.get((array.dtype, reduce_op))
    if (checked is None or type(name) is not str or type(prescale_factor) is not float
            or type(postscale_factor) is not float
            or (output is not None and output is not array)):   # outputs get checked there
        return None
    flags = array.flags
    if not flags.c_contiguous or (output is array and not flags.writeable):
        return None
    engine = state.engine()
    shape = array.shape
    if output is None:
        output = result_empty(shape, array.dtype)
    request = _new_request(Request, (name, ALLREDUCE, checked[0], shape, checked[1], -1, -1,
                                     prescale_factor, postscale_factor, (), "", 0, True, ""))
    return engine.submit(Entry(request, array, output, _default_allocate,
                               engine.new_handle(name)))


class PreparedAllreduce:
    """One named allreduce submitted again and again on the same memory (a gradient bucket's
    flat buffer): checked once by :func:`prepare_allreduce`, after which each :meth:`submit`
    is an entry and a hand-off to the engine.  ``engine`` is the one it was prepared for (a
    new ``init()`` makes a new one: prepare again when ``engine`` is no longer current)."""

    __slots__ = ("engine", "request", "array", "allocate", "name")

    def __init__(self, engine, entry: Entry) -> None:
        self.engine = engine
        self.request, self.array, self.allocate = entry.request, entry.array, entry.allocate
        self.name = entry.request.name

    def submit(self) -> Handle:
        """Submit the allreduce, in place, again (the memory holds this step's values)."""
        engine = self.engine
        return engine.submit(Entry(self.request, self.array, self.array, self.allocate,
                                   engine.new_handle(self.name)))


def prepare_allreduce(array, name: str, reduce_op: ReduceOp, prescale_factor: float,
                      postscale_factor: float, process_set: ProcessSet | None = None,
                      dtype: str | None = None) -> PreparedAllreduce:
    """Check an in-place allreduce of ``array`` (contiguous; a CuPy view for GPU memory) under
    ``name`` once, as :func:`submit` would, for repeated submissions (see
    :class:`PreparedAllreduce`)."""
    if process_set is None or process_set is global_process_set:
        engine, members, set_id = state.engine(), None, 0
    else:
        engine, members = registry.process_set_engine(process_set, f"allreduce of {name}")
        set_id = 0 if members is None else process_set.process_set_id
    entry = make_entry(engine, members, ALLREDUCE, array, name, array, None, reduce_op, -1,
                       prescale_factor, postscale_factor, dtype, -1, None, set_id)
    return PreparedAllreduce(engine, entry)


def submit(kind: str, array: np.ndarray | None, *, name: str | None = None,
           output: np.ndarray | None = None,
           allocate: Callable[[tuple, np.dtype], np.ndarray] | None = None,
           reduce_op: ReduceOp = ReduceOp.Sum, root_rank: int = -1, prescale_factor: float = 1.0,
           postscale_factor: float = 1.0, dtype: str | None = None, device: int = -1,
           splits=None, process_set: ProcessSet | None = None) -> Handle:
    """Enqueue one collective on contiguous numpy views; return its handle at once.

    ``array``/``output`` must be C-contiguous.  ``output is array`` means in place.  ``dtype``
    overrides the array's dtype for views of types numpy lacks (a torch bfloat16 tensor arrives
    as a uint16 view with ``dtype="bfloat16"``).  ``allocate(shape, dtype)`` creates an output
    whose shape is known only after negotiation (allgather, alltoall, reducescatter).
    ``process_set`` (default: all ranks) selects the ranks, and the engine, that run it.
    """
    if process_set is None or process_set is global_process_set:   # the hot path: no lookup
        if kind is ALLREDUCE and dtype is None and device == -1 and allocate is None:
            handle = fast_host_allreduce(array, output, name, reduce_op, prescale_factor,
                                         postscale_factor, None)
            if handle is not None:
                return handle
        engine, members, set_id = state.engine(), None, 0
    else:
        engine, members = registry.process_set_engine(process_set,
                                                    f"{kind} of {name or 'a tensor'}")
        set_id = 0 if members is None else process_set.process_set_id
    auto_named = name is None
    if auto_named:
        name = _auto_name(kind, set_id)
    try:
        # Positional: this runs for every gradient, and keyword passing costs measurably here.
        entry = make_entry(engine, members, kind, array, name, output, allocate, reduce_op,
                           root_rank, prescale_factor, postscale_factor, dtype, device, splits,
                           set_id, "", 0, auto_named)
    except Exception as exc:
        if auto_named:
            _announce(engine, members, [name], exc)
        raise
    return engine.submit(entry)


def announce_failure(kind: str, name: str | None, process_set: ProcessSet | None,
                     error: BaseException) -> None:
    """Tell the other ranks that this rank's unnamed ``kind`` operation raised ``error`` before
    it could be submitted (adapters call this when their own checks fail; the core's checks do
    it themselves).  The operation takes its automatic name here, so the ranks' later automatic
    names stay paired, and the other ranks' operation under that name fails with an error
    naming this rank and the cause instead of waiting for a submission that never comes.

    Named operations are not announced: the rank may retry under the same name (the others'
    operation then completes with the retry), and a stand-in would occupy the name.  Nothing is
    announced where no operation could be submitted (not initialized, not a member of
    ``process_set``, shut down)."""
    if (name is not None or getattr(error, "_hvdlite_announced", False)
            or isinstance(error, _NOTHING_TO_ANNOUNCE)):
        return
    try:
        if process_set is None or process_set is global_process_set:
            engine, members, set_id = state.engine(), None, 0
        else:
            engine, members = registry.process_set_engine(process_set, f"{kind} of a tensor")
            set_id = 0 if members is None else process_set.process_set_id
    except Exception:   # noqa: BLE001 - nothing can be submitted here, so nothing is owed
        return
    _announce(engine, members, [_auto_name(kind, set_id)], error)


@contextlib.contextmanager
def announced(kind: str, name: str | None, process_set: ProcessSet | None) -> Iterator[None]:
    """Announce an error raised inside the block (an operation's checks before it is
    submitted; see :func:`announce_failure`).  Never around a wait: an operation's own error,
    raised when it is waited for, was submitted, and announcing it would shift the names."""
    try:
        yield
    except Exception as exc:
        announce_failure(kind, name, process_set, exc)
        raise


def announcing_with(announce: Callable[[dict, Exception], None]) -> Callable[[Callable], Callable]:
    """Decorator factory: an error the decorated public operation raises (always before its
    submission was taken) and nothing announced yet is passed to ``announce(arguments, error)``
    with the call's bound arguments, then re-raised.  A malformed call (arguments that do not
    bind) is not announced: it fails alike on every rank."""
    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if not getattr(exc, "_hvdlite_announced", False):
                    try:
                        bound = signature.bind(*args, **kwargs).arguments
                    except TypeError:
                        raise exc from None
                    announce(bound, exc)
                raise
        return call
    return decorate


def announcing(kind: str) -> Callable[[Callable], Callable]:
    """Decorator for a public operation that returns a handle and takes ``name`` and
    ``process_set`` arguments: an error it raises (always before its submission was taken) is
    announced (see :func:`announce_failure`), whichever check raised it."""
    return announcing_with(lambda bound, exc: announce_failure(
        kind, bound.get("name"), bound.get("process_set"), exc))


def _announce(engine, members: list[int] | None, names: list[str], error: BaseException,
              group: str = "") -> None:
    """Submit one FAILED stand-in per name (a group's members keep their group, so that the
    group fails as one unit everywhere).  Best effort: the caller re-raises ``error``."""
    try:
        error._hvdlite_announced = True   # outer layers (see announcing) must not announce again
    except AttributeError:
        pass
    if isinstance(error, _NOTHING_TO_ANNOUNCE):
        return   # the name is busy here, or nothing runs any more: nothing can stand in
    failure = f"{type(error).__name__}: {error}"
    if len(failure) > _FAILURE_TEXT_LIMIT:
        failure = failure[:_FAILURE_TEXT_LIMIT] + "..."
    entries = [Entry(Request(name, FAILED, "uint8", (), group=group,
                             group_size=len(names) if group else 0, cacheable=False,
                             failure=failure), None, None, None, engine.new_handle(name))
               for name in names]
    try:
        if group:
            engine.submit_group(entries)
        else:
            engine.submit(entries[0])
    except HvdliteError:   # e.g. one of the names is in flight here already
        pass


def make_entry(engine, members: list[int] | None, kind: str, array: np.ndarray | None,
               name: str | None = None, output: np.ndarray | None = None,
               allocate: Callable[[tuple, np.dtype], np.ndarray] | None = None,
               reduce_op: ReduceOp = ReduceOp.Sum, root_rank: int = -1,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               dtype: str | None = None, device: int = -1, splits=None, set_id: int = 0,
               group: str = "", group_size: int = 0, auto_named: bool = False) -> Entry:
    """Validate one operation locally and build the engine entry for it (see :func:`submit`);
    ``members`` are the global ranks of its process set (None = all).  ``auto_named``: ``name``
    was generated (such names never repeat, so their responses are not cached)."""
    cacheable = not auto_named
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    if kind in (BARRIER, JOIN):
        request = Request(name, kind, "uint8", (), cacheable=kind == BARRIER)
        return Entry(request, None, None, None, engine.new_handle(name))

    array_dtype = array.dtype
    info = dtype_info(dtype if dtype is not None else array_dtype, kind)
    on_gpu = device >= 0 or not isinstance(array, np.ndarray)
    if on_gpu:   # a CuPy view of a GPU tensor
        device = _check_gpu(engine, kind, info, reduce_op, array, f"{kind} of {name!r}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{kind} of {name!r}: the input array is not contiguous; pass a "
                         f"contiguous array (np.ascontiguousarray) or use the out-of-place "
                         f"operation.")
    if output is not None and output is not array:
        out_flags = output.flags
        if not out_flags.c_contiguous or not (on_gpu or out_flags.writeable):
            raise ValueError(f"{kind} of {name!r}: the output array must be contiguous and "
                             f"writable.")
    if array_dtype is not info.np_dtype and array_dtype != info.np_dtype and not on_gpu:
        in_place = output is array
        array = array.view(info.np_dtype)
        output = array if in_place else (None if output is None else output.view(info.np_dtype))
    shape = array.shape
    if kind in (ALLREDUCE, REDUCESCATTER):
        check_reduce_op(info, reduce_op, name)
        if (kind == ALLREDUCE and not on_gpu and members is None and dtype is None
                and array_dtype == info.np_dtype and reduce_op != ReduceOp.Adasum):
            _checked_host_allreduce[(array_dtype, reduce_op)] = (info.name, int(reduce_op))
        if reduce_op == ReduceOp.Adasum:
            from hvdlite.common.backends.adasum import check_adasum_size
            if kind == REDUCESCATTER:
                raise UnsupportedOperationError(f"reducescatter of {name!r}: op=Adasum is not "
                                                f"supported; use Sum or Average.")
            check_adasum_size(_set_size(members), f"allreduce of {name!r}")
        if kind == REDUCESCATTER and not shape:
            raise ValueError(f"reducescatter of {name!r}: a scalar cannot be scattered; pass a "
                             f"tensor with at least one dimension (its rows are split across "
                             f"ranks).")
    elif kind == BROADCAST:
        set_size = _set_size(members)
        valid = range(set_size) if members is None else members
        if root_rank not in valid:
            where = (f"a job of {set_size} ranks" if members is None
                     else f"process set {set_id} (ranks {members})")
            raise ValueError(f"{kind} of {name!r}: root_rank={root_rank} is not a rank of "
                             f"{where}.")
    elif kind == ALLTOALL:
        if not shape:
            raise ValueError(f"alltoall of {name!r}: a scalar cannot be split; pass a tensor "
                             f"with at least one dimension.")
        splits = _check_splits(name, splits, shape[0], _set_size(members))
    if kind == ALLGATHER and not shape:
        shape = (1,)
        array = array.reshape(1)
    request = Request(name, kind, info.name, shape,
                      int(reduce_op) if kind in (ALLREDUCE, REDUCESCATTER) else -1,
                      root_rank if kind == BROADCAST else -1, device,
                      prescale_factor if type(prescale_factor) is float else float(prescale_factor),
                      postscale_factor if type(postscale_factor) is float
                      else float(postscale_factor), splits or (), group, group_size, cacheable)
    if on_gpu:
        if allocate is None:
            allocate = _device_allocator(array.dtype, device)
        if output is None and kind in (ALLREDUCE, BROADCAST):
            output = allocate(array.shape, array.dtype)
    elif output is None and kind in (ALLREDUCE, BROADCAST):
        output = result_empty(array.shape, array.dtype)
    return Entry(request, array, output, allocate or _default_allocate, engine.new_handle(name))


def _check_gpu(engine, kind: str, info, reduce_op: ReduceOp, array, what: str) -> int:
    """Everything about a GPU tensor that can fail is checked here, before it is in flight:
    CuPy/NCCL present, one GPU per process, a dtype NCCL can reduce.  Returns the device."""
    from hvdlite.common.gpu import cuda
    runtime = cuda.runtime()
    runtime.require(what)
    device = runtime.device_of(array)
    cuda.claim_device(device, what)
    if engine.config.gpu_operations == "nccl":
        runtime.require_nccl(what)
        if kind == ALLREDUCE:
            from hvdlite.common.backends.nccl import nccl_reduce_check
            nccl_reduce_check(info.name, reduce_op, what)
    return device


def _device_allocator(dtype, device: int) -> Callable[[tuple, np.dtype], object]:
    """Outputs on the input's GPU, in the input's (device) dtype: bfloat16 stays a 16-bit view."""
    from hvdlite.common.gpu import cuda
    runtime = cuda.runtime()
    return lambda shape, _dtype: runtime.empty(shape, dtype, device)


def _set_size(members: list[int] | None) -> int:
    return state.size() if members is None else len(members)


def _check_splits(name: str, splits, rows: int, set_size: int) -> tuple:
    if splits is None:
        if rows % set_size:
            raise ValueError(f"alltoall of {name!r}: without splits the first dimension ({rows}) "
                             f"must be divisible by the number of ranks ({set_size}); pass "
                             f"splits=[rows for each rank].")
        return (rows // set_size,) * set_size
    try:
        values = tuple(int(n) for n in np.asarray(splits).reshape(-1).tolist())
    except (TypeError, ValueError):
        raise ValueError(f"alltoall of {name!r}: splits must be a sequence of integers, got "
                         f"{splits!r}.") from None
    if len(values) != set_size or any(n < 0 for n in values) or sum(values) != rows:
        raise ValueError(f"alltoall of {name!r}: splits {list(values)} must have one "
                         f"non-negative entry per rank ({set_size}) summing to the first "
                         f"dimension ({rows}).")
    return values


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
@announcing(ALLREDUCE)
def allreduce_async(array, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start an allreduce of ``array`` into a new array; return a handle.

    ``op``: Average (default), Sum, Min, Max, Product or Adasum (float tensors, power-of-two
    number of ranks).  ``prescale_factor`` multiplies the input before the reduction and
    ``postscale_factor`` the result after it (Average divides by the number of ranks on top).
    Integer results are scaled in float64 and truncated toward zero.  ``process_set`` limits
    the operation to a registered subset of ranks (default: all).
    """
    reduce_op = resolve_op(op, average)
    handle = fast_host_allreduce(array, None, name, reduce_op, prescale_factor,
                                 postscale_factor, process_set)
    if handle is not None:
        return handle
    return submit(ALLREDUCE, _contiguous(array), name=name, reduce_op=reduce_op,
                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                  process_set=process_set)


@announcing(ALLREDUCE)
def allreduce_async_(array: np.ndarray, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet | None = None) -> Handle:
    """In-place variant of :func:`allreduce_async`: the result overwrites ``array``."""
    reduce_op = resolve_op(op, average)
    handle = fast_host_allreduce(array, array, name, reduce_op, prescale_factor,
                                 postscale_factor, process_set)
    if handle is not None:
        return handle
    flags = array.flags
    if flags.c_contiguous and flags.writeable:   # the common case, without extra layers
        return submit(ALLREDUCE, array, name=name, output=array, reduce_op=reduce_op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      process_set=process_set)
    _check_writable(array, "allreduce_")
    return _contiguous_in_place(array, lambda a: submit(
        ALLREDUCE, a, name=name, output=a, reduce_op=reduce_op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set))


def allreduce(array, average: bool | None = None, name: str | None = None,
              op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet | None = None) -> np.ndarray:
    """Reduce ``array`` across all ranks (default: average) and return the result."""
    return allreduce_async(array, average, name, op, prescale_factor, postscale_factor,
                           process_set).wait()


def allreduce_(array: np.ndarray, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: ProcessSet | None = None
               ) -> np.ndarray:
    """In-place allreduce; returns ``array``."""
    return allreduce_async_(array, average, name, op, prescale_factor, postscale_factor,
                            process_set).wait()


# --- allgather -------------------------------------------------------------------------------
@announcing(ALLGATHER)
def allgather_async(array, name: str | None = None,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start gathering every rank's ``array`` along the first dimension (which may differ per
    rank; the other dimensions must match).  A scalar counts as one row."""
    return submit(ALLGATHER, _contiguous(array), name=name, process_set=process_set)


def allgather(array, name: str | None = None,
              process_set: ProcessSet | None = None) -> np.ndarray:
    """Concatenation of every rank's ``array`` along dimension 0, in rank order."""
    return allgather_async(array, name, process_set).wait()


# --- broadcast -------------------------------------------------------------------------------
@announcing(BROADCAST)
def broadcast_async(array, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = None) -> Handle:
    """Start broadcasting ``root_rank``'s ``array`` into a new array on every rank.
    ``root_rank`` is a global rank (a member of ``process_set``)."""
    return submit(BROADCAST, _contiguous(array), name=name, root_rank=root_rank,
                  process_set=process_set)


@announcing(BROADCAST)
def broadcast_async_(array: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Handle:
    """In-place broadcast: ``array`` is overwritten with the root's values on other ranks."""
    _check_writable(array, "broadcast_")
    return _contiguous_in_place(array, lambda a: submit(
        BROADCAST, a, name=name, output=a, root_rank=root_rank, process_set=process_set))


def broadcast(array, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> np.ndarray:
    """Return ``root_rank``'s ``array`` on every rank."""
    return broadcast_async(array, root_rank, name, process_set).wait()


def broadcast_(array: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None) -> np.ndarray:
    """In-place broadcast; returns ``array``."""
    return broadcast_async_(array, root_rank, name, process_set).wait()


# --- alltoall --------------------------------------------------------------------------------
@announcing(ALLTOALL)
def alltoall_async(array, splits=None, name: str | None = None,
                   process_set: ProcessSet | None = None) -> Handle:
    """Start an alltoall: rows ``splits[j]`` of ``array`` (along dimension 0, in order) go to
    rank j.  Without ``splits`` the rows are divided evenly (the first dimension must then be
    divisible by the number of ranks).  The handle yields ``(received, received_splits)``:
    the rows received from every rank, in rank order, and how many came from each."""
    return submit(ALLTOALL, _contiguous(array), name=name, splits=splits,
                  process_set=process_set)


def alltoall(array, splits=None, name: str | None = None,
             process_set: ProcessSet | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Blocking :func:`alltoall_async`; returns ``(received, received_splits)``."""
    return alltoall_async(array, splits, name, process_set).wait()


# --- reducescatter ---------------------------------------------------------------------------
@announcing(REDUCESCATTER)
def reducescatter_async(array, name: str | None = None, op: ReduceOp | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet | None = None) -> Handle:
    """Start a reducescatter: ``array`` (same shape on every rank) is reduced across ranks
    (Average by default, or Sum/Min/Max/Product) and rank r receives its share of the rows.
    Rows are divided as evenly as possible: with R rows and N ranks, the first R % N ranks get
    R // N + 1 rows and the others R // N (Horovod's rule)."""
    return submit(REDUCESCATTER, _contiguous(array), name=name, reduce_op=resolve_op(op),
                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                  process_set=process_set)


def reducescatter(array, name: str | None = None, op: ReduceOp | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet | None = None) -> np.ndarray:
    """This rank's rows of the reduced ``array``; see :func:`reducescatter_async`."""
    return reducescatter_async(array, name, op, prescale_factor, postscale_factor,
                               process_set).wait()


# --- barrier, join and handles ---------------------------------------------------------------
def barrier(process_set: ProcessSet | None = None) -> None:
    """Block until every rank (of ``process_set``) has called barrier()."""
    submit(BARRIER, None, name="barrier", process_set=process_set).wait()


# Called with the process set (None: global) each time join() has returned on this rank.
_join_listeners: list[Callable[[ProcessSet | None], None]] = []


def on_join(listener: Callable[[ProcessSet | None], None]) -> None:
    """Have ``listener(process_set)`` called after every successful :func:`join` on this rank
    (for adapters whose objects keep state agreed while a rank was joined).  It runs at the same
    point of the program on every rank of the set, so it must not start collectives of its own
    unless every rank's listeners start the same ones."""
    _join_listeners.append(listener)


def join(process_set: ProcessSet | None = None) -> int:
    """Declare that this rank has run out of data; block until every rank has joined.

    Until then this rank takes part in the other ranks' allreduces with the reduction's
    identity (zeros for Sum and Average, so Average still divides by the full number of
    ranks, as in Horovod).  Other operations (allgather, broadcast, alltoall, reducescatter,
    Adasum) cannot run while a rank is joined and fail with an error saying so.  Returns the
    global rank of the last rank to join.  A rank that joined early missed the other ranks'
    later updates: broadcast the model from the returned rank before training on.
    """
    last = submit(JOIN, None, name="join", process_set=process_set).wait()
    for listener in list(_join_listeners):
        listener(process_set)
    return last


def poll(handle: Handle) -> bool:
    """True if the asynchronous operation behind ``handle`` has finished."""
    return handle.poll()


def synchronize(handle: Handle):
    """Wait for ``handle`` and return its result (raises the operation's error, if any)."""
    if not isinstance(handle, (Handle, GroupHandle)):
        raise HvdliteError(f"synchronize() expects a handle returned by an *_async call, "
                           f"got {type(handle).__name__}.")
    return handle.wait()
