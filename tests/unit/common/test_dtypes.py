"""dtypes.dtype_info / check_reduce_op / scale_in_place and reduce_ops.resolve_op (pure logic)."""
import ml_dtypes
import numpy as np
import pytest

from hvdlite.common.dtypes import (SUPPORTED_DTYPES, check_reduce_op, dtype_info,
                                   scale_in_place, scale_into)
from hvdlite.common.errors import HvdliteError, UnsupportedDtypeError
from hvdlite.common.reduce_ops import ReduceOp, resolve_op

ALL = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
       "float16", "bfloat16", "float32", "float64"]
BF16 = np.dtype(ml_dtypes.bfloat16)


def npdt(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def test_supported_list():
    assert sorted(SUPPORTED_DTYPES) == sorted(ALL)


@pytest.mark.parametrize("name", ALL)
def test_dtype_info_every_supported(name):
    dt = npdt(name)
    for spelling in (dt, name, dt.type):
        info = dtype_info(spelling)
        assert info.name == name
        assert info.np_dtype == dt
        assert info.itemsize == dt.itemsize
    info = dtype_info(dt)
    assert info.is_bool == (name == "bool")
    assert info.is_integer == (name in ("uint8", "int8", "uint16", "int16", "uint32", "int32",
                                        "uint64", "int64"))
    assert info.custom_reduce == (name in ("float16", "bfloat16"))


@pytest.mark.parametrize("dt", [np.complex64, np.complex128, object, "U3", "S2", np.longdouble,
                                "datetime64[s]", np.dtype([("a", np.int32)])])
def test_dtype_info_unsupported(dt):
    if np.dtype(dt).name == "float64":   # platforms where longdouble is double
        pytest.skip("longdouble is float64 here")
    with pytest.raises(UnsupportedDtypeError) as info:
        dtype_info(np.dtype(dt), "allreduce of 'x'")
    err = info.value
    assert isinstance(err, HvdliteError) and isinstance(err, TypeError)
    msg = str(err)
    assert "allreduce of 'x'" in msg
    assert "float32" in msg and "bfloat16" in msg, "the message lists what is supported"


def test_unknown_dtype_name_unsupported():
    with pytest.raises(UnsupportedDtypeError):
        dtype_info("complex64")


# --- check_reduce_op -----------------------------------------------------------------------------
FLOATS = ("float16", "bfloat16", "float32", "float64")


@pytest.mark.parametrize("name", [n for n in ALL if n not in FLOATS])
def test_adasum_rejected_for_non_float_dtypes(name):
    with pytest.raises(UnsupportedDtypeError) as info:
        check_reduce_op(dtype_info(name), ReduceOp.Adasum, "grad")
    assert "grad" in str(info.value) and "Adasum" in str(info.value) and name in str(info.value)


@pytest.mark.parametrize("name", FLOATS)
def test_adasum_accepted_for_float_dtypes(name):
    check_reduce_op(dtype_info(name), ReduceOp.Adasum, "grad")


def test_bool_average_rejected():
    with pytest.raises(UnsupportedDtypeError) as info:
        check_reduce_op(dtype_info("bool"), ReduceOp.Average, "flags")
    assert "flags" in str(info.value)


@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product])
def test_bool_other_ops_allowed(op):
    check_reduce_op(dtype_info("bool"), op, "flags")


@pytest.mark.parametrize("name", [n for n in ALL if n != "bool"])
@pytest.mark.parametrize("op", [ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max,
                                ReduceOp.Product])
def test_numeric_ops_allowed(name, op):
    check_reduce_op(dtype_info(name), op, "t")


# --- scale_in_place ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["int8", "int16", "int32", "int64"])
def test_signed_int_scaling_truncates_toward_zero(name):
    a = np.array([5, -5, 7, -7, 1, -1, 0], dtype=name)
    assert scale_in_place(a, 0.5) is None
    assert a.dtype == np.dtype(name)
    assert a.tolist() == [2, -2, 3, -3, 0, 0, 0]


@pytest.mark.parametrize("name", ["uint8", "uint16", "uint32", "uint64"])
def test_unsigned_int_scaling_truncates(name):
    a = np.array([5, 7, 9, 100], dtype=name)
    scale_in_place(a, 1.0 / 3.0)
    assert a.tolist() == [1, 2, 3, 33]


def test_int_scaling_is_done_in_float64():
    # 3 * (1/3) is exactly 1.0 in float64 (the average of 3 ranks must not give 0)
    a = np.array([3, 6, 9, -3, 300000000], dtype=np.int64)
    scale_in_place(a, 1.0 / 3.0)
    assert a.tolist() == [1, 2, 3, -1, 100000000]
    b = np.array([2 ** 40 + 1], dtype=np.int64)
    scale_in_place(b, 2.0)
    assert b.tolist() == [2 ** 41 + 2]


def test_int_scaling_reference_semantics_random():
    rng = np.random.default_rng(0)
    for name in ("int8", "uint8", "int32", "uint32", "int64"):
        info = np.iinfo(name)
        a = rng.integers(max(info.min, -1000), min(info.max, 1000), 200).astype(name)
        for f in (0.1, 0.5, 1 / 3, 1 / 7, 0.999):   # |factor| < 1: never overflows
            want = np.trunc(a.astype(np.float64) * f)
            got = a.copy()
            scale_in_place(got, f)
            assert np.array_equal(got.astype(np.float64), want), (name, f)


def test_factor_one_and_empty_are_noops():
    a = np.array([1, 2, 3], dtype=np.int32)
    scale_in_place(a, 1.0)
    assert a.tolist() == [1, 2, 3]
    e = np.empty((0, 3), dtype=np.float16)
    scale_in_place(e, 0.5)
    assert e.shape == (0, 3)


@pytest.mark.parametrize("name", ["float32", "float64"])
def test_wide_float_scaling_in_own_precision(name):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(100).astype(name)
    want = a * np.dtype(name).type(1 / 3)
    scale_in_place(a, 1 / 3)
    assert a.dtype == np.dtype(name)
    assert np.array_equal(a, want)


@pytest.mark.parametrize("dt", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
def test_16bit_float_scaling_in_float32(dt):
    a = np.array([3.0, 6.0, -9.0, 1.5, 0.0], dtype=dt)
    want = (a.astype(np.float32) * np.float32(1 / 3)).astype(dt)
    scale_in_place(a, 1 / 3)
    assert a.dtype == dt
    assert np.array_equal(a, want)
    assert a[0] == 1.0, "3 * float32(1/3) rounds to exactly 1 (a 16-bit factor would not)"
    rng = np.random.default_rng(2)
    b = (rng.standard_normal(300) * 50).astype(dt)
    want = (b.astype(np.float32) * np.float32(0.1)).astype(dt)
    scale_in_place(b, 0.1)
    assert np.array_equal(b, want)


def test_scaling_keeps_views_in_place():
    base = np.arange(10, dtype=np.float32)
    scale_in_place(base[2:6], 2.0)
    assert base.tolist() == [0, 1, 4, 6, 8, 10, 6, 7, 8, 9]


@pytest.mark.parametrize("name", [n for n in SUPPORTED_DTYPES if n != "bool"])
@pytest.mark.parametrize("factor", [1.0, 0.5, 1 / 3, -2.0])
def test_scale_into_matches_scale_in_place_and_leaves_its_input(name, factor):
    dt = dtype_info(name).np_dtype
    rng = np.random.default_rng(3)
    src = (rng.standard_normal(257) * 40).astype(dt)
    if dt.kind == "u":   # (a negative result does not fit: undefined, not a scaling rule)
        src = np.abs(rng.standard_normal(257) * 40).astype(dt)
        factor = abs(factor)
    keep = src.copy()
    want = src.copy()
    scale_in_place(want, factor)
    out = np.full_like(src, 99)
    scale_into(out, src, factor)
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), f"{name} x {factor}"
    assert np.array_equal(src.view(np.uint8), keep.view(np.uint8)), "the input was modified"


def test_scale_into_empty_is_noop():
    scale_into(np.empty(0, np.float32), np.empty(0, np.float32), 0.5)


# --- resolve_op (Horovod's op= / average= rules) -------------------------------------------------
def test_resolve_op_defaults_to_average():
    assert resolve_op(None, None) is ReduceOp.Average
    assert resolve_op(None, True) is ReduceOp.Average
    assert resolve_op(None, False) is ReduceOp.Sum


def test_resolve_op_values_match_horovod():
    assert [int(o) for o in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum, ReduceOp.Min,
                             ReduceOp.Max, ReduceOp.Product)] == [0, 1, 2, 3, 4, 5]
    for op in ReduceOp:
        assert resolve_op(op) is op
        assert resolve_op(int(op)) is op


def test_resolve_op_both_given_raises():
    with pytest.raises(ValueError):
        resolve_op(ReduceOp.Sum, True)
    with pytest.raises(ValueError):
        resolve_op(ReduceOp.Sum, False)


def test_resolve_op_unknown_raises():
    with pytest.raises(ValueError):
        resolve_op(42)
