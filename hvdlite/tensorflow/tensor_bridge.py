"""TensorFlow tensors to the core and back: each collective's inputs go to the core as numpy
arrays (views of CPU tensors' buffers), one core op per tensor
(:func:`_collective`) or one core group (:func:`_group`), all in one graph node; the results come
back as tensors with the static shapes the op promises."""
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

from .graph import _label, _node, _set_shapes
from .membership import _set_rank, _set_size


def _core_dtype(tensor, what: str) -> str | None:
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


def _execute(kind: str, arrays, names, dtypes, kwargs: dict) -> list:
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


def _gathered_shape(t) -> tf.TensorShape | None:
    """Static shape of an allgather/alltoall output: first dimension unknown."""
    if t.shape.rank is None:
        return None
    return tf.TensorShape([None] + (t.shape.as_list()[1:] if t.shape.rank else []))


def _scattered_shape(t, members) -> tf.TensorShape | None:
    """Static shape of this rank's reducescatter output."""
    if t.shape.rank is None or t.shape.rank == 0:
        return None
    dims = t.shape.as_list()
    rows = dims[0]
    if rows is not None:
        rows = split_rows(rows, _set_size(members))[_set_rank(members)]
    return tf.TensorShape([rows] + dims[1:])


def _collective(kind: str, tensors: list, names: list, kwargs: dict,
                process_set=None, chained: bool = True) -> list:
    """One ``kind`` op per tensor (submitted together, waited together, one graph node)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    dtypes = [_core_dtype(t, f"{kind} of {n or 'unnamed tensor'}")
              for t, n in zip(tensors, names)]
    kwargs = dict(kwargs, process_set=process_set)

    def fn(*arrays):
        return _execute(kind, arrays, names, dtypes, kwargs)

    outs = _node(_label(kind, names[0]), fn, tensors, [t.dtype for t in tensors], chained)
    _set_shapes(outs, [_gathered_shape(t) if kind == ALLGATHER else t.shape for t in tensors])
    return outs


def _group(kind: str, tensors: list, name, kwargs: dict, process_set=None,
           shapes=None, mismatch_hint: str | None = None) -> list:
    """One grouped ``kind`` op over ``tensors`` (one graph node).  ``mismatch_hint`` is added
    to the message of a TensorMismatchError (what this rank knows about the likely cause)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    dtypes = [_core_dtype(t, f"grouped {kind} of {name or 'unnamed tensors'}.{i}")
              for i, t in enumerate(tensors)]
    kwargs = dict(kwargs, process_set=process_set)
    if kind == ALLREDUCE and _travels_flat(tensors, dtypes):
        return _flat_group(tensors, name, kwargs, mismatch_hint)

    def fn(*arrays):
        with _hinted(mismatch_hint):
            return _execute_group(kind, arrays, name, dtypes, kwargs)

    outs = _node(_label(f"grouped_{kind}", name), fn, tensors, [t.dtype for t in tensors])
    _set_shapes(outs, shapes if shapes is not None else [t.shape for t in tensors])
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


def _travels_flat(tensors: list, dtypes: list) -> bool:
    """Whether a grouped allreduce in a graph can reach its node as one flat tensor: two or
    more members of one numpy-native dtype and fully known shapes.  A node's cost grows with
    its inputs and outputs (about 10 us each: one node of 200 inputs and outputs took 2.4-2.6
    ms in a model-like function, the same values concatenated before it and split after it
    1.8-2.2 ms)."""
    if tf.executing_eagerly() or len(tensors) < 2 or any(dtypes):
        return False
    dtype = tensors[0].dtype
    return all(t.dtype == dtype and t.shape.is_fully_defined() for t in tensors)


def _flat_group(tensors: list, name, kwargs: dict, mismatch_hint: str | None) -> list:
    """A grouped allreduce as one graph node with one input and one output: the members are
    concatenated (TensorFlow), reduced by the core as the same group of members (views of
    the flat input into views of one flat result: the same names, shapes and errors as
    member-by-member), and split again."""
    shapes = [tuple(t.shape.as_list()) for t in tensors]
    sizes = [math.prod(shape) for shape in shapes]
    starts = list(itertools.accumulate(sizes, initial=0))
    dtype = tensors[0].dtype

    def fn(flat):
        flat = _contiguous(flat)
        result = core.result_empty((starts[-1],), flat.dtype)
        members = [flat[a:b].reshape(shape) for a, b, shape in zip(starts, starts[1:], shapes)]
        outputs = [result[a:b].reshape(shape)
                   for a, b, shape in zip(starts, starts[1:], shapes)]
        with _hinted(mismatch_hint):
            core.submit_group(ALLREDUCE, members, name=name, outputs=outputs, **kwargs).wait()
        return [result]

    flat_in = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
    (flat_out,) = _node(_label("grouped_allreduce", name), fn, [flat_in], [dtype])
    flat_out.set_shape([starts[-1]])
    return [tf.reshape(part, shape)
            for part, shape in zip(tf.split(flat_out, sizes), shapes)]
