"""Gradient arithmetic that the framework adapters share: the scale factors of a gradient's
reduction and the moments of synchronised batch normalisation.

Pure functions, no communication.  The moment functions use only ``+``, ``*`` and ``/``, so
they take numpy arrays, torch tensors and TensorFlow tensors alike, and autograd (or TF's
gradient tape) differentiates through them as through the adapters' own code.
"""
from __future__ import annotations

from typing import Any, TypeVar

from hvdlite.common.reduce_ops import ReduceOp

T = TypeVar("T")


def predivide_factors(op: ReduceOp, gradient_predivide_factor: float) -> tuple[float, float]:
    """``(prescale, postscale)`` of a gradient's allreduce for Horovod's
    ``gradient_predivide_factor`` f: with Average each rank's gradient is divided by f before
    the sum and the sum multiplied by f after it (the engine's Average divides by the set's
    size on top), which keeps float16 sums in range; ``(1.0, 1.0)`` for the other ops.  Both
    are floats (an int factor too), as the engine's fast submission path expects.

    Raises ValueError for a factor other than 1 with an op other than Average, as Horovod
    does."""
    factor = float(gradient_predivide_factor)
    if op != ReduceOp.Average:
        if factor != 1.0:
            raise ValueError("gradient_predivide_factor is only supported with op=Average.")
        return 1.0, 1.0
    return 1.0 / factor, factor


def sparse_postscale(op: ReduceOp, postscale_factor: float, set_size: int) -> float:
    """What a sparse allreduce (every rank's non-zeros allgathered and summed) multiplies the
    summed values by: ``postscale_factor``, and for Average also ``1 / set_size``, so that
    Average means the sum over the set's ranks divided by their number, as for dense tensors."""
    if op == ReduceOp.Average:
        return postscale_factor * (1.0 / set_size)
    return postscale_factor


def moment_sums(count: Any, mean: T, var: T) -> tuple[T, T]:
    """One rank's contribution to the global batch moments, from its own batch's ``count``,
    per-channel ``mean`` and biased variance ``var``: ``(count * mean, count * (var + mean**2))``,
    the sum and the sum of squares of its elements per channel.  Summed over the ranks (one
    allreduce), they give the global moments (:func:`global_moments`)."""
    return count * mean, count * (var + mean * mean)


def global_moments(count: Any, sums: T, sumsq: T) -> tuple[T, T]:
    """Per-channel mean and biased variance of the union of the ranks' batches from the summed
    :func:`moment_sums`: ``(sums / count, sumsq / count - mean**2)``.  ``count`` (the total
    number of elements per channel) must be positive: callers pass 1 where every batch is
    empty.  The one-pass variance loses about ``1e-16 * (mean/std)**2`` relative accuracy to
    cancellation and can come out slightly negative: callers clamp it at 0."""
    mean = sums / count
    return mean, sumsq / count - mean * mean
