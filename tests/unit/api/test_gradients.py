"""The gradient arithmetic both adapters share (hvdlite/common/api/gradients.py), checked
against its definitions: Horovod's predivide split (horovod/torch/optimizer.py,
``_allreduce_grad_async``), Average of a sparse sum over the set's size, and the moments of
the concatenated batches of several ranks."""
from __future__ import annotations

import numpy as np
import pytest

from hvdlite.common.core import (ReduceOp, global_moments, moment_sums, predivide_factors,
                                 sparse_postscale)


@pytest.mark.parametrize("factor", [1.0, 2.0, 0.25, 3])
def test_predivide_splits_average(factor):
    # Horovod: prescale = 1 / f, postscale = f (the engine divides by the size on top)
    prescale, postscale = predivide_factors(ReduceOp.Average, factor)
    assert (prescale, postscale) == (1.0 / factor, float(factor))
    assert type(prescale) is float and type(postscale) is float   # the fast path's types


@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product,
                                ReduceOp.Adasum, int(ReduceOp.Sum)])
def test_predivide_other_ops(op):
    assert predivide_factors(op, 1.0) == (1.0, 1.0)
    with pytest.raises(ValueError, match="only supported with op=Average"):
        predivide_factors(op, 2.0)


def test_average_of_a_predivided_sum_is_the_mean():
    """Scaled as the engine scales (prescale, sum, postscale / size), the predivided Average
    is the mean of the ranks' gradients."""
    grads = [np.array([1.0, -2.0, 8.0]), np.array([3.0, 6.0, 0.5]), np.array([2.0, 2.0, 2.0])]
    prescale, postscale = predivide_factors(ReduceOp.Average, 4.0)
    total = sum(g * prescale for g in grads) * postscale / len(grads)
    np.testing.assert_allclose(total, np.mean(grads, axis=0), rtol=1e-15)


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_sparse_postscale(size):
    assert sparse_postscale(ReduceOp.Average, 1.0, size) == 1.0 / size
    assert sparse_postscale(ReduceOp.Average, 2.0, size) == 2.0 * (1.0 / size)
    assert sparse_postscale(ReduceOp.Sum, 1.0, size) == 1.0
    assert sparse_postscale(ReduceOp.Sum, 0.5, size) == 0.5


def _shares(batches):
    """Each rank's (count, sums, sumsq) from its own mean and biased variance, summed."""
    counts = sums = sumsq = 0
    for batch in batches:
        n = batch.shape[0]
        if n == 0:
            continue
        s, ss = moment_sums(n, batch.mean(axis=0), batch.var(axis=0))
        counts, sums, sumsq = counts + n, sums + s, sumsq + ss
    return counts, sums, sumsq


@pytest.mark.parametrize("rows", [(5,), (3, 7), (1, 0, 4), (2, 2, 2, 9)])
def test_moments_of_the_concatenated_batches(rows):
    rng = np.random.default_rng(sum(rows))
    batches = [rng.normal(3.0, 2.0, size=(n, 4)) for n in rows]
    n, sums, sumsq = _shares(batches)
    mean, var = global_moments(max(n, 1), sums, sumsq)
    union = np.concatenate(batches)
    np.testing.assert_allclose(mean, union.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(var, union.var(axis=0), rtol=1e-12)


def test_moments_of_a_constant_channel_may_round_below_zero():
    """A channel without spread: the one-pass variance is zero up to rounding, and callers
    clamp it (what the docstring promises them)."""
    batches = [np.full((3, 2), 1e4 + 0.1), np.full((5, 2), 1e4 + 0.1)]
    n, sums, sumsq = _shares(batches)
    mean, var = global_moments(n, sums, sumsq)
    np.testing.assert_allclose(mean, 1e4 + 0.1, rtol=1e-15)
    assert np.all(np.abs(var) < 1e-6), var


def test_moments_work_on_torch_tensors_and_differentiate():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    data = [rng.normal(size=(n, 3)) for n in (4, 6)]
    xs = [torch.tensor(d, requires_grad=True) for d in data]
    shares = [moment_sums(x.shape[0], x.mean(0), x.var(0, correction=0)) for x in xs]
    mean, var = global_moments(10, sum(s for s, _ in shares), sum(ss for _, ss in shares))
    union = torch.cat(xs)
    torch.testing.assert_close(mean, union.mean(0))
    torch.testing.assert_close(var, union.var(0, correction=0))
    var.sum().backward()
    # d(sum of biased variances)/dx = 2 (x - mean) / N over the union
    expected = 2 * (union.detach() - union.detach().mean(0)) / 10
    torch.testing.assert_close(torch.cat([x.grad for x in xs]), expected)
