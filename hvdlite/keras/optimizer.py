"""``DistributedOptimizer`` for Keras 3 on the JAX and torch backends: a Keras optimizer whose
gradients are reduced across ranks, by the backend's own collectives, before they are applied.

Where the gradients pass (Keras 3.15): every backend's trainer ends in ``BaseOptimizer.apply``
(torch's ``train_step`` calls ``optimizer.apply(grads, weights)``; JAX's jitted ``train_step``
calls ``optimizer.stateless_apply``, which runs ``apply`` on tracers in a stateless scope), and
``apply`` hands the gradients that survive filtering and loss-scale unscaling to
``_backend_apply_gradients``, which clips them (``_clip_gradients``) right before the update.
The wrapper reduces them there: after unscaling and before clipping, as Horovod's Keras wrapper
does (clipping sees the averaged gradients), and with the variables they belong to at hand
(local variables stay unreduced).  On JAX that is inside ``jax.jit``: ``hvdlite.jax``'s
collectives run there as host callbacks into hvdlite's engine, one grouped allreduce per step
under a fixed name, so every rank submits the same collectives in the same order.

``backward_passes_per_step=N`` uses Keras's own gradient accumulation
(``gradient_accumulation_steps=N``): the accumulated gradients are reduced on every N-th pass
(summed over the passes, as Horovod does, or averaged with ``average_aggregated_gradients``).
On torch the passes between run no collective; on JAX Keras computes both branches of its
update in the compiled step, so the allreduce runs on every pass and the update keeps only the
N-th one's result.
"""
from __future__ import annotations

from typing import Any, Iterable

from hvdlite.common import core
from hvdlite.common.core import (Average, ProcessSet, ReduceOp, global_process_set,
                                 predivide_factors, resolve_op)

from .backends import adapter


def process_set_membership(process_set: ProcessSet | None) -> tuple[bool, int]:
    """(is this rank a member, the set's size) of ``process_set`` (None: all ranks)."""
    if process_set is None or process_set.process_set_id == 0:
        return True, core.size()
    ranks = core.get_process_set_ids_and_ranks().get(process_set.process_set_id)
    if ranks is None:
        raise ValueError(f"{process_set!r} is not registered; pass it to "
                         f"hvd.init(process_sets=[...]) or hvd.add_process_set() first.")
    return core.rank() in ranks, len(ranks)


class IdentitySet:
    """Objects (Keras variables) held by identity, like Horovod's ``var.ref()`` sets."""

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self._by_id: dict[int, Any] = {}
        for item in items:
            self.add(item)

    def add(self, item: Any) -> None:
        """Hold ``item`` (holding it keeps its id unique)."""
        self._by_id[id(item)] = item

    def __contains__(self, item: Any) -> bool:
        return id(item) in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)


class GradientReduction:
    """The reduction a DistributedOptimizer applies to a step's gradients: one grouped
    allreduce of the shared ones under a fixed name (the same on every rank and step), local
    ones divided by the set's size when ``scale_local_gradients``."""

    def __init__(self, name: str, compression: Any, op: ReduceOp, gradient_predivide_factor:
                 float, process_set: ProcessSet, scale_local_gradients: bool) -> None:
        self.name = name
        self.bridge = adapter()
        self.compression = compression or self.bridge.Compression.none
        self.op = resolve_op(op)
        self.prescale, self.postscale = predivide_factors(self.op, gradient_predivide_factor)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local = IdentitySet()

    def __call__(self, grads: list, variables: list | None) -> list:
        """The reduced ``grads`` (``variables``: theirs, to find the local ones)."""
        member, set_size = process_set_membership(self.process_set)
        is_local = [variables is not None and v in self.local
                    for v in (variables or [None] * len(grads))]
        shared = [i for i, mine in enumerate(is_local) if not mine]
        out = list(grads)
        trivial = set_size == 1 and self.op in (ReduceOp.Average, ReduceOp.Sum) and (
            self.prescale * self.postscale == 1.0)
        if member and shared and not trivial:
            reduced = self.bridge.grouped_allreduce(
                [grads[i] for i in shared], name=self.name, compression=self.compression,
                op=self.op, prescale_factor=self.prescale, postscale_factor=self.postscale,
                process_set=self.process_set)
            for i, r in zip(shared, reduced, strict=True):   # never a gradient left unreduced
                out[i] = r
        if self.scale_local_gradients:
            out = [g / set_size if mine else g for g, mine in zip(out, is_local)]
        return out


class DistributedOptimizerMixin:
    """Placed before the user's optimizer class in a generated subclass: the gradients of
    every update are reduced across ranks first (see the module docstring)."""

    _hvd_reduction: GradientReduction
    _hvd_passes: int = 1
    _hvd_average_aggregated: bool = False

    def register_local_var(self, var: Any) -> None:
        """Mark ``var`` as local to this rank (model parallelism): its gradient is applied
        without any collective (divided by the number of ranks with
        ``scale_local_gradients=True``, the default), as in Horovod."""
        self._hvd_reduction.local.add(var)

    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        # Remember which model variable each slot (momentum, ...) belongs to, so that the
        # broadcast callback can leave the slots of local variables alone.
        slot = super().add_variable_from_reference(reference_variable, *args, **kwargs)
        self.__dict__.setdefault("_hvd_slot_owners", {})[id(slot)] = reference_variable
        return slot

    def slot_owner(self, slot: Any) -> Any:
        """The model variable that the optimizer variable ``slot`` was made for (None if
        none)."""
        return self.__dict__.get("_hvd_slot_owners", {}).get(id(slot))

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Through __dict__: an attribute set on a Keras optimizer that holds variables is
        # tracked as the optimizer's own (the JAX trainer would then carry them twice).
        self.__dict__["_hvd_variables"] = list(trainable_variables)
        try:
            return super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            self.__dict__["_hvd_variables"] = None

    def _clip_gradients(self, grads):
        grads = list(grads)
        if self._hvd_passes > 1 and not self._hvd_average_aggregated:
            grads = [g * self._hvd_passes for g in grads]   # Keras averages the passes
        grads = self._hvd_reduction(grads, self.__dict__.get("_hvd_variables"))
        return super()._clip_gradients(grads)


def _distributed_class(base: type) -> type:
    # Same name and module as the wrapped class: a saved model records the plain optimizer.
    return type(base.__name__, (DistributedOptimizerMixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__})


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = None,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: ReduceOp = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Return a copy of the Keras optimizer ``optimizer`` (built from its config, as Horovod
    does) whose gradients are reduced (averaged by default) across ranks before being applied,
    in ``model.fit`` (compiled or ``run_eagerly``) and in ``optimizer.apply``.

    ``compression``: the backend adapter's ``hvd.Compression.none``/``fp16``/``bf16``.
    ``backward_passes_per_step=N``: gradients accumulate over N passes and are reduced and
    applied on every N-th, summed (or averaged with ``average_aggregated_gradients=True``).
    ``op``, ``gradient_predivide_factor``, ``process_set``, ``scale_local_gradients`` and
    ``opt.register_local_var(var)`` are as in :mod:`hvdlite.tensorflow.keras`;
    ``device_*``, ``sparse_as_dense`` (Keras 3 gradients are dense), ``num_groups`` and
    ``groups`` (every gradient travels in one group) are accepted for compatibility.
    """
    process_set_membership(process_set)
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    if isinstance(optimizer, DistributedOptimizerMixin):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    base = optimizer.__class__
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError("pass backward_passes_per_step or the optimizer's "
                             "gradient_accumulation_steps, not both")
        config["gradient_accumulation_steps"] = int(backward_passes_per_step)
    return make_distributed(_distributed_class(base).from_config(config), name, compression,
                            gradient_predivide_factor, op, backward_passes_per_step,
                            average_aggregated_gradients, process_set, scale_local_gradients)


def make_distributed(optimizer: Any, name: str | None = None, compression: Any = None,
                     gradient_predivide_factor: float = 1.0, op: ReduceOp = Average,
                     backward_passes_per_step: int = 1,
                     average_aggregated_gradients: bool = False,
                     process_set: ProcessSet = global_process_set,
                     scale_local_gradients: bool = True) -> Any:
    """Turn ``optimizer`` into a DistributedOptimizer in place (its variables and state kept;
    :func:`DistributedOptimizer` makes a copy instead) and return it.  With
    ``backward_passes_per_step > 1`` its ``gradient_accumulation_steps`` must already be that
    number."""
    base = optimizer.__class__
    if not isinstance(optimizer, DistributedOptimizerMixin):
        optimizer.__class__ = _distributed_class(base)
    optimizer.__dict__["_hvd_reduction"] = GradientReduction(
        f"DistributedOptimizer.{name or f'Distributed{base.__name__}'}", compression, op,
        gradient_predivide_factor, process_set, scale_local_gradients)
    optimizer.__dict__["_hvd_passes"] = int(backward_passes_per_step)
    optimizer.__dict__["_hvd_average_aggregated"] = bool(average_aggregated_gradients)
    return optimizer


def local_layer_variables(local_layers: Any) -> list:
    """The trainable variables of ``local_layers`` (a Keras layer, a collection of them, or
    None)."""
    import keras
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("local_layers must be Keras layers, got "
                         f"{[type(layer).__name__ for layer in local_layers]}.")
    return [v for layer in local_layers for v in layer.trainable_weights]


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,
                                local_layers: Any = None, **kwargs: Any) -> Any:
    """A :func:`DistributedOptimizer` (same keyword arguments) that leaves the gradients of
    ``local_layers`` (model-parallel layers whose weights differ per rank) unreduced, divided by
    the process set's size with ``scale_local_gradients=True`` (the default)."""
    opt = DistributedOptimizer(optimizer, name=name, **kwargs)
    for var in local_layer_variables(local_layers):
        opt.register_local_var(var)
    return opt
