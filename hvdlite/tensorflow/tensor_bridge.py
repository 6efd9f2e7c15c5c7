"""TensorFlow tensors to the core and back: each collective's inputs go to the core as numpy
arrays (views of CPU tensors' buffers), one core op per tensor (:func:`collective_per_tensor`)
or one core group (:func:`grouped_collective`), all in one graph node; the results come back as
tensors with the static shapes the op promises."""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Iterator

import numpy as np
import tensorflow as tf

from hvdlite.common import core
from hvdlite.common.core import (ALLGATHER, ALLREDUCE, dtype_info, split_rows,
                                 TensorMismatchError)

from .graph import graph_node, node_label, set_static_shapes
from .membership import rank_in, size_of


def core_dtype(tensor, what: str) -> str | None:
    """Check that the core supports ``tensor``'s dtype (raising its UnsupportedDtypeError if
    not); return the dtype name to tell the core when the numpy view carries a stand-in
    (bfloat16), else None: the view's own dtype, which lets the core's fast submission paths
    take the array."""
    dt = tensor.dtype
    if dt == tf.bfloat16:
        return dtype_info("bfloat16", what).name
    try:
        np_dtype = dt.as_numpy_dtype
    except TypeError:
        np_dtype = dt.name
    dtype_info(np_dtype, what)
    return None


def _contiguous(array) -> np.ndarray:
    array = np.asarray(array)
    if not array.flags.c_contiguous:   # (np.ascontiguousarray would turn 0-d into 1-d)
        array = np.ascontiguousarray(array).reshape(array.shape)
    return array


def execute_each(kind: str, arrays, names, dtypes, kwargs: dict) -> list:
    """Submit every array as its own op, then wait for all; raise the first error after all
    finished."""
    handles, error = [], None
    for array, name, dtype in zip(arrays, names, dtypes):
        try:
            handles.append(core.submit(kind, _contiguous(array), name=name, dtype=dtype,
                                       **kwargs))
        except Exception as exc:  # noqa: BLE001 - re-raised below once submitted ones finished
            error = exc
            break
    results = []
    for handle in handles:
        try:
            results.append(handle.wait())
        except Exception as exc:  # noqa: BLE001
            if error is None:
                error = exc
    if error is not None:
        raise error
    return results


def _execute_group(kind: str, arrays, name, dtypes, kwargs: dict) -> list:
    """Submit the arrays as one core group (negotiated and executed as a unit) and wait."""
    return core.submit_group(kind, [_contiguous(a) for a in arrays], name=name,
                                     dtypes=list(dtypes), **kwargs).wait()


def gathered_shape(t) -> tf.TensorShape | None:
    """Static shape of an allgather/alltoall output: first dimension unknown."""
    if t.shape.rank is None:
        return None
    return tf.TensorShape([None] + (t.shape.as_list()[1:] if t.shape.rank else []))


def scattered_shape(t, members) -> tf.TensorShape | None:
    """Static shape of this rank's reducescatter output."""
    if t.shape.rank is None or t.shape.rank == 0:
        return None
    dims = t.shape.as_list()
    rows = dims[0]
    if rows is not None:
        rows = split_rows(rows, size_of(members))[rank_in(members)]
    return tf.TensorShape([rows] + dims[1:])


def collective_per_tensor(kind: str, tensors: list, names: list, kwargs: dict,
                          process_set=None, chained: bool = True) -> list:
    """One ``kind`` op per tensor (submitted together, waited together, one graph node)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    dtypes = [core_dtype(t, f"{kind} of {n or 'unnamed tensor'}")
              for t, n in zip(tensors, names)]
    kwargs = dict(kwargs, process_set=process_set)

    def fn(*arrays):
        return execute_each(kind, arrays, names, dtypes, kwargs)

    outs = graph_node(node_label(kind, names[0]), fn, tensors, [t.dtype for t in tensors], chained)
    set_static_shapes(outs, [gathered_shape(t) if kind == ALLGATHER else t.shape for t in tensors])
    return outs


def grouped_collective(kind: str, tensors: list, name, kwargs: dict, process_set=None,
                       shapes=None, mismatch_hint: str | None = None) -> list:
    """One grouped ``kind`` op over ``tensors`` (one graph node).  ``mismatch_hint`` is added
    to the message of a TensorMismatchError (what this rank knows about the likely cause)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    dtypes = [core_dtype(t, f"grouped {kind} of {name or 'unnamed tensors'}.{i}")
              for i, t in enumerate(tensors)]
    kwargs = dict(kwargs, process_set=process_set)
    small = _flat_members(tensors, dtypes) if kind == ALLREDUCE else []
    if small:
        return _flat_group(tensors, small, name, kwargs, mismatch_hint)

    def fn(*arrays):
        with _hinted(mismatch_hint):
            return _execute_group(kind, arrays, name, dtypes, kwargs)

    outs = graph_node(node_label(f"grouped_{kind}", name), fn, tensors, [t.dtype for t in tensors])
    set_static_shapes(outs, shapes if shapes is not None else [t.shape for t in tensors])
    return outs


@contextlib.contextmanager
def _hinted(mismatch_hint: str | None) -> Iterator[None]:
    """Add ``mismatch_hint`` to the message of a TensorMismatchError raised inside."""
    try:
        yield
    except TensorMismatchError as exc:
        if mismatch_hint is None:
            raise
        raise TensorMismatchError(f"{exc}\n{mismatch_hint}") from exc


# Members up to this size reach a grouped allreduce's graph node concatenated into one flat
# tensor; larger ones as inputs of their own.  A node costs about 10 us per input and output,
# the concatenation a copy of the bytes: flat, 200 members of 16 KiB took 3.1 ms against 4.1
# ms one input each, 64 KiB members broke even, and 20 of 1 MiB took 8.2-8.6 ms against 6.0.
FLAT_MEMBER_BYTES = 32 * 1024


def _flat_members(tensors: list, dtypes: list) -> list[int]:
    """The members of a grouped allreduce in a graph that travel concatenated (empty if fewer
    than two would): those of the first member's numpy-native dtype, with fully known shapes
    and at most FLAT_MEMBER_BYTES."""
    if tf.executing_eagerly() or len(tensors) < 2 or any(dtypes):
        return []
    dtype = tensors[0].dtype
    small = [i for i, t in enumerate(tensors)
             if t.dtype == dtype and t.shape.is_fully_defined()
             and t.shape.num_elements() * dtype.size <= FLAT_MEMBER_BYTES]
    return small if len(small) >= 2 else []


def _flat_group(tensors: list, small: list[int], name, kwargs: dict,
                mismatch_hint: str | None) -> list:
    """A grouped allreduce as one graph node whose ``small`` members arrive concatenated into
    one flat tensor (and leave as one), the others one input and output each.  The core
    reduces the same group of members as ever (views of the flat input into views of one flat
    result), so names, shapes and errors are those of the member-by-member node."""
    small_set = set(small)
    large = [i for i in range(len(tensors)) if i not in small_set]
    shapes = [tuple(tensors[i].shape.as_list()) for i in small]
    sizes = [math.prod(shape) for shape in shapes]
    starts = list(itertools.accumulate(sizes, initial=0))
    dtype = tensors[small[0]].dtype

    def fn(flat, *large_arrays):
        flat = _contiguous(flat)
        result = core.result_empty((starts[-1],), flat.dtype)
        members: list = [None] * len(tensors)
        outputs: list = [None] * len(tensors)
        for i, a, b, shape in zip(small, starts, starts[1:], shapes):
            members[i], outputs[i] = flat[a:b].reshape(shape), result[a:b].reshape(shape)
        large_results = []
        for i, array in zip(large, large_arrays):
            members[i] = _contiguous(array)
            outputs[i] = core.result_empty(array.shape, array.dtype)
            large_results.append(outputs[i])
        with _hinted(mismatch_hint):
            core.submit_group(ALLREDUCE, members, name=name, outputs=outputs, **kwargs).wait()
        return [result] + large_results

    flat_in = tf.concat([tf.reshape(tensors[i], [-1]) for i in small], 0)
    outs = graph_node(node_label("grouped_allreduce", name), fn,
                      [flat_in] + [tensors[i] for i in large],
                      [dtype] + [tensors[i].dtype for i in large])
    flat_out, large_outs = outs[0], outs[1:]
    flat_out.set_shape([starts[-1]])
    set_static_shapes(large_outs, [tensors[i].shape for i in large])
    reduced: list = [None] * len(tensors)
    for i, part, shape in zip(small, tf.split(flat_out, sizes), shapes):
        reduced[i] = tf.reshape(part, shape)
    for i, out in zip(large, large_outs):
        reduced[i] = out
    return reduced
