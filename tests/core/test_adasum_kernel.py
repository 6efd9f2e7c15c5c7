"""The Adasum kernel: its numpy reference, the argument checks, and real MPI runs at 2, 3, 4 ranks.

The multi-rank cases run in one launch of tests/core/workers/core_adasum_kernel_worker.py per rank
count; each case is its own test here.
"""
import numpy as np
import pytest

from hvdlite.common.data_paths.adasum import adasum_allreduce_, check_adasum_size
from tests.mpi_harness import assert_case_passed
from tests.core.workers.core_adasum_kernel_worker import (NP_BAD, NP_POW2, adasum_pair,
                                                          adasum_reference, adasum_tree, cases_for)

rng = np.random.default_rng(7)


# --- the reference -----------------------------------------------------------------------------
def test_pair_of_orthogonal_vectors_is_their_sum():
    a, b = np.array([1.0, 0.0, 2.0]), np.array([0.0, -3.0, 0.0])
    np.testing.assert_array_equal(adasum_pair(a, b), a + b)


def test_pair_of_identical_vectors_is_the_vector():
    a = rng.standard_normal(9)
    np.testing.assert_allclose(adasum_pair(a, a), a, rtol=1e-15)


def test_pair_of_parallel_and_opposite_vectors():
    a = rng.standard_normal(5)
    np.testing.assert_allclose(adasum_pair(a, 3 * a), 2 * a, rtol=1e-14)   # ((k + 1) / 2) a
    np.testing.assert_allclose(adasum_pair(a, -a), 0 * a, atol=1e-14)


def test_pair_with_a_zero_vector():
    a, z = rng.standard_normal(4), np.zeros(4)
    np.testing.assert_array_equal(adasum_pair(z, a), a)
    np.testing.assert_array_equal(adasum_pair(a, z), a)
    np.testing.assert_array_equal(adasum_pair(z, z), z)


def test_pair_is_symmetric():
    a, b = rng.standard_normal(6), rng.standard_normal(6)
    np.testing.assert_allclose(adasum_pair(a, b), adasum_pair(b, a), rtol=1e-14)


def test_tree_pairs_neighbours_first():
    vs = [rng.standard_normal(8) for _ in range(4)]
    want = adasum_pair(adasum_pair(vs[0], vs[1]), adasum_pair(vs[2], vs[3]))
    np.testing.assert_array_equal(adasum_tree(vs), want)
    basis = [np.eye(4)[i] * (i + 1) for i in range(4)]
    np.testing.assert_array_equal(adasum_tree(basis), [1.0, 2.0, 3.0, 4.0])


def test_reference_reduces_each_segment_alone():
    vs = [rng.standard_normal(10) for _ in range(2)]
    got = adasum_reference(vs, [3, 0, 7])
    np.testing.assert_array_equal(got[:3], adasum_pair(vs[0][:3], vs[1][:3]))
    np.testing.assert_array_equal(got[3:], adasum_pair(vs[0][3:], vs[1][3:]))


# --- argument checks (no MPI needed: they run before any message) -------------------------------
class FakeComm:
    """Size/rank only; any message would fail loudly."""

    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0


@pytest.mark.parametrize("size", [1, 2, 4, 8, 1024])
def test_power_of_two_sizes_accepted(size):
    check_adasum_size(size, "allreduce of 'w'")


@pytest.mark.parametrize("size", [0, 3, 6, 12])
def test_other_sizes_rejected_with_what_to_do(size):
    with pytest.raises(ValueError) as info:
        check_adasum_size(size, "allreduce of 'w'")
    msg = str(info.value)
    assert "allreduce of 'w'" in msg and f"has {size}" in msg
    assert "power-of-two" in msg and "op=Average" in msg


def test_size_one_is_a_noop():
    x = rng.standard_normal(11)
    buf = x.copy()
    adasum_allreduce_(FakeComm(1), buf, [5, 6])
    np.testing.assert_array_equal(buf, x)


def test_kernel_rejects_non_power_of_two_before_communicating():
    with pytest.raises(ValueError, match="has 3"):
        adasum_allreduce_(FakeComm(3), np.ones(4), [4])


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "bool", "complex64"])
def test_kernel_rejects_non_float_dtypes(dtype):
    with pytest.raises(TypeError, match=f"floating-point tensors only.*got {dtype}"):
        adasum_allreduce_(FakeComm(2), np.zeros(4, dtype=dtype), [4])


@pytest.mark.parametrize("bad", [np.zeros((2, 3)), np.zeros(8)[::2]])
def test_kernel_rejects_non_flat_buffers(bad):
    with pytest.raises(ValueError, match="1-D contiguous"):
        adasum_allreduce_(FakeComm(2), bad, [bad.size])


# --- real MPI runs -----------------------------------------------------------------------------
def _params():
    return [pytest.param(n, case, id=f"np{n}-{case}")
            for n in NP_POW2 + NP_BAD for case in cases_for(n)]


@pytest.mark.parametrize("np_,case", _params())
def test_kernel_under_mpi(mpi_job, np_, case):
    job = mpi_job(np_, ["core/workers/core_adasum_kernel_worker.py"], timeout=120)
    assert_case_passed(job, np_, case)
