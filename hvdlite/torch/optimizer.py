"""DistributedOptimizer: averages gradients across ranks while backward is still running.

A post-accumulate-grad hook on every parameter starts that gradient's allreduce the moment its
gradient is complete, so communication overlaps the rest of the backward pass.  At the end of
that backward pass (autograd's final callback, as in torch's DDP) the reductions are waited for
and written into ``.grad``, so anything that reads the gradients before ``step()`` (GradScaler's
unscale_ and overflow check, clip_grad_norm_, logging) sees the averaged ones; ``step()`` then
runs the wrapped optimizer's own ``step``.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
import zlib

import torch
from torch.autograd import Variable

from hvdlite.common import core
from hvdlite.common.core import (HvdliteError, ProcessSet, ReduceOp, check_adasum_size,
                                 predivide_factors, process_set_engine, size)

from . import param_owners
from .buckets import GradientBucket, alone_from, bucketable_compression, plan, wire_dtype
from .compression import Compression
from .state_dicts import load_state_keeping_groups
from .mpi_ops import allreduce, allreduce_async, allreduce_async_
from .sparse import check_sparse_op, sparse_allreduce_async

_TOO_MANY_PASSES = ("Gradients of {name!r} were computed more than backward_passes_per_step="
                    "{n} times before step()/synchronize(). Call optimizer.step() after each "
                    "backward pass, or raise backward_passes_per_step to accumulate gradients "
                    "locally.")


class OptimizerMisuseError(HvdliteError, AssertionError):
    """DistributedOptimizer used out of order: more backward passes than
    ``backward_passes_per_step`` before ``step()``, or ``zero_grad()`` (``load_state_dict()``,
    ...) while reductions are in flight.  Horovod raises ``AssertionError`` for these; this is
    one, and an :class:`HvdliteError` (what hvdlite raised before)."""


_created = itertools.count(1)   # DistributedOptimizers made in this process, in order
_live: "weakref.WeakSet" = weakref.WeakSet()   # every DistributedOptimizer not yet collected


def _after_join(process_set) -> None:
    """hvd.join() on ``process_set`` returned, on every rank of it alike: the optimizers that
    reduce over that set forget their first-step agreements (see ``_forget_first_step``)."""
    joined = process_set_engine(process_set, "join")[0]
    for optimizer in list(_live):
        try:
            engine = process_set_engine(optimizer._process_set, "join")[0]
        except ValueError:   # its process set was removed since: it cannot reduce anyway
            continue
        if engine is joined:
            optimizer._forget_first_step()


core.on_join(_after_join)


def _weak_hook(optimizer):
    """The gradient hook, holding its optimizer weakly.  A hook on a parameter that referred to
    the optimizer (which refers to the parameter) would make a cycle that torch's tensors hide
    from the garbage collector: a dropped model and its optimizer (state included) would never
    be freed."""
    ref = weakref.ref(optimizer)

    def on_grad_ready(p: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad_ready(p)

    return on_grad_ready


def _remove_hooks(handles: dict) -> None:
    for handle in handles.values():
        handle.remove()


# Marks a handle entry whose result is a new sparse gradient (it replaces ``p.grad``) rather
# than a dense wire tensor to decompress into ``p.grad``.
_SPARSE = object()
# Marks a handle entry of a rank without a gradient, waiting to learn which reduction (dense
# or sparse) the other ranks started for that parameter the first time it is reduced.
_LAYOUT_PENDING = object()


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin placed before the user's optimizer class in a generated subclass."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):
        super().__init__(params)
        self._process_set = process_set
        # As in Horovod, on a rank outside process_set this is a plain local optimizer: no
        # hooks, no reductions (synchronize() does nothing).
        self._member = process_set is None or process_set.included()
        self._compression = compression
        self._passes = backward_passes_per_step
        self._op = op
        # (prescale, postscale) of every gradient's reduction: gradient_predivide_factor
        self._scales = predivide_factors(op, gradient_predivide_factor)
        self._sparse_as_dense = sparse_as_dense
        self._given_names = None    # param -> name from named_parameters (None: positional)
        self._index = next(_created)
        self._prefix: str | None = None   # set when another optimizer uses the same names
        self._hook_handles: dict = {}     # param -> its gradient hook's handle
        self._grad_hook = _weak_hook(self)
        weakref.finalize(self, _remove_hooks, self._hook_handles)   # no dead hooks left behind
        self._names = self._names_of(named_parameters)
        self._group_of, self._groups = self._parameter_groups(groups)
        self._names = self._own(self._names)   # after every check: takes hooks over
        self._delay = {p: backward_passes_per_step for p in self._names}
        self._handles: dict = {}            # param -> (handle or None, ctx, wire tensor)
        self._layouts: dict = {}            # param -> sparse_dim of its gradient, 0 = dense
        self._layout_handles: list = []     # this step's layout agreements (first reductions)
        self._group_ready: dict = {}
        # The gradients in .grad are reduced and no hook has fired since (a step() needs no
        # further synchronize()).
        self._fresh = False
        # Parameters reduced since the last step/zero_grad whose gradient has not changed since
        # (a later synchronize must not reduce them again: with op=Sum that would be wrong).
        self._reduced: set = set()
        self._finish_task = None     # autograd graph task whose end finishes the reductions
        self._should_synchronize = True
        self._hook(self._names)
        self._fired = 0              # hooks fired in this backward pass
        self._stream_engine = None   # the engine told that this backward's gradients stream in
        # Small gradients travel in flat buckets (see buckets.py), planned at the end of a
        # successful reduction once the ranks agreed that the gradients are dense.
        self._buckets: list[GradientBucket] = []
        self._bucket_of: dict = {}    # param -> its bucket
        # Parameters the plan leaves to go on their own for reasons that stay true (too large,
        # in a user group, ...); reducing any other one on its own asks for a new plan.
        self._settled: set = set()
        self._replan = True
        self._forget_after_reduction = False   # (hvd.join() with reductions in flight)
        _live.add(self)

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

    def _own(self, names: dict) -> dict:
        """Take ``names``' parameters over from any earlier optimizer and return their names on
        the wire (``param -> name``): if another live optimizer uses some of these names for
        other parameters, this optimizer's names get the prefix ``allreduce.opt<k>.`` (k-th
        DistributedOptimizer created in the process), so their gradients never clash."""
        param_owners.claim(self, names)
        if self._prefix is None and param_owners.names_taken(self, names.values()):
            self._prefix = f"allreduce.opt{self._index}."
        if self._prefix is None:
            return names
        return {p: self._prefix + name[len("allreduce."):] for p, name in names.items()}

    def _hook(self, params) -> None:
        """Start each parameter's allreduce from its gradient hook (parameters that need no
        gradient now get none; ``synchronize()`` reduces them if they need one later)."""
        if not self._member:
            return
        for p in params:
            if p.requires_grad:
                self._hook_handles[p] = p.register_post_accumulate_grad_hook(self._grad_hook)

    def _release_hook(self, p: torch.Tensor) -> None:
        """A newer optimizer wrapped ``p``: its gradient now starts that one's allreduce.  (This
        optimizer still reduces ``p`` in ``synchronize()`` if it is ever stepped again.)"""
        handle = self._hook_handles.pop(p, None)
        if handle is not None:
            handle.remove()
            self._replan = True   # its bucket would no longer fill up in the hooks

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, with the new parameters' gradients
        averaged like the others (fine-tuning that unfreezes layers as it goes).

        With ``named_parameters`` the new parameters must be among the names given then
        (``model.named_parameters()`` lists frozen layers too); without it they are named by
        position, so every rank must add the same groups in the same order.
        """
        if getattr(self, "_names", None) is None:   # torch's __init__ adds the first groups
            return super().add_param_group(param_group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        new = {p for p in params if p not in self._names}   # (a set: tensors hash by id)
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
        self._names.update(self._own(added))
        for p in added:
            self._delay[p] = self._passes
        self._hook(added)

    def _parameter_groups(self, groups):
        params = list(self._names)
        if groups is None:
            return {}, []
        if isinstance(groups, int):
            if groups <= 0:
                raise ValueError("groups must be a positive int or a list of parameter lists")
            chunks = [params[i::groups] for i in range(groups)]
        else:
            chunks = [list(g) for g in groups]
            known = set(params)
            if any(p not in known for g in chunks for p in g):
                raise ValueError("groups contains a tensor that is not one of the optimizer's "
                                 "parameters.")
        group_of = {}
        for gid, chunk in enumerate(chunks):
            for p in chunk:
                if p in group_of:
                    raise ValueError(f"parameter {self._names[p]!r} appears in two groups.")
                group_of[p] = gid
        return group_of, chunks

    # --- gradient hooks ----------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            self._close_stream()
            raise OptimizerMisuseError(_TOO_MANY_PASSES.format(name=self._names[p],
                                                              n=self._passes))
        self._fired += 1
        expected = len(self._hook_handles)   # hooks that fire in a full backward pass
        if self._stream_engine is None and self._fired < expected:
            self._open_stream()
        elif self._fired >= expected:
            self._close_stream()
        self._delay[p] -= 1
        self._fresh = False
        self._reduced.discard(p)
        if self._delay[p] > 0:
            self._handles[p] = (None, None, None)
            return
        self._finish_at_end_of_backward()
        bucket = self._bucket_of.get(p)
        if bucket is not None:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._submit_bucket(bucket)
            return
        gid = self._group_of.get(p)
        if gid is None:
            self._handles[p] = self._allreduce_grad_async(p)
            return
        # A group is submitted together once all its members are ready, so they are
        # negotiated in the same round and fused into one collective.
        self._handles[p] = (None, None, None)
        ready = self._group_ready.setdefault(gid, set())
        ready.add(p)
        if len(ready) == len(self._groups[gid]):
            for member in self._groups[gid]:
                self._handles[member] = self._allreduce_grad_async(member)
            del self._group_ready[gid]

    def _finish_at_end_of_backward(self) -> None:
        """Once per backward pass that completes some gradient: queue :meth:`_end_of_backward`
        as autograd's final callback (it runs after every hook of the pass).  Not again while
        one is pending: a backward nested in this one (reentrant activation checkpointing runs
        one per checkpointed segment) would otherwise finish at the end of each segment."""
        if self._finish_task is None:
            self._finish_task = torch._C._current_graph_task_id()
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Wait for this backward pass's reductions now, as DDP does, rather than in ``step()``:
        code between backward and step (GradScaler's unscale_ and its overflow check,
        clip_grad_norm_) then reads averaged gradients, the same on every rank, instead of
        racing with reductions still writing into ``.grad``.  Accumulation counts are kept:
        another backward pass before ``step()`` is still refused.  (Queued from inside a nested
        backward pass, this runs at its end, before the rest of the outer pass: the gradients
        still to come are then reduced as zeros, and again at the outer pass's end once they
        arrive on top of those zeros, which gives the same result.)"""
        self._finish_task = None
        if self._in_flight():
            self._reduce_gradients()

    def _in_flight(self) -> bool:
        """Some reduction was started (or a bucket holds gradients waiting for the rest)."""
        return any(h[0] is not None for h in self._handles.values()) or self._buckets_busy()

    def _allreduce_grad_async(self, p: torch.Tensor):
        name = self._names[p]
        if p not in self._layouts:
            pending = self._agree_layout(p, name)
            if pending is not None:
                return pending
        return self._reduce_grad_async(p, name)

    def _reduce_grad_async(self, p: torch.Tensor, name: str):
        if p not in self._settled:
            self._replan = True   # (first reductions, and members of a bucket that could not go)
        if p.grad is None:
            # No gradient on this rank (parameter unused in this step): still take part with
            # zeros, because other ranks may have one and would otherwise wait forever.
            p.grad = self._zero_grad_like(p)
        if p.grad.is_sparse:   # the only sparse work on the dense path: one attribute check
            if not self._sparse_as_dense:
                return self._sparse_allreduce_grad_async(p, name)
            # Horovod's sparse_as_dense: the wire carries a dense gradient; it is made sparse
            # again once reduced (see _sparse_again).
            p.grad = p.grad.to_dense()
        prescale, postscale = self._scale_factors()
        wire, ctx = self._compression.compress(p.grad)
        if not wire.is_contiguous():
            wire = wire.contiguous()
        handle = allreduce_async_(wire, name=name, op=self._op, prescale_factor=prescale,
                                  postscale_factor=postscale, process_set=self._process_set)
        return handle, ctx, wire

    def _agree_layout(self, p: torch.Tensor, name: str):
        """First reduction of ``p``: a rank without a gradient cannot tell whether the others
        start a dense allreduce or a sparse reduction (an embedding that its first batch did
        not use), and guessing wrong leaves every rank waiting for good.  So each rank also
        sends what it has (sparse_dim, 0 = dense, -1 = nothing; the maximum wins).  A rank
        with a gradient goes on at once; one without returns a pending entry that
        ``synchronize()`` resolves.  (With sparse_as_dense every rank sends a dense tensor,
        but a rank without a gradient still learns that the result is to be made sparse.)"""
        grad = p.grad
        code = -1 if grad is None else (grad.sparse_dim() if grad.is_sparse else 0)
        handle = allreduce_async(torch.tensor([code], dtype=torch.int32),
                                 name=f"{name}.layout", op=ReduceOp.Max,
                                 process_set=self._process_set)
        if grad is None:
            return handle, _LAYOUT_PENDING, None
        self._layouts[p] = code
        self._layout_handles.append(handle)
        return None

    def _resolve_layouts(self) -> BaseException | None:
        """Submit the reductions of parameters whose layout this rank had to ask for; wait
        for the other layout agreements.  Returns the first error (raised by the caller after
        everything in flight has been waited for)."""
        first_error = None
        for p, (handle, ctx, _) in list(self._handles.items()):
            if ctx is not _LAYOUT_PENDING:
                continue
            del self._handles[p]
            try:
                code = int(handle.wait()[0])
                if code < 0:   # no rank has a gradient: the reduction would give zeros
                    p.grad = torch.zeros_like(p)
                    continue
                self._layouts[p] = code
                self._handles[p] = self._reduce_grad_async(p, self._names[p])
            except Exception as exc:  # noqa: BLE001 - returned
                first_error = first_error or exc
        handles, self._layout_handles = self._layout_handles, []
        for handle in handles:
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - returned
                first_error = first_error or exc
        return first_error

    def _sparse_allreduce_grad_async(self, p: torch.Tensor, name: str):
        """Allgather-based reduction of a sparse gradient (sparse_as_dense=False).  Compression
        does not apply: it casts dense tensors, and the sparse path sends indices anyway."""
        check_sparse_op(self._op, f"sparse gradient of parameter {name!r}")
        self._layouts[p] = p.grad.sparse_dim()
        # Same factors as the dense path, so a sparse and a dense gradient are scaled alike.
        prescale, postscale = self._scale_factors()
        handle = sparse_allreduce_async(p.grad, name, self._op, self._process_set,
                                        prescale_factor=prescale,
                                        postscale_factor=postscale)
        return handle, _SPARSE, None

    def _scale_factors(self) -> tuple[float, float]:
        """(prescale, postscale) of a gradient's reduction: gradient_predivide_factor."""
        return self._scales

    # --- buckets -----------------------------------------------------------------------------
    def _submit_bucket(self, bucket: GradientBucket) -> None:
        prescale, postscale = self._scale_factors()
        bucket.handle = allreduce_async_(bucket.pack(), name=bucket.name, op=self._op,
                                         prescale_factor=prescale, postscale_factor=postscale,
                                         process_set=self._process_set)

    def _flush_bucket(self, bucket: GradientBucket) -> None:
        """Reduce a bucket whose gradients did not all arrive through the hooks (unused
        parameters get zeros, as on their own).  If some member must not be reduced now
        (already reduced and unchanged since, or no longer requiring a gradient), the others go
        on their own, exactly as without buckets, and the next plan reconsiders the bucket."""
        needed = [p for p in bucket.params if p.requires_grad and p not in self._reduced]
        if len(needed) == len(bucket.params):
            self._submit_bucket(bucket)
        else:
            self._reduce_alone(needed)

    def _reduce_alone(self, params: list) -> None:
        """Members of a bucket reduced each on its own (their layout is known to be dense)."""
        for p in params:
            self._handles[p] = self._reduce_grad_async(p, self._names[p])

    def _buckets_busy(self) -> bool:
        """Some bucket is in flight or has gradients waiting for the rest of it."""
        return any(b.busy for b in self._buckets)

    def _bucket_cap(self) -> int:
        """Largest bucket in bytes; 0: no buckets (Adasum combines each gradient as a whole,
        and a custom compressor sees each gradient by itself)."""
        if self._op == ReduceOp.Adasum or not bucketable_compression(self._compression):
            return 0
        engine = process_set_engine(self._process_set, "DistributedOptimizer")[0]
        return engine.config.gradient_bucket_bytes

    def _plan_buckets(self) -> None:
        """(Re)build the buckets from what every rank agrees on (see buckets.py); called with
        nothing in flight.  Gradients are expected last layer first, so parameters are taken
        in reverse order.  Buckets whose members did not change are kept."""
        self._replan = False
        cap = self._bucket_cap()
        settled, candidates = set(), []
        for p in reversed(list(self._names)):
            if (cap == 0 or p in self._group_of or not p.dtype.is_floating_point
                    or self._wire_bytes(p) >= alone_from(p.device, cap)):
                settled.add(p)
            elif (p in self._hook_handles and p.requires_grad
                  and (self._sparse_as_dense or self._layouts.get(p) == 0)):
                candidates.append(p)
        groups = self._group_into_buckets(candidates, cap)
        if cap and self._names and not self._same_plan_everywhere(groups):
            # The parameters were registered in another order on some rank (a model built by
            # iterating over a set, say): names are what the ranks share, so order by them.
            candidates.sort(key=self._names.__getitem__)
            groups = self._group_into_buckets(candidates, cap)
        kept = {b.layout: b for b in self._buckets}
        stem = len(self._prefix or "allreduce.")
        buckets = []
        for members in groups:
            bucket = kept.get(GradientBucket.signature(members))
            if bucket is None:
                bucket = GradientBucket(
                    f"{self._names[members[0]]}+{len(members) - 1}", members,
                    [self._names[p][stem:] for p in members],
                    wire_dtype(self._compression, members[0].dtype))
            buckets.append(bucket)
        self._buckets = buckets
        self._bucket_of = {p: b for b in buckets for p in b.params}
        self._settled = settled | {p for p in candidates if p not in self._bucket_of}

    def _wire_bytes(self, p: torch.Tensor) -> int:
        return p.numel() * wire_dtype(self._compression, p.dtype).itemsize

    def _group_into_buckets(self, candidates: list, cap: int) -> list[list[torch.Tensor]]:
        items = [((p.device, p.dtype, wire_dtype(self._compression, p.dtype)), self._wire_bytes(p))
                 for p in candidates]
        return [[candidates[i] for i in indices] for indices in plan(items, cap)]

    def _same_plan_everywhere(self, groups: list) -> bool:
        """One tiny allreduce: did every rank plan the same buckets?  (The maxima of the digest
        d and of 2**32 - d sum to 2**32 exactly when every rank has the same d; a rank that
        has joined contributes zeros, which change neither maximum.)"""
        text = "\n".join(",".join(f"{self._names[p]}:{tuple(p.shape)}:{p.dtype}" for p in g)
                         for g in groups)
        digest = zlib.crc32(text.encode())
        maxima = allreduce(torch.tensor([digest, 2**32 - digest], dtype=torch.int64),
                           name=f"{min(self._names.values())}.bucket_plan",
                           op=ReduceOp.Max, process_set=self._process_set)
        return int(maxima[0]) + int(maxima[1]) == 2**32

    def _open_stream(self) -> None:
        """Tell the engine that more gradients follow this one (see Engine.stream_open)."""
        engine = process_set_engine(self._process_set, "DistributedOptimizer")[0]
        engine.stream_open()
        self._stream_engine = engine

    def _close_stream(self) -> None:
        """The backward pass is over (or abandoned): count its hooks afresh next time."""
        self._fired = 0
        engine, self._stream_engine = self._stream_engine, None
        if engine is not None:
            engine.stream_close()

    def _zero_grad_like(self, p: torch.Tensor) -> torch.Tensor:
        """Zero gradient for a parameter unused on this rank.  A parameter whose gradient is
        sparse (seen here, or agreed with the other ranks) contributes an empty sparse tensor,
        so that it joins the other ranks' sparse reduction instead of starting a dense one they
        never match."""
        sparse_dim = self._layouts.get(p, 0)
        if sparse_dim == 0 or self._sparse_as_dense:
            return torch.zeros_like(p)
        indices = torch.empty((sparse_dim, 0), dtype=torch.int64)
        values = p.detach().new_empty((0, *p.shape[sparse_dim:]))
        return torch.sparse_coo_tensor(indices, values, p.shape, is_coalesced=True,
                                       check_invariants=False)

    # --- public API --------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Make sure ``.grad`` holds the averaged gradients (Horovod's method, used before
        gradient clipping with ``skip_synchronize()``).

        The backward pass already did this when it completed the gradients' accumulation (see
        the module docstring); then this only lets a further backward pass follow before
        ``step()``, as in Horovod.  Otherwise it reduces now, including gradients whose hook
        did not fire (unused parameters, or fewer backward passes than
        ``backward_passes_per_step``), so all ranks stay in step.  If one reduction fails (e.g.
        a shape mismatch across ranks), the others are still waited for and written into
        ``.grad``; then the first error is raised, and nothing stays in flight.
        """
        if not self._member:
            return
        if not self._fresh:
            self._reduce_gradients()
        self._restart_counts()

    def _reduce_gradients(self) -> None:
        """Reduce every gradient not yet in flight, wait for all, write them into ``.grad``."""
        self._close_stream()   # parameters without a gradient never fire their hooks
        self._finish_task = None   # (a backward that raised never ran its final callback)
        bucket_of = self._bucket_of
        for p in self._names:
            if p in bucket_of:
                entry = self._handles.get(p)
                if entry is not None and entry[0] is None:   # a pass short of the count
                    del self._handles[p]
            elif (p.requires_grad and self._handles.get(p, (None,))[0] is None
                    and p not in self._reduced):
                self._handles[p] = self._allreduce_grad_async(p)
        for bucket in self._buckets:
            if bucket.handle is None:
                self._flush_bucket(bucket)
        first_error = None
        reduced_in_buckets = []
        try:
            first_error = self._resolve_layouts()
            for p, (handle, ctx, wire) in self._handles.items():
                try:
                    output = handle.wait()
                except Exception as exc:  # noqa: BLE001 - raised below
                    # Keep waiting for the others: they are still in flight, and a next step
                    # reusing their names (or writing their gradients) would race with them.
                    if first_error is None:
                        first_error = exc
                    continue
                if ctx is _SPARSE:
                    p.grad = output     # new coalesced sparse tensor, identical on all ranks
                    continue
                result = self._compression.decompress(wire, ctx)
                if result is not p.grad:
                    p.grad.copy_(result)
                self._sparse_again(p)
            for bucket in self._buckets:
                if bucket.handle is None:
                    continue
                try:
                    bucket.handle.wait()
                except Exception as exc:  # noqa: BLE001 - raised below
                    if first_error is None:
                        first_error = _in_bucket(exc, bucket)
                    continue
                bucket.unpack()
                for p in bucket.params:
                    self._sparse_again(p)
                reduced_in_buckets.extend(bucket.params)
                if bucket.reshaped is not None:   # (on every rank alike: it was reduced)
                    self._replan = True   # a member changed shape: plan for the new one
            if first_error is None:
                self._reduced.update(self._handles)
                self._reduced.update(reduced_in_buckets)
        finally:
            self._handles.clear()
            self._group_ready.clear()
            self._reset_buckets()
        if first_error is not None:
            self._restart_counts()   # nothing is in flight; the next backward starts afresh
            raise first_error
        self._fresh = True
        if self._replan:
            self._plan_buckets()
        if self._forget_after_reduction:
            self._forget_first_step()

    def _sparse_again(self, p: torch.Tensor) -> None:
        """sparse_as_dense, as in Horovod: a sparse gradient, reduced densely, is made sparse
        again (``to_sparse()``: every dimension sparse, exact zeros left out) before the update,
        so optimizers that take only sparse gradients (``SparseAdam``) work.  On a rank without
        a gradient of its own it becomes sparse too (Horovod leaves that one dense): the ranks
        agreed on the layout the first time the parameter was reduced."""
        if self._sparse_as_dense and self._layouts.get(p, 0) > 0 and not p.grad.is_sparse:
            p.grad = p.grad.to_sparse()

    def _forget_first_step(self) -> None:
        """Called when hvd.join() has returned on every rank of this optimizer's set.  A rank
        that joined before this optimizer's first step never made the first-step agreements
        (each gradient's layout, then the bucket plan) that the other ranks made with its
        zeros, so every rank forgets them and the next step makes them again, on every rank
        together: one step per gradient, as the first, then buckets again."""
        # A backward pass that raised half-way left reductions in flight: they are finished by
        # the next synchronize(), and forgotten after it.
        self._forget_after_reduction = self._in_flight()
        if self._forget_after_reduction:
            return
        self._layouts.clear()
        self._settled = set()
        self._buckets, self._bucket_of = [], {}
        self._replan = True

    def _reset_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.handle = None
            bucket.reshaped = None

    def _restart_counts(self) -> None:
        self._reduced.clear()
        for p in self._delay:
            self._delay[p] = self._passes

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
        if closure is not None and self._should_synchronize:
            # A backward before step(closure): finish its reductions.
            if self._handles or self._buckets_busy():
                self.synchronize()
            self._fresh = False
            result = super().step(self._averaging(closure))
        else:
            if self._should_synchronize and not self._fresh:
                self.synchronize()
            result = super().step(closure)
        self._fresh = False
        self._restart_counts()
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
            self._fresh = False
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
        self._refuse_in_flight("set_backward_passes_per_step()")
        self._passes = passes
        self._restart_accumulation()

    def load_state_dict(self, state_dict) -> None:
        """Load the wrapped optimizer's state; backward passes accumulated so far towards the
        next reduction are forgotten (as in Horovod), so a restored checkpoint starts a fresh
        accumulation.  The loaded hyper-parameters go into the existing param-group dicts, so
        a learning-rate scheduler made for the unwrapped optimizer keeps working."""
        self._refuse_in_flight("load_state_dict()")
        self._restart_accumulation()
        self._fresh = False
        # (into the param-group dicts it shares with the optimizer it wraps, see there)
        load_state_keeping_groups(self, state_dict, super().load_state_dict)

    def _restart_accumulation(self) -> None:
        self._close_stream()
        self._handles.clear()
        self._group_ready.clear()
        self._reset_buckets()
        self._restart_counts()

    def _refuse_in_flight(self, what: str) -> None:
        flying = [self._names[p] for p, h in self._handles.items() if h[0] is not None]
        flying += [self._names[p] for b in self._buckets if b.busy for p in b.params]
        if flying:
            shown = ", ".join(repr(n) for n in flying[:3]) + (", ..." if len(flying) > 3 else "")
            raise OptimizerMisuseError(
                f"optimizer.{what} was called while the allreduces of {len(flying)} of its "
                f"gradients ({shown}) were in flight: a backward pass started them and did not "
                f"complete (it raised), so they were not finished at its end. That would race "
                f"with them. Call optimizer.synchronize() first (on every rank) to finish them.")

    def zero_grad(self, set_to_none: bool = True):
        self._refuse_in_flight("zero_grad()")
        # A backward left unfinished (an error, unused parameters and no step) must not keep
        # the engine gathering.
        self._close_stream()
        self._reduced.clear()
        if self._fresh:
            # Reduced gradients discarded without a step(): a GAN's discriminator after the
            # generator's backward, or a step GradScaler skipped.  The next backward starts
            # a new accumulation.
            self._fresh = False
            self._restart_counts()
        return super().zero_grad(set_to_none=set_to_none)


def _in_bucket(exc: BaseException, bucket: GradientBucket) -> BaseException:
    """``exc`` (of the same type where it can be) with the bucket's parameters named."""
    text = (f"{bucket.describe()}: {exc} (the buckets are planned from the parameters' order, "
            f"shapes and dtypes: every rank must wrap the same model; a shape mismatch here "
            f"means that a member changed shape on some ranks only"
            f"{bucket.describe_reshaped()})")
    try:
        wrapped = type(exc)(text)
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        exc.add_note(text)
        return exc
    wrapped.__cause__ = exc
    return wrapped


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
      compression (Compression): ``Compression.none`` (default), ``Compression.fp16`` or
        ``Compression.bf16``.
      backward_passes_per_step: backward passes to accumulate locally before reducing.
      op: ``Average`` (default) or ``Sum`` (also Min/Max/Product), or ``Adasum``: gradients
        are combined with Adasum (float parameters, a power-of-two number of ranks).  Horovod
        applies Adasum to the parameter deltas of a local step instead; for SGD without
        momentum the two are the same (Adasum is scale-equivariant), for stateful optimizers
        they differ.
      gradient_predivide_factor: with Average, divide by this before the sum and by
        size()/factor after it (helps fp16 range).
      num_groups: split the parameters into that many groups; each group is reduced together.
      groups (int | list[list[torch.nn.Parameter]] | None): the same as an int, or a list of
        lists of parameters, each reduced together.
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
    if op == ReduceOp.Adasum:
        members = (size() if process_set is None or process_set.process_set_id == 0
                   else process_set.size())
        check_adasum_size(members, "DistributedOptimizer(op=Adasum)")
    predivide_factors(op, gradient_predivide_factor)   # (a factor with op != Average raises)
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1.")
    if num_groups and groups is None:
        groups = num_groups
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, groups,
                  sparse_as_dense, process_set)
    wrapped.defaults = optimizer.defaults
    if optimizer.state:
        wrapped.load_state_dict(optimizer.state_dict())
    return wrapped
