"""DistributedGradientTape and the gradient-averaging function shared with the Keras optimizer."""
from __future__ import annotations

import warnings

import tensorflow as tf

from hvdlite.common import core
from hvdlite.common.core import (global_process_set, predivide_factors, ProcessSet, ReduceOp,
                                 resolve_op)

from . import grad_layouts as layouts
from .compression import Compression
from .autodiff import differentiable_allreduce
from .mpi_ops import allreduce
from .powersgd import PowerSGDCompressor, PowerSGDReduction, tape_state


def check_groups(num_groups, groups):
    """Horovod's checks: ``num_groups`` is deprecated (a warning; it stands in for a missing
    ``groups``); ``groups`` is a positive int or a list of variable lists."""
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "tf.Variable.")


def check_process_set(process_set) -> tuple[bool, int]:
    """(is this rank a member, the set's size) of ``process_set`` (None = all ranks)."""
    if process_set is None or (isinstance(process_set, ProcessSet)
                               and process_set.process_set_id == 0):
        return True, core.size()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, got "
                        f"{type(process_set).__name__}.")
    ranks = core.get_process_set_ids_and_ranks().get(process_set.process_set_id)
    if process_set.process_set_id is None or ranks is None:
        raise ValueError(f"{process_set!r} is not registered; pass it to "
                         f"hvd.init(process_sets=[...]) or hvd.add_process_set() first.")
    return core.rank() in ranks, len(ranks)


class LocalVariables:
    """Variables (or watched tensors) registered as local to this rank: model-parallel layers
    whose gradients are not reduced.  Membership is by identity, like Horovod's ``var.ref()``."""

    def __init__(self, variables=()) -> None:
        self._by_id: dict[int, object] = {}
        for v in variables:
            self.add(v)

    def add(self, variable) -> None:
        self._by_id[id(variable)] = variable   # holding it keeps its id unique

    def __contains__(self, variable) -> bool:
        return id(variable) in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)


def local_layer_variables(local_layers) -> list:
    """The trainable variables of ``local_layers`` (a Keras layer, a collection of them, or
    None), checked as Horovod's ``PartialDistributed*`` APIs check them."""
    if local_layers is None:
        return []
    if isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("local_layers must be Keras layers (tf.keras.layers.Layer), got "
                         f"{[type(layer).__name__ for layer in local_layers]}.")
    return [v for layer in local_layers for v in layer.trainable_weights]


def make_allreduce_grads_fn(name: str, compression=Compression.none, sparse_as_dense=False,
                            op=ReduceOp.Average, gradient_predivide_factor=1.0,
                            process_set=global_process_set, scale_local_gradients=True,
                            state_outlives_fn=False):
    """Return ``fn(grads, variables=None, local=None) -> averaged grads`` (None entries stay
    None).

    All dense gradients travel as one group: negotiated and executed as one unit (inside
    ``tf.function``: one graph node), so the core fuses them into few collectives.  Gradients
    that are None or sparse on some ranks only are reconciled eagerly and reported clearly
    inside ``tf.function`` (see :mod:`.grad_layouts`).  With a
    ``process_set``, gradients are reduced over its ranks only; on ranks outside the set (and
    when the set has one rank) they are returned unchanged, as in Horovod.

    Gradients of ``variables`` found in ``local`` (a :class:`LocalVariables`) are not reduced;
    with ``scale_local_gradients`` they are divided by the process set's size instead, as in
    Horovod, so that they are on the scale of the averaged ones.

    With ``compression=Compression.powersgd(...)`` the dense gradients are reduced by PowerSGD
    (:mod:`.powersgd`; sparse ones are made dense first); its state (Q, error feedback, step
    count) belongs to the function, or with ``state_outlives_fn`` (a tape, made anew every
    step) to ``name``, the process set and the settings.
    """
    op = resolve_op(op)
    prescale, postscale = predivide_factors(op, gradient_predivide_factor)
    powersgd_reduce = None
    if isinstance(compression, PowerSGDCompressor):
        config = compression.config
        state = tape_state(name, process_set, config) if state_outlives_fn else None
        powersgd_reduce = PowerSGDReduction(name, config, op, prescale, postscale, process_set,
                                            state, f"{name.split('.')[0]}(compression=powersgd)")

    def allreduce_grads(grads, variables=None, local=None):
        grads = list(grads)
        variables = None if variables is None else list(variables)
        if variables is not None and len(variables) != len(grads):
            raise ValueError(f"{name}: {len(grads)} gradients for {len(variables)} variables")
        if local and variables is not None:
            return reduce_shared_only(grads, variables, local)
        return reduce_all(grads, variables)

    def reduce_shared_only(grads, variables, local):
        is_local = [v in local for v in variables]
        shared = [i for i, mine in enumerate(is_local) if not mine]
        for i, g in zip(shared, reduce_all([grads[i] for i in shared],
                                           [variables[i] for i in shared])):
            grads[i] = g
        if scale_local_gradients:
            set_size = check_process_set(process_set)[1]
            grads = [_divided(g, set_size) if mine and g is not None else g
                     for g, mine in zip(grads, is_local)]
        return grads

    def reduce_all(grads, variables):
        member, set_size = check_process_set(process_set)
        if not member or (set_size == 1 and op in (ReduceOp.Average, ReduceOp.Sum)
                          and prescale * postscale == 1.0):
            return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) and sparse_as_dense
                    else g for g in grads]
        if powersgd_reduce is not None:
            return powersgd_reduce(grads)
        kinds = [layouts.kind_of(g, sparse_as_dense) for g in grads]
        if tf.executing_eagerly():
            # Agree with the other ranks on each gradient's layout; fill in what this rank lacks.
            kinds = layouts.agree(kinds, name, process_set)
            grads = [layouts.conform(g, k, None if variables is None else variables[i],
                                     f"{name}.{i}") for i, (g, k) in enumerate(zip(grads, kinds))]
            dense_idx = [i for i, k in enumerate(kinds) if k == layouts.DENSE]
            members, hint = [grads[i] for i in dense_idx], None
        else:
            # Traced: every position takes part, a missing or sparse one as an empty
            # placeholder, so ranks that traced different layouts fail clearly, not hang.
            dense_idx = list(range(len(grads)))
            members = [tf.convert_to_tensor(g) if k == layouts.DENSE else layouts.placeholder(k)
                       for g, k in zip(grads, kinds)]
            hint = layouts.mismatch_hint(kinds, variables, name)
        out = [None] * len(grads)
        if members:
            # Fixed names (position in the gradient list): deterministic on every rank, eagerly
            # and in tf.function, and stable across steps for the core's response cache.  The
            # group goes first: inside tf.function a mismatch then stops the step before any
            # sparse reduction starts.
            compressed = [compression.compress(m) for m in members]
            reduced = differentiable_allreduce([c for c, _ in compressed], name, op, prescale,
                                               postscale, process_set, grouped=True,
                                               mismatch_hint=hint)
            for i, r, (_, ctx) in zip(dense_idx, reduced, compressed):
                if kinds[i] == layouts.DENSE:
                    out[i] = compression.decompress(r, ctx)
        for i, k in enumerate(kinds):
            if k in (layouts.SPARSE32, layouts.SPARSE64):
                # Without the predivide split (prescale * postscale == 1): allreduce refuses
                # scale factors for tf.IndexedSlices, as Horovod's does, where Horovod's tape
                # then fails.
                out[i] = allreduce(grads[i], op=op, name=f"{name}.sparse.{i}",
                                   compression=compression, process_set=process_set)
        return out

    return allreduce_grads


def _divided(grad, n: int):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
    return grad / n


class _DistributedGradientTape(tf.GradientTape):
    """A GradientTape whose ``gradient()`` returns gradients averaged across ranks."""

    def _hvd_setup(self, allreduce_grads):
        self._hvd_allreduce_grads = allreduce_grads
        self._hvd_local = LocalVariables()

    def register_local_source(self, source) -> None:
        """Mark ``source`` (a variable or watched tensor) as local to this rank: its gradient
        is returned without any collective (divided by the number of ranks when the tape was
        made with ``scale_local_gradients=True``, the default), as in Horovod."""
        self._hvd_local.add(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """Gradients of ``target`` averaged across ranks (local sources excepted); Horovod's
        signature (``unconnected_gradients`` is hvdlite's addition, last).
        ``use_generic_names`` is accepted for Horovod compatibility: collectives are always
        named by position, which is already generic and identical on every rank."""
        gradients = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(gradients)
        reduced = self._hvd_allreduce_grads(flat, tf.nest.flatten(sources), self._hvd_local)
        return tf.nest.pack_sequence_as(gradients, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """``gradient()``, split as Horovod's tape does: ``(local, global)``, two lists of
        ``(source, gradient)`` pairs, local sources (``register_local_source``) first."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if s in self._hvd_local else shared).append((s, g))
        return local, shared


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
    A gradient that is None on some ranks only (the loss did not reach its variable there) is
    averaged with zeros from those ranks when run eagerly (the ranks agree on each gradient's
    layout first, with one small allreduce); inside ``tf.function`` ranks whose traces differ
    that way get a TensorMismatchError naming the gradients.  A gradient no rank has stays
    None.
    ``compression``: ``Compression.fp16`` sends float gradients as float16;
    ``Compression.powersgd(...)`` sends low-rank factors (docs/compression.md; its state is
    kept across the tapes made every step, per process set and settings).
    ``process_set``: average over the ranks of this set only; ranks outside it get their local
    gradients unchanged (Horovod's behaviour).
    ``num_groups``/``groups`` are accepted for compatibility: every gradient already travels in
    one group that the core fuses.  ``device_dense``/``device_sparse`` are ignored (CPU only).
    ``tape.register_local_source(var)`` keeps ``var``'s gradient local (model parallelism; see
    :func:`PartialDistributedGradientTape`); ``scale_local_gradients`` (default True) divides
    such gradients by the process set's size, as Horovod does.
    """
    check_groups(num_groups, groups)
    check_process_set(process_set)
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_setup(make_allreduce_grads_fn("DistributedGradientTape.allreduce", compression,
                                            sparse_as_dense, op, gradient_predivide_factor,
                                            process_set, scale_local_gradients,
                                            state_outlives_fn=True))
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=ReduceOp.Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A :func:`DistributedGradientTape` that leaves the gradients of ``local_layers`` (a
    Keras layer or a collection of them: model-parallel parts whose weights differ per rank)
    un-reduced, as Horovod's API of the same name.  Their gradients are divided by the process
    set's size when ``scale_local_gradients`` is True (the default), so that they are on the
    scale of the averaged ones.  Every rank must have the same number of non-local gradients.
    Without ``local_layers`` it is exactly a DistributedGradientTape."""
    local_vars = local_layer_variables(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for v in local_vars:
        tape.register_local_source(v)
    return tape
