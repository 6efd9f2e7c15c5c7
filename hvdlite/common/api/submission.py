"""Submitting one collective to the engine: local checks, the entry, the fast paths.

:func:`submit` is what the public operations (:mod:`hvdlite.common.api.ops`) and the framework
adapters call with contiguous numpy (or CuPy) views of their tensors.  :func:`make_entry` is the
entry builder: it checks an operation locally and builds its engine entry.  The fast paths are
thin specializations of it for allreduces whose dtype and op it validated before (every gradient
of every step takes one): :func:`host_allreduce_entry` builds the entry make_entry would build,
without the checks (for :func:`fast_host_allreduce`, one tensor, and
:func:`fast_host_allreduce_group`, a group's members); :class:`GroupTemplate` reuses a named
group's entries from one step to the next; :class:`PreparedAllreduce` reuses the request
make_entry built for a bucket's flat buffer.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from hvdlite.common.api.announce import announce_name, auto_name
from hvdlite.common.dtypes import check_reduce_op, dtype_info
from hvdlite.common.engine.handle import Entry, Handle
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST,
                                            JOIN, REDUCESCATTER, Request)
from hvdlite.common.errors import UnsupportedOperationError
from hvdlite.common.memory import result_empty
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime import registry, state
from hvdlite.common.runtime.process_sets import ProcessSet, global_process_set


def contiguous(x) -> np.ndarray:
    """``x`` as a C-contiguous array, copying only if needed (0-d stays 0-d, unlike
    np.ascontiguousarray)."""
    if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
        return x if x.flags.c_contiguous else x.copy()   # a CuPy array stays on its GPU
    array = np.asarray(x)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _default_allocate(shape: tuple, dtype: np.dtype) -> np.ndarray:
    return result_empty(shape, dtype)


# Host allreduces whose reduce op and numpy dtype passed make_entry's checks once: op -> dtype ->
# what their request carries (canonical dtype name, op as int).  The fast paths below need no
# dtype lookup or op check for a pair seen before; they run for every gradient of every step.
# Keyed by op first: a group looks its op up once (hashing a ReduceOp runs Python code), then
# each member's dtype.
_checked_host_allreduce: dict[ReduceOp, dict[np.dtype, tuple[str, int]]] = {}
_NONE_CHECKED: dict = {}
_new_request = tuple.__new__   # builds a Request without NamedTuple.__new__'s Python frame
# host_allreduce_entry fills the request's fields by position, in this order.
assert Request._fields == ("name", "kind", "dtype", "shape", "reduce_op", "root", "device",
                           "prescale", "postscale", "splits", "layout",
                           "cacheable", "failure")


def host_allreduce_entry(name: str, array: np.ndarray, output: np.ndarray,
                         checked: tuple[str, int], prescale_factor: float,
                         postscale_factor: float, cacheable: bool,
                         handle: Handle | None) -> Entry:
    """The entry of an allreduce of a contiguous host array on the global set whose dtype and
    op passed :func:`make_entry`'s checks before (``checked``: what its request carries for
    them, see ``_checked_host_allreduce``): what make_entry would build, without its checks.
    The one place the fast paths build an entry (every gradient of every step comes here)."""
    return Entry(_new_request(Request, (name, ALLREDUCE, checked[0], array.shape, checked[1],
                                        -1, -1, prescale_factor, postscale_factor, (), (),
                                        cacheable, "")),
                 array, output, _default_allocate, handle)


def fast_host_allreduce(array, output, name, reduce_op, prescale_factor, postscale_factor,
                        process_set) -> Handle | None:
    """Submit a named allreduce of a contiguous host array on the global set when its dtype and
    op were validated before; ``None`` if anything is unusual (the caller takes the general
    path, which also raises the errors).  ``output is array`` means in place, ``None`` a new
    result.  Same checks and entry as :func:`make_entry`, in fewer steps.  Framework adapters
    call it too, with a zero-copy numpy view of their tensor."""
    if process_set is not None or type(array) is not np.ndarray:
        return None
    checked = _checked_host_allreduce.get(reduce_op, _NONE_CHECKED).get(array.dtype)
    if (checked is None or type(name) is not str or type(prescale_factor) is not float
            or type(postscale_factor) is not float
            or (output is not None and output is not array)):   # outputs get checked there
        return None
    flags = array.flags
    if not flags.c_contiguous or (output is array and not flags.writeable):
        return None
    engine = state.engine()
    if output is None:
        output = result_empty(array.shape, array.dtype)
    return engine.submit(host_allreduce_entry(name, array, output, checked, prescale_factor,
                                              postscale_factor, True,
                                              Handle(name, engine.alive)))


def fast_host_allreduce_group(arrays, outputs, names: list[str], reduce_op, prescale_factor,
                              postscale_factor) -> list[Entry] | None:
    """The members' entries of a grouped allreduce on the global set whose members are
    contiguous host arrays of dtypes validated (with ``reduce_op``) before: what
    :func:`fast_host_allreduce` does for one tensor, for a whole group (without handles: the
    group's sink becomes theirs); ``None`` if any member is unusual (the caller takes the
    general path, which also raises the errors).  ``outputs``: None (new results), or one per
    member: the member itself (in place) or a contiguous, writable array of its dtype and
    shape."""
    if type(prescale_factor) is not float or type(postscale_factor) is not float:
        return None
    checked_dtypes = _checked_host_allreduce.get(reduce_op)
    if checked_dtypes is None:
        return None
    for array in arrays:
        if type(array) is not np.ndarray or array.dtype not in checked_dtypes \
                or not array.flags.c_contiguous:
            return None
    if outputs is not None:
        for array, output in zip(arrays, outputs):
            if output is not array and (type(output) is not np.ndarray
                                        or output.dtype != array.dtype
                                        or output.shape != array.shape
                                        or not output.flags.c_contiguous):
                return None
            if not output.flags.writeable:
                return None
    if outputs is None:
        outputs = [result_empty(array.shape, array.dtype) for array in arrays]
    entry = host_allreduce_entry
    return [entry(name, array, output, checked_dtypes[array.dtype], prescale_factor,
                  postscale_factor, False, None)
            for name, array, output in zip(names, arrays, outputs)]


class GroupTemplate:
    """A named grouped allreduce's member entries and negotiated request, kept from one
    submission to the next (a training loop submits the same group every step): when the
    members are host arrays of the same dtypes and shapes again, :meth:`refill` only hands the
    entries the new arrays instead of building and checking every member afresh.  Host members
    only: nothing holds their memory after completion, so the entries are free to reuse once
    the group has completed (the caller keeps a template out of its table while its group is
    in flight, so no two submissions share one)."""

    __slots__ = ("group", "entries", "request", "dtypes", "shapes", "in_place", "reduce_op",
                 "prescale", "postscale")

    def __init__(self, group: str, entries: list[Entry], request: Request, in_place: bool,
                 reduce_op, prescale: float, postscale: float) -> None:
        self.group = group
        self.entries = entries
        self.request = request   # the group's own request (see grouped.group_request)
        self.dtypes = [entry.array.dtype for entry in entries]
        self.shapes = [entry.array.shape for entry in entries]
        self.in_place = in_place
        self.reduce_op, self.prescale, self.postscale = reduce_op, prescale, postscale

    def release(self) -> None:
        """Forget the last submission's arrays and handle (kept until the next refill, they
        would hold a whole group's inputs and results alive between steps)."""
        for entry in self.entries:
            entry.array = entry.output = entry.handle = None

    def refill(self, arrays, outputs, reduce_op, prescale_factor,
               postscale_factor) -> list[Entry] | None:
        """The entries again, now for ``arrays`` (``outputs``: None for new results, or the
        arrays themselves for in place); None unless every member matches the template and
        passes :func:`fast_host_allreduce_group`'s checks (the caller then builds afresh)."""
        entries = self.entries
        if (reduce_op is not self.reduce_op or prescale_factor != self.prescale
                or postscale_factor != self.postscale or len(arrays) != len(entries)
                or (outputs is not None) != self.in_place):
            return None
        if self.in_place:
            for entry, array, output, dtype, shape in zip(entries, arrays, outputs,
                                                          self.dtypes, self.shapes):
                if (output is not array or type(array) is not np.ndarray or array.dtype != dtype
                        or array.shape != shape or not array.flags.c_contiguous
                        or not array.flags.writeable):
                    return None
                entry.array = entry.output = array
        else:
            for entry, array, dtype, shape in zip(entries, arrays, self.dtypes, self.shapes):
                if (type(array) is not np.ndarray or array.dtype != dtype
                        or array.shape != shape or not array.flags.c_contiguous):
                    return None
                entry.array = array
                entry.output = result_empty(shape, dtype)
        return entries


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
        name = auto_name(kind, set_id)
    try:
        # Positional: this runs for every gradient, and keyword passing costs measurably here.
        entry = make_entry(engine, members, kind, array, name, output, allocate, reduce_op,
                           root_rank, prescale_factor, postscale_factor, dtype, device, splits,
                           set_id, auto_named)
    except Exception as exc:
        if auto_named:
            announce_name(engine, members, name, exc)
        raise
    return engine.submit(entry)


def make_entry(engine, members: list[int] | None, kind: str, array: np.ndarray | None,
               name: str | None = None, output: np.ndarray | None = None,
               allocate: Callable[[tuple, np.dtype], np.ndarray] | None = None,
               reduce_op: ReduceOp = ReduceOp.Sum, root_rank: int = -1,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               dtype: str | None = None, device: int = -1, splits=None, set_id: int = 0,
               auto_named: bool = False) -> Entry:
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
            _checked_host_allreduce.setdefault(reduce_op, {})[array_dtype] = (info.name,
                                                                              int(reduce_op))
        if reduce_op == ReduceOp.Adasum:
            from hvdlite.common.data_paths.adasum import check_adasum_size
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
                      else float(postscale_factor), splits or (), cacheable=cacheable)
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
            from hvdlite.common.data_paths.nccl import nccl_reduce_check
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


def contiguous_in_place(array: np.ndarray, run: Callable[[np.ndarray], Handle]) -> Handle:
    """In-place op on a possibly non-contiguous array: work on a contiguous copy, copy back."""
    if array.flags.c_contiguous:
        return run(array)
    work = contiguous(array)

    def copy_back(result: np.ndarray) -> np.ndarray:
        array[...] = result
        return array

    return run(work).then(copy_back)


def check_writable(array: np.ndarray, what: str) -> None:
    """Refuse a read-only ``array`` for the in-place operation ``what``."""
    if not array.flags.writeable:
        raise ValueError(f"{what} needs a writable array; this one is read-only.")
