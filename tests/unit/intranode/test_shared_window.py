"""Pure logic of the shared-memory fusion path: how elements are split into the ranks' shares,
how a result held as pieces is scattered into the outputs, and which numpy ufunc stands in for
each MPI reduction.  The multi-rank behaviour is tested under mpiexec in
tests/core/test_ops.py (steady.shared_fusion)."""
import numpy as np
import pytest

from hvdlite.common.data_paths.helpers import copy_out_pieces as _copy_out_pieces
from hvdlite.common.dtypes import dtype_info, numpy_reduce_ufunc
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.intranode.shared_window import SharedWindow


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 1000, 16385, 1 << 20])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_shares_cover_everything_once_on_cache_lines(size, count, itemsize):
    bounds = SharedWindow.shares(count, itemsize, size)
    assert len(bounds) == size + 1
    assert bounds[0] == 0 and bounds[-1] == count
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    unit = 64 // itemsize
    assert all(b % unit == 0 for b in bounds[:-1])
    widths = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(widths) - min(widths) <= 2 * unit   # balanced up to the alignment


def _pieces(result: np.ndarray, cuts: list[int]):
    edges = [0] + cuts + [result.size]
    return [(a, b, result[a:b].copy()) for a, b in zip(edges, edges[1:]) if b > a]


@pytest.mark.parametrize("cuts", [[], [5], [1, 2, 3], [40, 41], [17, 60, 99]])
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_copy_out_pieces_scatters_across_piece_boundaries(cuts, factor):
    sizes = [3, 0, 14, 1, 40, 0, 22, 20]          # 100 elements, outputs straddle the cuts
    result = np.arange(100, dtype=np.float32) * 2
    outputs = [np.full(n, -1, dtype=np.float32) for n in sizes]
    _copy_out_pieces(outputs, sizes, _pieces(result, cuts), factor)
    np.testing.assert_array_equal(np.concatenate(outputs), result * np.float32(factor))


def test_copy_out_pieces_scales_integers_like_scale_into():
    sizes = [4, 6]
    result = np.array([7, -7, 3, -3, 9, 10, 11, -11, 1, 0], dtype=np.int32)
    outputs = [np.zeros(n, dtype=np.int32) for n in sizes]
    _copy_out_pieces(outputs, sizes, _pieces(result, [3, 4]), 0.5)
    # Horovod's rule: integers scaled in float64, truncated toward zero
    np.testing.assert_array_equal(np.concatenate(outputs), np.trunc(result * 0.5).astype(np.int32))


@pytest.mark.parametrize("op,expected", [
    (ReduceOp.Sum, [True, True, True, False]), (ReduceOp.Max, [True, True, True, False]),
    (ReduceOp.Min, [True, False, False, False]), (ReduceOp.Product, [True, False, False, False]),
])
def test_bool_reductions_are_logical(op, expected):
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    out = a.copy()
    numpy_reduce_ufunc(dtype_info("bool"), op)(out, b, out=out)
    assert out.tolist() == expected


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int64", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("op,reference", [
    (ReduceOp.Sum, np.add), (ReduceOp.Average, np.add), (ReduceOp.Min, np.minimum),
    (ReduceOp.Max, np.maximum), (ReduceOp.Product, np.multiply),
])
def test_numeric_reductions_match_numpy(dtype, op, reference):
    info = dtype_info(dtype)
    a = np.array([1, 2, 3, 4], dtype=info.np_dtype)
    b = np.array([4, 1, 3, 2], dtype=info.np_dtype)
    out = a.copy()
    numpy_reduce_ufunc(info, op)(out, b, out=out)
    np.testing.assert_array_equal(out, reference(a, b))
