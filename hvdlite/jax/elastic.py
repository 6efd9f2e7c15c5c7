"""Horovod's elastic API for JAX: ``hvd.elastic.run`` and ``JaxState``, a state of pytrees
(parameters, optax states) and plain objects.

JAX arrays are immutable, so saving a pytree is keeping a reference to it (numpy leaves are
copied); ``restore()`` and ``sync()`` assign new trees to the state's attributes: read them
back from the state (``state.params``) after a reset.  Between worlds the committed trees
travel to the elastic driver as numpy arrays (see :mod:`hvdlite.common.api.elastic`).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from hvdlite.common.core import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState,
                                 State, broadcast_object, elastic_run_fn, rank)

from .bridge import original_error
from .functions import broadcast_parameters


def _translate(exc: BaseException) -> BaseException | None:
    """A ``JaxRuntimeError`` raised for an hvdlite error inside a jitted function: that error
    (so that ``run`` sees the ``HorovodInternalError`` of a failed collective)."""
    found = original_error(exc)
    return found if found is not exc else None


def run(func: Callable) -> Callable:
    """Decorator running ``func(state, ...)`` elastically (Horovod's ``hvd.elastic.run``): the
    state is synchronized from rank 0 first; after a failure (``HorovodInternalError``, also
    when raised by a collective inside ``jax.jit``) or a change of hosts the driver starts a new
    world, which resumes from the last commit.  Call no collective before ``func``."""
    return elastic_run_fn(func, _translate)


def _has_arrays(value: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and any(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)


def _saved(tree: Any) -> Any:
    """A snapshot: JAX arrays are immutable (kept), numpy arrays copied."""
    return jax.tree_util.tree_map(lambda x: x.copy() if isinstance(x, np.ndarray) else x, tree)


def _to_host(tree: Any) -> list:
    return [np.asarray(x) if isinstance(x, (jax.Array, np.ndarray)) else x
            for x in jax.tree_util.tree_leaves(tree)]


class JaxState(ObjectState):
    """State of a JAX training process.

    Args:
      params: a pytree of arrays (optional).
      opt_state: an optax state (optional).
      kwargs: more attributes; pytrees that hold arrays are handled as ``params`` (saved by
        reference, broadcast array by array), everything else is a plain object (epoch,
        batch, ...).

    ``commit()`` saves every attribute (and ships the state to the elastic driver),
    ``restore()`` goes back to the last commit, ``sync()`` makes every rank's state rank 0's;
    the trees are new objects afterwards, so read them back from the state.
    """

    def __init__(self, params: Any = None, opt_state: Any = None, **kwargs: Any) -> None:
        kwargs.update(params=params, opt_state=opt_state)
        trees = {k: v for k, v in kwargs.items() if _has_arrays(v)}
        objects = {k: v for k, v in kwargs.items() if k not in trees}
        self._trees = set(trees)
        self._saved_trees = {k: _saved(v) for k, v in trees.items()}
        for key, value in trees.items():
            setattr(self, key, value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **objects)

    def save(self) -> None:
        self._saved_trees = {k: _saved(getattr(self, k)) for k in self._trees}
        super().save()

    def restore(self) -> None:
        for key, value in self._saved_trees.items():
            setattr(self, key, _saved(value))
        super().restore()

    def sync(self) -> None:
        for key in sorted(self._trees):
            setattr(self, key, broadcast_parameters(getattr(self, key), 0,
                                                    prefix=f"elastic.{key}"))
        super().sync()

    def committed_state(self) -> Any:
        committed = super().committed_state()
        committed["trees"] = {k: _to_host(v) for k, v in self._saved_trees.items()}
        return committed

    def load_committed_state(self, committed: Any) -> None:
        saved = committed["trees"]
        if set(saved) != self._trees:
            raise ValueError(f"JaxState: the committed state has trees {sorted(saved)} but "
                             f"this state has {sorted(self._trees)}; every world must build "
                             f"the state with the same arguments.")
        for key, leaves in saved.items():
            treedef = jax.tree_util.tree_structure(getattr(self, key))
            tree = jax.tree_util.tree_unflatten(
                treedef, [jax.numpy.asarray(x) if isinstance(x, np.ndarray) else x
                          for x in leaves])
            self._saved_trees[key] = tree
            setattr(self, key, _saved(tree))
        super().load_committed_state(committed)


__all__ = ["run", "State", "ObjectState", "JaxState", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
