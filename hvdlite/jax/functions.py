"""Broadcasting pytrees (parameters, optax states) from one rank to every rank."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hvdlite.common.core import ProcessSet, broadcast_object, global_process_set, rank

from . import collectives as raw
from .bridge import is_traced


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, jax.core.Tracer))


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str = "broadcast.param",
                         process_set: ProcessSet = global_process_set) -> Any:
    """Return ``params`` (any pytree: a dict of parameters, a Flax/Haiku params tree, an optax
    state, a list of arrays) with every array leaf replaced by ``root_rank``'s.  JAX arrays
    are immutable, so use the result: ``params = hvd.broadcast_parameters(params, 0)``.

    Leaves are named by their path in the tree (``<prefix>.<path>``), so every rank must pass a
    tree of the same structure.  Eagerly, leaves that are not arrays (Python numbers, strings)
    come from the root too, in one ``broadcast_object``; inside ``jax.jit`` such leaves are
    constants of the trace and stay as they are."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in leaves_with_paths]
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    others = [i for i, leaf in enumerate(leaves) if not _is_array(leaf)]
    out = list(leaves)
    if arrays:
        names = [f"{prefix}.{jax.tree_util.keystr(leaves_with_paths[i][0])}" for i in arrays]
        values = [leaves[i] if not isinstance(leaves[i], np.ndarray) else jax.numpy.asarray(
            leaves[i]) for i in arrays]
        results = raw.broadcast_named(values, names, int(root_rank), process_set)
        for i, r in zip(arrays, results):
            out[i] = r
    if others and not is_traced(*[leaves[i] for i in arrays]):
        sent = broadcast_object([leaves[i] for i in others] if rank() == root_rank else None,
                                root_rank, name=f"{prefix}.objects",
                                process_set=process_set)
        for i, value in zip(others, sent):
            out[i] = value
    return jax.tree_util.tree_unflatten(treedef, out)


def broadcast_optimizer_state(opt_state: Any, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> Any:
    """Return the optax state ``opt_state`` (a pytree) with every leaf replaced by
    ``root_rank``'s (:func:`broadcast_parameters` under other names)."""
    return broadcast_parameters(opt_state, root_rank, prefix="broadcast.optimizer",
                                process_set=process_set)


__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]
