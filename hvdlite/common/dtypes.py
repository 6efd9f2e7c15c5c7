"""Which dtypes hvdlite moves and reduces, and how they map onto MPI.

MPI has no float16 or bfloat16, so those travel as 16-bit words and are reduced by a user-defined
MPI op that does the arithmetic with numpy (bfloat16 arithmetic comes from ``ml_dtypes``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from hvdlite.common.errors import UnsupportedDtypeError
from hvdlite.common.reduce_ops import ReduceOp


@dataclasses.dataclass(frozen=True)
class DtypeInfo:
    name: str                      # canonical name shared by every rank ("float32", "bfloat16")
    np_dtype: np.dtype             # dtype used for arithmetic and views
    mpi_name: str                  # attribute of mpi4py.MPI used for transport
    custom_reduce: bool = False    # reduced by a numpy-backed user op (no MPI type has it)
    is_bool: bool = False

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @property
    def is_integer(self) -> bool:
        return self.np_dtype.kind in "iu"


def _bfloat16() -> np.dtype:
    import ml_dtypes  # a dependency of hvdlite; imported lazily to keep startup fast
    return np.dtype(ml_dtypes.bfloat16)


_FIXED = {
    "bool": ("C_BOOL", False, True),
    "uint8": ("UINT8_T", False, False),
    "int8": ("INT8_T", False, False),
    "uint16": ("UINT16_T", False, False),
    "int16": ("INT16_T", False, False),
    "uint32": ("UINT32_T", False, False),
    "int32": ("INT32_T", False, False),
    "uint64": ("UINT64_T", False, False),
    "int64": ("INT64_T", False, False),
    "float16": ("UINT16_T", True, False),
    "bfloat16": ("UINT16_T", True, False),
    "float32": ("FLOAT", False, False),
    "float64": ("DOUBLE", False, False),
}

SUPPORTED_DTYPES = tuple(_FIXED)


@functools.lru_cache(maxsize=None)
def _info_by_name(name: str) -> DtypeInfo:
    mpi_name, custom, is_bool = _FIXED[name]
    np_dtype = _bfloat16() if name == "bfloat16" else np.dtype(name)
    return DtypeInfo(name, np_dtype, mpi_name, custom, is_bool)


_by_dtype: dict = {}


def dtype_info(dtype, what: str = "tensor") -> DtypeInfo:
    """Look up a numpy dtype (or a canonical name); raise a clear error if unsupported."""
    info = _by_dtype.get(dtype)
    if info is not None:
        return info
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _FIXED:
        raise UnsupportedDtypeError(
            f"hvdlite does not support dtype {name!r} for {what}. Supported dtypes: "
            f"{', '.join(SUPPORTED_DTYPES)}. Cast the tensor (e.g. complex -> two real tensors, "
            f"object/str -> use broadcast_object/allgather_object).")
    info = _info_by_name(name)
    _by_dtype[dtype] = info
    return info


def check_reduce_op(info: DtypeInfo, op: ReduceOp, name: str) -> None:
    """Raise before submission if ``op`` is meaningless for this dtype."""
    if op == ReduceOp.Adasum and info.np_dtype.kind != "f" and info.name != "bfloat16":
        raise UnsupportedDtypeError(
            f"allreduce of {name!r}: op=Adasum combines floating-point gradients; {info.name} "
            f"is not supported. Use Sum/Average for this tensor or cast it to a float dtype.")
    if info.is_bool and op == ReduceOp.Average:
        raise UnsupportedDtypeError(
            f"allreduce of {name!r}: Average is not defined for bool tensors; use op=Sum or Max "
            f"(logical or) or Min/Product (logical and), or cast to an integer dtype.")


_NATIVE_OPS = {
    ReduceOp.Average: "SUM", ReduceOp.Sum: "SUM", ReduceOp.Min: "MIN",
    ReduceOp.Max: "MAX", ReduceOp.Product: "PROD",
}
_BOOL_OPS = {
    ReduceOp.Sum: "LOR", ReduceOp.Max: "LOR", ReduceOp.Min: "LAND", ReduceOp.Product: "LAND",
}
_NUMPY_UFUNCS: dict[ReduceOp, Callable] = {
    ReduceOp.Average: np.add, ReduceOp.Sum: np.add, ReduceOp.Min: np.minimum,
    ReduceOp.Max: np.maximum, ReduceOp.Product: np.multiply,
}


_BOOL_UFUNCS: dict[ReduceOp, Callable] = {
    ReduceOp.Sum: np.logical_or, ReduceOp.Max: np.logical_or,
    ReduceOp.Min: np.logical_and, ReduceOp.Product: np.logical_and,
}


def numpy_reduce_ufunc(info: DtypeInfo, op: ReduceOp) -> Callable:
    """The numpy ufunc that combines two buffers as ``mpi_reduce_op(info, op)`` does (Average
    sums; bool reductions are logical or/and)."""
    return (_BOOL_UFUNCS if info.is_bool else _NUMPY_UFUNCS)[op]


def mpi_datatype(info: DtypeInfo):
    from mpi4py import MPI
    return getattr(MPI, info.mpi_name)


@functools.lru_cache(maxsize=None)
def mpi_reduce_op(info: DtypeInfo, op: ReduceOp):
    """The MPI.Op that performs ``op`` on buffers of ``info``'s dtype."""
    from mpi4py import MPI
    if info.is_bool:
        return getattr(MPI, _BOOL_OPS[op])
    if not info.custom_reduce:
        return getattr(MPI, _NATIVE_OPS[op])
    ufunc, np_dtype = numpy_reduce_ufunc(info, op), info.np_dtype

    def reduce_words(inbuf, inoutbuf, _datatype):
        a = np.frombuffer(inbuf, dtype=np_dtype)
        b = np.frombuffer(inoutbuf, dtype=np_dtype)
        ufunc(a, b, out=b)

    return MPI.Op.Create(reduce_words, commute=True)


def scale_in_place(array: np.ndarray, factor: float) -> None:
    """Multiply by ``factor`` in place, as Horovod does: integers are scaled in float64 and
    truncated toward zero, 16-bit floats are scaled in float32."""
    scale_into(array, array, factor)


def scale_into(out: np.ndarray, array: np.ndarray, factor: float) -> None:
    """``out = array * factor`` with :func:`scale_in_place`'s rules; a plain copy when the
    factor is 1 (so a copy that must also scale costs one pass, not two)."""
    if factor == 1.0 or array.size == 0:
        if out is not array:
            np.copyto(out, array)
        return
    kind = array.dtype.kind
    if kind in "iu":
        np.multiply(array, np.float64(factor), out=out, casting="unsafe")
    elif array.dtype.itemsize >= 4:
        np.multiply(array, array.dtype.type(factor), out=out)
    else:
        np.multiply(array, np.float32(factor), out=out, casting="unsafe")


def reduction_identity(info: DtypeInfo, op: ReduceOp, shape: tuple) -> np.ndarray:
    """An array that leaves ``op`` unchanged: what a joined rank contributes (zeros for Sum and
    Average, as in Horovod; the dtype's top/bottom for Min/Max; ones for Product)."""
    dtype = info.np_dtype
    if info.is_bool:
        fill = op in (ReduceOp.Min, ReduceOp.Product)          # logical and: True is neutral
    elif op == ReduceOp.Product:
        fill = 1
    elif op in (ReduceOp.Min, ReduceOp.Max):
        top = op == ReduceOp.Min
        if dtype.kind in "iu":
            limits = np.iinfo(dtype)
            fill = limits.max if top else limits.min
        else:
            fill = np.inf if top else -np.inf
    else:
        fill = 0
    return np.full(shape, fill, dtype=dtype)
