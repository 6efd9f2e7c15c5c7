"""``DistributedOptimizer``: an optax ``GradientTransformation`` that averages the gradients
across ranks (one grouped allreduce of every leaf) before the transformation it wraps."""
from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from hvdlite.common.core import (ProcessSet, ReduceOp, check_adasum_size, global_process_set,
                                 predivide_factors, process_set_engine, resolve_op)

from .bridge import is_traced
from .collectives import set_size
from .compression import Compression
from .mpi_ops import grouped_allreduce

_created = itertools.count(1)   # DistributedOptimizers made in this process, in order


class DistributedState(NamedTuple):
    """The state of a :func:`DistributedOptimizer`: the wrapped transformation's state, and
    with ``backward_passes_per_step > 1`` the gradients accumulated so far and their count."""
    inner: Any
    accumulated: Any
    count: Any


def _outside(process_set: ProcessSet) -> bool:
    return (process_set is not global_process_set and process_set.process_set_id not in (None, 0)
            and not process_set.included())


def DistributedOptimizer(optimizer: optax.GradientTransformation,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp = ReduceOp.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False,
                         process_set: ProcessSet = global_process_set,
                         name: str | None = None) -> optax.GradientTransformation:
    """Wrap ``optimizer`` (any ``optax.GradientTransformation``) so that ``update`` sees the
    gradients reduced across the ranks of ``process_set`` (default: averaged over all ranks).

    ``update(grads, state, params=None)`` flattens ``grads`` (any pytree), reduces every leaf in
    one grouped allreduce (one negotiation, small leaves fused), then runs ``optimizer.update``
    on the result.  Works eagerly and inside ``jax.jit``; every rank must call ``update`` the
    same number of times.

    Args:
      optimizer: the transformation to wrap (``optax.adam(1e-3)``, an ``optax.chain``, ...).
      compression (Compression): ``Compression.none`` (default), ``Compression.fp16`` or
        ``Compression.bf16``: floating-point gradients travel in 16 bits.
      backward_passes_per_step: k > 1 accumulates the gradients of k calls of ``update``
        locally (summed, as in Horovod; averaged with ``average_aggregated_gradients=True``) and
        reduces and applies them at the k-th; the other calls return zero updates and leave the
        wrapped state alone (as ``optax.MultiSteps``).
      op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``
        (power-of-two number of ranks).
      gradient_predivide_factor: with Average, divide by this before the sum and by
        ``size() / factor`` after it.
      average_aggregated_gradients: with ``backward_passes_per_step > 1``, divide the
        accumulated gradients by k.
      process_set: reduce among this set's ranks (Average divides by its size).  On a rank
        outside the set the result is the plain local ``optimizer`` wrapped the same way
        (no reductions), as in Horovod.
      name: the name of the reduction on the wire (default ``DistributedOptimizer.<k>``, the
        k-th made in this process: every rank must build its optimizers in the same order).
    """
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1.")
    op = resolve_op(op)
    prescale, postscale = predivide_factors(op, gradient_predivide_factor)
    if process_set is not global_process_set and not _outside(process_set):
        process_set_engine(process_set, "DistributedOptimizer(process_set=...)")
    member = not _outside(process_set)
    if op == ReduceOp.Adasum and member:
        check_adasum_size(set_size(process_set), "DistributedOptimizer(op=Adasum)")
    label = name or f"DistributedOptimizer.{next(_created)}"
    optimizer = optax.with_extra_args_support(optimizer)
    passes = int(backward_passes_per_step)

    def reduce(grads):
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        # Alone in its set (fixed for a process's life: an elastic world is new processes) an
        # unscaled Sum or Average is the identity: no callback in the step, no copies.
        alone = (set_size(process_set) == 1 and op in (ReduceOp.Average, ReduceOp.Sum)
                 and prescale * postscale == 1.0 and compression is Compression.none)
        if member and leaves and not alone:
            leaves = grouped_allreduce(leaves, name=label, compression=compression, op=op,
                                       prescale_factor=prescale, postscale_factor=postscale,
                                       process_set=process_set)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def init_fn(params):
        accumulated = (jax.tree_util.tree_map(jnp.zeros_like, params) if passes > 1 else None)
        return DistributedState(optimizer.init(params), accumulated,
                                jnp.zeros((), jnp.int32))

    def update_fn(grads, state, params=None, **extra):
        if passes == 1:
            updates, inner = optimizer.update(reduce(grads), state.inner, params, **extra)
            return updates, DistributedState(inner, None, state.count + 1)
        accumulated = jax.tree_util.tree_map(jnp.add, state.accumulated, grads)
        count = state.count + 1

        def apply(args):
            acc, inner = args
            if average_aggregated_gradients:
                acc = jax.tree_util.tree_map(lambda g: g / passes, acc)
            updates, inner = optimizer.update(reduce(acc), inner, params, **extra)
            return updates, inner, jax.tree_util.tree_map(jnp.zeros_like, acc), jnp.zeros(
                (), jnp.int32)

        def wait(args):
            acc, inner = args
            return jax.tree_util.tree_map(jnp.zeros_like, grads), inner, acc, count

        operands = (accumulated, state.inner)
        if is_traced(count):
            updates, inner, accumulated, count = lax.cond(count >= passes, apply, wait,
                                                          operands)
        else:
            updates, inner, accumulated, count = (apply if int(count) >= passes
                                                  else wait)(operands)
        return updates, DistributedState(inner, accumulated, count)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = ["DistributedOptimizer", "DistributedState"]
