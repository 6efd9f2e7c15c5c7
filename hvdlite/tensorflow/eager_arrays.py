"""Eager tensors to numpy and back without copying where TensorFlow allows it.

* **In.**  ``EagerTensor.numpy()`` copies its buffer (TensorFlow's own ``numpy()`` returns a
  copy of ``_numpy()``, a view): 16 ms for a 64 MiB tensor on the reference VM.  The core only
  reads a collective's inputs, so it gets the view.
* **Out.**  ``tf.convert_to_tensor`` copies a numpy result (24 ms for 64 MiB, 17-20 us for
  4 KiB).  A result whose data starts on a 64-byte boundary (Eigen's alignment, which
  TensorFlow's kernels check and abort the process on) is adopted through DLPack instead:
  the tensor keeps the array alive and shares its memory (2 us for any size).  The core
  allocates results of 64 KiB and more aligned (:mod:`hvdlite.common.memory`); smaller ones are
  adopted when they happen to be aligned, else copied.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

ALIGNMENT = 64   # Eigen's EIGEN_MAX_ALIGN_BYTES, which TensorFlow's CPU kernels assume

# Numpy dtypes both numpy's DLPack export and TensorFlow's import handle (bool, bfloat16 and
# complex go through tf.convert_to_tensor).
_DLPACK_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8,
                                                 np.int16, np.int32, np.int64, np.uint8,
                                                 np.uint16, np.uint32, np.uint64))
try:
    _from_dlpack = tf.experimental.dlpack.from_dlpack
except AttributeError:   # (a TensorFlow without DLPack: every result is copied)
    _from_dlpack = None


def host_array(tensor) -> np.ndarray:
    """A numpy array with ``tensor``'s values, sharing a CPU tensor's memory (read only by
    the caller)."""
    view = getattr(tensor, "_numpy", None)
    array = view() if view is not None else tensor.numpy()
    return np.asarray(array)


def as_tensor(array, dtype: tf.DType):
    """``array`` as an eager tensor of ``dtype``: the same memory if TensorFlow can adopt it,
    else a copy."""
    array = np.asarray(array)
    if (_from_dlpack is not None and array.dtype in _DLPACK_DTYPES
            and array.dtype == dtype.as_numpy_dtype and array.flags.c_contiguous
            and array.flags.writeable
            and array.__array_interface__["data"][0] % ALIGNMENT == 0):
        return _from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array, dtype=dtype)
