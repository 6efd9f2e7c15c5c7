"""DistributedGradientTape and the gradient-averaging function shared with the Keras optimizer."""
from __future__ import annotations

import tensorflow as tf

from hvdlite.common import basics
from hvdlite.common.process_sets import ProcessSet, global_process_set
from hvdlite.common.reduce_ops import ReduceOp, resolve_op

from .compression import Compression
from .mpi_ops import grouped_allreduce, allreduce


def _check_groups(num_groups, groups):
    if num_groups and groups is not None:
        raise ValueError("pass at most one of num_groups and groups")
    if isinstance(groups, int) and groups <= 0:
        raise ValueError("groups must be a positive int or a list of variable lists")


def _check_process_set(process_set) -> tuple[bool, int]:
    """(is this rank a member, the set's size) of ``process_set`` (None = all ranks)."""
    if process_set is None or (isinstance(process_set, ProcessSet)
                               and process_set.process_set_id == 0):
        return True, basics.size()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, got "
                        f"{type(process_set).__name__}.")
    ranks = basics.get_process_set_ids_and_ranks().get(process_set.process_set_id)
    if process_set.process_set_id is None or ranks is None:
        raise ValueError(f"{process_set!r} is not registered; pass it to "
                         f"hvd.init(process_sets=[...]) or hvd.add_process_set() first.")
    return basics.rank() in ranks, len(ranks)


def make_allreduce_grads_fn(name: str, compression=Compression.none, sparse_as_dense=False,
                            op=ReduceOp.Average, gradient_predivide_factor=1.0,
                            process_set=global_process_set):
    """Return ``fn(grads) -> averaged grads`` (None entries stay None).

    All dense gradients travel as one group: negotiated and executed as one unit (inside
    ``tf.function``: one graph node), so the core fuses them into few collectives.  With a
    ``process_set``, gradients are reduced over its ranks only; on ranks outside the set (and
    when the set has one rank) they are returned unchanged, as in Horovod.
    """
    op = resolve_op(op)
    if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if op == ReduceOp.Average and gradient_predivide_factor != 1.0:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        prescale = postscale = 1.0

    def allreduce_grads(grads, variables=None):
        grads = list(grads)
        member, set_size = _check_process_set(process_set)
        if not member or (set_size == 1 and op in (ReduceOp.Average, ReduceOp.Sum)
                          and prescale * postscale == 1.0):
            return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) and sparse_as_dense
                    else g for g in grads]
        out = list(grads)
        dense, dense_idx = [], []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                if sparse_as_dense:
                    g = tf.convert_to_tensor(g)
                else:
                    out[i] = allreduce(g, op=op, prescale_factor=prescale,
                                       postscale_factor=postscale, name=f"{name}.sparse.{i}",
                                       compression=compression, process_set=process_set)
                    continue
            dense.append(g)
            dense_idx.append(i)
        if dense:
            # Fixed names (position in the gradient list): deterministic on every rank, eagerly
            # and in tf.function, and stable across steps for the core's response cache.
            reduced = grouped_allreduce(dense, op=op, prescale_factor=prescale,
                                        postscale_factor=postscale, compression=compression,
                                        name=name, process_set=process_set)
            for i, r in zip(dense_idx, reduced):
                out[i] = r
        return out

    return allreduce_grads


class _DistributedGradientTape(tf.GradientTape):
    """A GradientTape whose ``gradient()`` returns gradients averaged across ranks."""

    def _hvd_setup(self, allreduce_grads):
        self._hvd_allreduce_grads = allreduce_grads

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        gradients = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(gradients)
        reduced = self._hvd_allreduce_grads(flat)
        return tf.nest.pack_sequence_as(gradients, reduced)


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False,
                            op=ReduceOp.Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set,
                            scale_local_gradients=True):
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` averages gradients across ranks.

    Use after (or around) the ``with tf.GradientTape() as tape:`` block::

        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    ``sparse_as_dense`` converts ``tf.IndexedSlices`` gradients (embeddings) to dense tensors
    before the allreduce; otherwise their values and indices are allgathered.
    ``compression``: ``Compression.fp16`` sends float gradients as float16.
    ``process_set``: average over the ranks of this set only; ranks outside it get their local
    gradients unchanged (Horovod's behaviour).
    ``num_groups``/``groups`` are accepted for compatibility: every gradient already travels in
    one group that the core fuses.  ``device_dense``/``device_sparse`` are ignored (CPU only).
    """
    _check_groups(num_groups, groups)
    _check_process_set(process_set)
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_setup(make_allreduce_grads_fn("DistributedGradientTape.allreduce", compression,
                                            sparse_as_dense, op, gradient_predivide_factor,
                                            process_set))
    return tape
