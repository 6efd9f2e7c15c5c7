"""Independent numpy references and comparison helpers for the core worker scripts.

References follow the documented semantics, not hvdlite's code: reductions are computed here with
numpy over every rank's (locally regenerated) input.  Integers and bool are compared exactly;
floats are compared exactly where the inputs make the result exactly representable whatever
order MPI reduces in, otherwise within a bound of a few roundings of the dtype.
"""
from __future__ import annotations

import hashlib

import numpy as np

from tests.workers.core_cases import FLOAT_DTYPES, np_dtype


def eps_of(dtype: str) -> float:
    if dtype == "bfloat16":
        import ml_dtypes
        return float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
    return float(np.finfo(np.dtype(dtype)).eps)


def int_scale(a: np.ndarray, factor: float) -> np.ndarray:
    """Documented integer scaling: multiply in float64, truncate toward zero, same dtype."""
    a = np.array(a, copy=True)
    if factor != 1.0 and a.size:
        np.multiply(a, np.float64(factor), out=a, casting="unsafe")
    return a


class Expected:
    """What an allreduce must produce: ``exact`` (array in the dtype) or ``ref64`` +- ``tol``."""

    def __init__(self, dtype: str, exact=None, ref64=None, tol=None):
        self.dtype = dtype
        self.exact = exact
        self.ref64 = ref64
        self.tol = tol

    @property
    def shape(self):
        return (self.exact if self.exact is not None else self.ref64).shape


def allreduce_expected(inputs: list[np.ndarray], dtype: str, op: str, size: int,
                       pre: float = 1.0, post: float = 1.0,
                       exact_inputs: bool = True) -> Expected:
    dt = np_dtype(dtype)
    stack = np.stack([np.asarray(x, dtype=dt) for x in inputs])
    if dtype == "bool":
        assert op != "Average" and pre == 1.0 and post == 1.0
        fn = np.logical_or if op in ("Sum", "Max") else np.logical_and
        return Expected(dtype, exact=fn.reduce(stack, axis=0).astype(bool))
    post_factor = post * (1.0 / size) if op == "Average" else post
    if dtype not in FLOAT_DTYPES:
        scaled = np.stack([int_scale(x, pre) for x in stack])
        if op in ("Sum", "Average"):
            red = np.add.reduce(scaled, axis=0, dtype=dt)
        elif op == "Min":
            red = np.minimum.reduce(scaled, axis=0)
        elif op == "Max":
            red = np.maximum.reduce(scaled, axis=0)
        else:
            red = np.multiply.reduce(scaled, axis=0, dtype=dt)
        return Expected(dtype, exact=int_scale(np.asarray(red, dtype=dt), post_factor))
    s64 = stack.astype(np.float64) * pre
    if op in ("Sum", "Average"):
        ref = s64.sum(axis=0)
        scale = np.abs(s64).sum(axis=0)
    elif op == "Min":
        ref = s64.min(axis=0)
        scale = np.abs(ref)
    elif op == "Max":
        ref = s64.max(axis=0)
        scale = np.abs(ref)
    else:
        ref = s64.prod(axis=0)
        scale = np.abs(ref)
    ref = ref * post_factor
    scale = scale * abs(post_factor)
    if exact_inputs and pre == 1.0 and post_factor == 1.0:
        exact = ref.astype(dt)
        assert np.array_equal(exact.astype(np.float64), ref), "test inputs not exact in dtype"
        return Expected(dtype, exact=exact)
    # a handful of roundings (prescale, size-1 combines, postscale), each <= eps/2 relative
    tol = 4 * eps_of(dtype) * scale + 1e-300
    return Expected(dtype, ref64=ref, tol=tol)


def check_array(label: str, got, expected: Expected) -> None:
    """Assert ``got`` has the expected dtype, shape and values."""
    if isinstance(got, BaseException):
        raise AssertionError(f"{label}: raised {type(got).__name__}: {got}")
    assert isinstance(got, np.ndarray), f"{label}: result is {type(got).__name__}, not ndarray"
    want_dt = np_dtype(expected.dtype)
    assert got.dtype == want_dt, f"{label}: dtype {got.dtype} != {want_dt}"
    shape = expected.shape
    assert got.shape == shape, f"{label}: shape {got.shape} != {shape}"
    got = got.reshape(shape)
    if expected.exact is not None:
        if not np.array_equal(got, expected.exact):
            raise AssertionError(f"{label}: got {got!r}\nexpected {expected.exact!r}")
        return
    g64 = got.astype(np.float64)
    err = np.abs(g64 - expected.ref64)
    bad = ~(err <= expected.tol)
    if bad.any():
        i = np.argwhere(bad.reshape(-1))[0][0]
        raise AssertionError(
            f"{label}: {int(bad.sum())} elements off; first at flat index {i}: got "
            f"{g64.reshape(-1)[i]!r}, expected {expected.ref64.reshape(-1)[i]!r} "
            f"(tol {expected.tol.reshape(-1)[i]!r})")


def check_exact(label: str, got, want: np.ndarray) -> None:
    check_array(label, got, Expected(_dtype_name(want.dtype), exact=want))


def _dtype_name(dt: np.dtype) -> str:
    return "bfloat16" if dt.name == "bfloat16" else dt.name


def digest(arr) -> str:
    if not isinstance(arr, np.ndarray):
        return f"<{type(arr).__name__}>"
    return hashlib.sha1(np.ascontiguousarray(arr).tobytes() + str(arr.dtype).encode()).hexdigest()


def attempt(fn):
    """Run a collective and return its result or the exception (checks happen after every
    rank issued all of a case's collectives, so a failed check cannot desynchronize ranks)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return exc


def noncontiguous(x: np.ndarray):
    """A non-C-contiguous array with x's values (and the base it lives in), or None."""
    if x.ndim == 0 or x.size == 0:
        return None
    if x.ndim == 1:
        base = np.zeros(2 * x.shape[0], dtype=x.dtype)
        base[::2] = x
        view = base[::2]
    else:
        base = np.asfortranarray(x)
        view = base
    return (view, base) if not view.flags.c_contiguous else None
