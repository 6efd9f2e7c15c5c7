"""DistributedOptimizer: a torch optimizer whose ``step()`` applies gradients averaged across
ranks.

This module is the wrapper: the ``torch.optim.Optimizer`` methods (``step``, ``zero_grad``,
``synchronize``, ``skip_synchronize``, ``load_state_dict``, ``add_param_group``, ...), the
parameters' names, and the :func:`DistributedOptimizer` factory.  The averaging itself, while
backward runs, is its :class:`~.reducer.Reducer`'s (reducer.py: gradient hooks, end of the
backward pass, submissions and waits), with the gradient buckets in buckets.py and the layout
votes in grad_layouts.py.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from hvdlite.common.core import (ProcessSet, ReduceOp, check_adasum_size, predivide_factors,
                                 process_set_engine, size)

from hvdlite.common.core import powersgd_policy

from .cohorts import Cohorts
from .compression import Compression, PowerSGDCompressor
from .mpi_ops import allreduce
from .powersgd_reducer import PowerSGDReducer
from .reducer import OptimizerMisuseError, Reducer  # noqa: F401 - importable here, as before
from .state_dicts import load_state_keeping_groups

_created = itertools.count(1)   # DistributedOptimizers made in this process, in order


class DistributedOptimizerMixin(torch.optim.Optimizer):
    """Mixin placed before the user's optimizer class in the subclass that
    :func:`DistributedOptimizer` generates: ``isinstance(opt, DistributedOptimizerMixin)``
    tells a wrapped optimizer."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):
        super().__init__(params)
        self._process_set = process_set
        # As in Horovod, on a rank outside process_set this is a plain local optimizer: no
        # hooks, no reductions (synchronize() does nothing).
        self._member = process_set is None or process_set.included()
        self._op = op
        self._given_names = None    # param -> name from named_parameters (None: positional)
        self._index = next(_created)
        self._should_synchronize = True
        names = self._names_of(named_parameters)
        reducer_class = (PowerSGDReducer if isinstance(compression, PowerSGDCompressor)
                         else Reducer)
        self._reducer = reducer_class(self._index, backward_passes_per_step, op,
                                predivide_factors(op, gradient_predivide_factor), compression,
                                sparse_as_dense, process_set, Cohorts.from_groups(names, groups),
                                self._member)
        self._reducer.add(names)   # after every check: takes the hooks over

    # --- set-up ------------------------------------------------------------------------------
    def _names_of(self, named_parameters) -> dict:
        """Each parameter's name on the wire (``allreduce.<name>``), checked.  Also sets
        Horovod's ``_parameter_names`` (``{parameter: name}`` as given, or
        ``allreduce.noname.<group>.<index>`` without ``named_parameters``; in name order),
        which scripts read to log or check names."""
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is None:
            names = {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(self.param_groups)
                     for j, p in enumerate(group["params"])}
            self._parameter_names = dict(sorted(names.items(), key=lambda item: item[1]))
            return names
        named = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "pairs, usually model.named_parameters().")
        names = [name for name, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"named_parameters contains duplicate names {dups}; each "
                             f"parameter needs a unique name.")
        self._parameter_names = {p: name for name, p in sorted(named, key=lambda n: n[0])}
        by_param = {p: f"allreduce.{name}" for name, p in named}
        self._given_names = by_param   # also names parameter groups added later
        unnamed = [i for i, p in enumerate(all_params) if p not in by_param]
        if unnamed:
            raise ValueError(f"named_parameters was given but {len(unnamed)} of the optimizer's "
                             f"parameters are not in it (positions {unnamed[:10]}); pass "
                             f"named_parameters for the same model the optimizer updates.")
        return {p: by_param[p] for p in all_params}

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, with the new parameters' gradients
        averaged like the others (fine-tuning that unfreezes layers as it goes).

        With ``named_parameters`` the new parameters must be among the names given then
        (``model.named_parameters()`` lists frozen layers too); without it they are named by
        position, so every rank must add the same groups in the same order.
        """
        reducer = getattr(self, "_reducer", None)
        if reducer is None:   # torch's __init__ adds the first groups
            return super().add_param_group(param_group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        new = {p for p in params if p not in reducer.names}   # (a set: tensors hash by id)
        if self._given_names is not None:
            unnamed = [i for i, p in enumerate(params)
                       if p in new and p not in self._given_names]
            if unnamed:
                raise ValueError(
                    f"add_param_group: {len(unnamed)} of the new parameters (positions "
                    f"{unnamed[:10]}) are not in the named_parameters given to "
                    f"DistributedOptimizer, so they have no name to match across ranks; pass "
                    f"model.named_parameters() for the whole model when wrapping.")
        super().add_param_group({**param_group, "params": params})
        group_index = len(self.param_groups) - 1
        added = {p: (self._given_names[p] if self._given_names is not None
                     else f"allreduce.noname.{group_index}.{j}")
                 for j, p in enumerate(params) if p in new}
        if self._given_names is None:
            self._parameter_names.update(added)
        reducer.add(added)

    # --- public API --------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Make sure ``.grad`` holds the averaged gradients (Horovod's method, used before
        gradient clipping with ``skip_synchronize()``).

        The backward pass already did this when it completed the gradients' accumulation (see
        reducer.py); then this only lets a further backward pass follow before ``step()``, as
        in Horovod.  Otherwise it reduces now, including gradients whose hook did not fire
        (unused parameters, or fewer backward passes than ``backward_passes_per_step``), so all
        ranks stay in step.  If one reduction fails (e.g. a shape mismatch across ranks), the
        others are still waited for and written into ``.grad``; then the first error is raised,
        and nothing stays in flight.
        """
        if not self._member:
            return
        reducer = self._reducer
        if not reducer.fresh:
            reducer.reduce_gradients()
        reducer.restart_counts()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this context ``step()`` does not synchronize; use it after calling
        ``synchronize()`` yourself (e.g. to clip the averaged gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Apply the averaged gradients with the wrapped optimizer's ``step`` (reducing them
        first unless the backward pass or ``synchronize()`` already did, or inside
        ``skip_synchronize()``).  Gradients already reduced are never reduced twice."""
        if not self._member:   # a rank outside the process set: a plain local step
            return super().step(closure)
        reducer = self._reducer
        if closure is not None and self._should_synchronize:
            # A backward before step(closure): finish its reductions.
            if reducer.pending():
                self.synchronize()
            reducer.fresh = False
            result = super().step(self._averaging(closure))
        else:
            if self._should_synchronize and not reducer.fresh:
                self.synchronize()
            result = super().step(closure)
        reducer.fresh = False
        reducer.restart_counts()
        return result

    def _averaging(self, closure):
        """``closure`` (which computes the loss and its gradients; torch optimizers call it
        inside ``step``, LBFGS several times) followed by this optimizer's reduction, so the
        optimizer reads averaged gradients; the loss it returns is averaged across ranks too
        (summed with op=Sum), so that decisions taken on it (LBFGS's line search and
        tolerances) are the same on every rank and every rank evaluates equally often."""
        def evaluate():
            loss = closure()
            self.synchronize()
            self._reducer.fresh = False
            if isinstance(loss, torch.Tensor):
                op = ReduceOp.Sum if self._op == ReduceOp.Sum else ReduceOp.Average
                loss = allreduce(loss.detach(), name=f"DistributedOptimizer.{self._index}.loss",
                                 op=op, process_set=self._process_set)
            return loss

        return evaluate

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's method: reduce gradients every ``passes`` backward passes from now on.
        Backward passes already accumulated towards the next reduction are forgotten (their
        gradients stay in ``.grad`` until ``zero_grad()``)."""
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1.")
        reducer = self._reducer
        reducer.refuse_in_flight("set_backward_passes_per_step()")
        reducer.passes = passes
        reducer.restart_accumulation()

    def load_state_dict(self, state_dict) -> None:
        """Load the wrapped optimizer's state; backward passes accumulated so far towards the
        next reduction are forgotten (as in Horovod), so a restored checkpoint starts a fresh
        accumulation.  The loaded hyper-parameters go into the existing param-group dicts, so
        a learning-rate scheduler made for the unwrapped optimizer keeps working."""
        reducer = self._reducer
        reducer.refuse_in_flight("load_state_dict()")
        reducer.restart_accumulation()
        reducer.fresh = False
        # (into the param-group dicts it shares with the optimizer it wraps, see there)
        load_state_keeping_groups(self, state_dict, super().load_state_dict)

    def zero_grad(self, set_to_none: bool = True):
        self._reducer.before_zero_grad()
        return super().zero_grad(set_to_none=set_to_none)


# Horovod's name for the class (``horovod.torch.optimizer._DistributedOptimizer``), kept as an
# alias for scripts that test ``isinstance`` with it.
_DistributedOptimizer = DistributedOptimizerMixin


def _outside(process_set) -> bool:
    """This rank is not a member of the registered ``process_set``."""
    return (isinstance(process_set, ProcessSet) and process_set.process_set_id is not None
            and process_set.process_set_id != 0 and not process_set.included())


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp = ReduceOp.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Args:
      optimizer: the ``torch.optim.Optimizer`` to wrap.
      named_parameters (Iterable[tuple[str, torch.nn.Parameter]] | None):
        ``model.named_parameters()``; names identify gradients across ranks
        (without it, parameters are named by position, which must then match on all ranks).
      compression (Compression): ``Compression.none`` (default), ``Compression.fp16``,
        ``Compression.bf16``, or ``Compression.powersgd(rank=..., ...)``: low-rank (PowerSGD)
        gradients, op Average or Sum only (see docs/compression.md).
      backward_passes_per_step: backward passes to accumulate locally before reducing.
      op: ``Average`` (default) or ``Sum`` (also Min/Max/Product), or ``Adasum``: gradients
        are combined with Adasum (float parameters, a power-of-two number of ranks).  Horovod
        applies Adasum to the parameter deltas of a local step instead; for SGD without
        momentum the two are the same (Adasum is scale-equivariant), for stateful optimizers
        they differ.
      gradient_predivide_factor: with Average, divide by this before the sum and by
        size()/factor after it (helps fp16 range).
      num_groups: split the parameters into that many groups; the allreduces of a group's
        gradients are submitted together once all of them are ready (negotiated in one
        round and fused; see cohorts.py).
      groups (int | list[list[torch.nn.Parameter]] | None): the same as an int, or a list of
        lists of parameters, each such a group.
      sparse_as_dense: how sparse gradients (``nn.Embedding(sparse=True)``, ...) are reduced.
        True (as in Horovod): converted to dense and allreduced like any other gradient, then
        turned back into a sparse tensor (``to_sparse()``, every dimension sparse) before the
        update, so ``SparseAdam`` works.  False
        (default): the non-zero rows of every rank are allgathered (see
        :func:`hvdlite.torch.sparse_allreduce_async`) and ``.grad`` becomes the reduced,
        coalesced sparse tensor at ``synchronize()``/``step()`` (optimizers such as SGD and
        ``SparseAdam`` accept it); only op Average/Sum (anything else raises ``ValueError``
        when the gradient is reduced), ``compression`` is not applied to it, and
        ``gradient_predivide_factor`` scales its values like a dense gradient's.  A rank
        without a gradient for such a parameter joins in with an empty sparse one.  (The first
        time each parameter is reduced, the ranks also agree on its layout, dense or sparse,
        with one tiny allreduce, so that a rank without a gradient joins the right reduction;
        a rank without one then waits for that agreement in ``synchronize()``.  When no rank
        has a gradient, ``.grad`` becomes zeros without any data reduction.)
      process_set (ProcessSet | None): reduce gradients only among this process set's ranks
        (every member wraps its optimizer with the same set); Average divides by the set's size.
        On a rank outside the set the result is, as in Horovod, a plain local optimizer: no
        reductions, and ``synchronize()`` does nothing.

    The result is an instance of the original optimizer's class (``isinstance`` holds) and
    works with LR schedulers, ``state_dict()`` and ``load_state_dict()``.  Parameter groups
    added later with ``add_param_group`` are reduced too (see its docstring).  ``step(closure)``
    averages the gradients (and the returned loss) of every closure evaluation, LBFGS's
    included.
    """
    if process_set is not None and not _outside(process_set):
        # type and registration checked up front (a non-member becomes a local optimizer)
        process_set_engine(process_set, "DistributedOptimizer(process_set=...)")
    if isinstance(compression, PowerSGDCompressor):
        powersgd_policy.check_op(op)
    if op == ReduceOp.Adasum:
        members = (size() if process_set is None or process_set.process_set_id == 0
                   else process_set.size())
        check_adasum_size(members, "DistributedOptimizer(op=Adasum)")
    predivide_factors(op, gradient_predivide_factor)   # (a factor with op != Average raises)
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1.")
    if num_groups and groups is None:
        groups = num_groups
    cls = type(optimizer.__class__.__name__, (DistributedOptimizerMixin, optimizer.__class__),
               {})
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, groups,
                  sparse_as_dense, process_set)
    wrapped.defaults = optimizer.defaults
    if optimizer.state:
        wrapped.load_state_dict(optimizer.state_dict())
    return wrapped
