"""Horovod's topology ops: ``size_op``, ``rank_op``, ``local_size_op``, ``local_rank_op``,
``cross_size_op``, ``cross_rank_op`` and ``process_set_included_op``, each an int32 constant
(named ``name``) holding the value when the op is created."""
from __future__ import annotations

import tensorflow as tf

from hvdlite.common import core

from .errors import public_op


# Horovod's size_op and process_set_included_op return this code for an unknown process set.
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _set_ranks(process_set_id: int) -> list[int] | None:
    return core.get_process_set_ids_and_ranks().get(int(process_set_id))


@public_op
def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """Number of ranks in the process set ``process_set_id`` (default: the job), as an int32
    tensor; -3 for a set id that is not registered (Horovod's error code).  The value is
    fixed when the op is created (Horovod's op reads it when it runs)."""
    if process_set_id == 0:
        return tf.constant(core.size(), dtype=tf.int32, name=name)
    ranks = _set_ranks(process_set_id)
    size = PROCESS_SET_ERROR_UNKNOWN_SET if ranks is None else len(ranks)
    return tf.constant(size, dtype=tf.int32, name=name)


@public_op
def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank is a member of the process set ``process_set_id``, else 0 (int32); -3
    for a set id that is not registered (Horovod's error code)."""
    if process_set_id == 0:
        included = 1
    else:
        ranks = _set_ranks(process_set_id)
        included = (PROCESS_SET_ERROR_UNKNOWN_SET if ranks is None
                    else int(core.rank() in ranks))
    return tf.constant(included, dtype=tf.int32, name=name)


@public_op
def rank_op(name: str | None = None) -> tf.Tensor:
    """This rank (int32 tensor)."""
    return tf.constant(core.rank(), dtype=tf.int32, name=name)


@public_op
def local_size_op(name: str | None = None) -> tf.Tensor:
    """Number of ranks on this host (int32 tensor)."""
    return tf.constant(core.local_size(), dtype=tf.int32, name=name)


@public_op
def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This rank's index on its host (int32 tensor)."""
    return tf.constant(core.local_rank(), dtype=tf.int32, name=name)


@public_op
def cross_size_op(name: str | None = None) -> tf.Tensor:
    """Number of hosts (int32 tensor)."""
    return tf.constant(core.cross_size(), dtype=tf.int32, name=name)


@public_op
def cross_rank_op(name: str | None = None) -> tf.Tensor:
    """This host's index (int32 tensor)."""
    return tf.constant(core.cross_rank(), dtype=tf.int32, name=name)
