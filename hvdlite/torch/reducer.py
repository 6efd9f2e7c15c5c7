"""The gradient Reducer of a DistributedOptimizer: it averages gradients across ranks while
backward is still running (torch's DDP keeps its ``Reducer`` apart from the module wrapper in
the same way).

A post-accumulate-grad hook on every parameter starts that gradient's allreduce the moment its
gradient is complete (or, for a small gradient, adds it to its bucket: the bucket's last
gradient starts one allreduce of them all, see buckets.py), so communication overlaps the rest
of the backward pass.  At the end of that backward pass (autograd's final callback, as in
torch's DDP) the reductions are waited for and written into ``.grad``, so anything that reads
the gradients before ``step()`` (GradScaler's unscale_ and overflow check, clip_grad_norm_,
logging) sees the averaged ones.

The hooks, the bucket packing and the end of the backward pass run for every gradient of every
step: they keep to local state and bound methods.
"""
from __future__ import annotations

import weakref

import torch
from torch.autograd import Variable

from hvdlite.common import core
from hvdlite.common.core import HvdliteError, process_set_engine

from . import param_owners
from .buckets import GradientBucket, bucket_cap, goes_alone, in_bucket, plan_buckets
from .cohorts import Cohorts
from .grad_layouts import LAYOUT_PENDING, GradLayouts
from .mpi_ops import allreduce_async_
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


_live: "weakref.WeakSet" = weakref.WeakSet()   # every Reducer not yet collected


def _after_join(process_set) -> None:
    """hvd.join() on ``process_set`` returned, on every rank of it alike: the reducers over
    that set forget their first-step agreements (see ``Reducer.forget_first_step``)."""
    joined = process_set_engine(process_set, "join")[0]
    for reducer in list(_live):
        try:
            engine = process_set_engine(reducer.process_set, "join")[0]
        except ValueError:   # its process set was removed since: it cannot reduce anyway
            continue
        if engine is joined:
            reducer.forget_first_step()


core.on_join(_after_join)


# Marks a handle entry whose result is a new sparse gradient (it replaces ``p.grad``) rather
# than a dense wire tensor to decompress into ``p.grad``.
_SPARSE = object()


class Reducer:
    """Reduces the gradients of one DistributedOptimizer's parameters (see the module
    docstring).  ``names`` is filled by :meth:`add`; ``cohorts`` are the parameters whose
    allreduces are submitted together (see cohorts.py)."""

    def __init__(self, index: int, passes: int, op, scales: tuple[float, float], compression,
                 sparse_as_dense: bool, process_set, cohorts: Cohorts, member: bool) -> None:
        self.index = index                 # this optimizer's number in the process
        self.prefix: str | None = None     # set when another optimizer uses the same names
        self.names: dict = {}              # param -> its name on the wire
        self.passes = passes               # backward_passes_per_step
        self.process_set = process_set
        self.op = op
        self.compression = compression
        # (prescale, postscale) of every gradient's reduction: gradient_predivide_factor
        self.prescale, self.postscale = scales
        self._sparse_as_dense = sparse_as_dense
        # As in Horovod, on a rank outside process_set there are no hooks and no reductions.
        self._member = member
        self._cohorts = cohorts
        self._cohort_of = cohorts.of   # (read by every hook: one lookup fewer)
        self.hook_handles: dict = {}       # param -> its gradient hook's handle
        self._grad_hook = param_owners.gradient_hook(self)
        param_owners.unhook_when_collected(self, self.hook_handles)
        self.passes_left: dict = {}             # param -> backward passes until its reduction
        self.handles: dict = {}            # param -> (handle or None, ctx, wire tensor)
        self.grad_layouts = GradLayouts(sparse_as_dense, process_set)
        self.layouts = self.grad_layouts.known   # param -> sparse_dim of its gradient, 0 dense
        # The gradients in .grad are reduced and no hook has fired since (a step() needs no
        # further synchronize()).
        self.fresh = False
        # Parameters reduced since the last step/zero_grad whose gradient has not changed since
        # (a later synchronize must not reduce them again: with op=Sum that would be wrong).
        self.reduced: set = set()
        self.finish_task = None     # autograd graph task whose end finishes the reductions
        self._fired = 0              # hooks fired in this backward pass
        self._stream_engine = None   # the engine told that this backward's gradients stream in
        # Small gradients travel in flat buckets (see buckets.py), planned at the end of a
        # successful reduction once the ranks agreed that the gradients are dense.
        self.buckets: list[GradientBucket] = []
        self.bucket_of: dict = {}    # param -> its bucket
        # Parameters the plan leaves to go on their own for reasons that stay true (too large,
        # in a user group, ...); reducing any other one on its own asks for a new plan.
        self._settled: set = set()
        self.replan = True
        self._forget_after_reduction = False   # (hvd.join() with reductions in flight)
        _live.add(self)

    # --- parameters --------------------------------------------------------------------------
    def add(self, names: dict) -> None:
        """Take ``names``' parameters (``param -> allreduce.<name>``) over from any earlier
        optimizer (see param_owners.take_over) and start each one's reduction from its
        gradient hook."""
        names, self.prefix = param_owners.take_over(self, names, self.prefix, self.index)
        self.names.update(names)
        for p in names:
            self.passes_left[p] = self.passes
        if self._member:
            param_owners.hook(names, self._grad_hook, self.hook_handles)

    def release_hook(self, p: torch.Tensor) -> None:
        """A newer optimizer wrapped ``p``: its gradient now starts that one's allreduce.  (This
        optimizer still reduces ``p`` in ``synchronize()`` if it is ever stepped again.)"""
        handle = self.hook_handles.pop(p, None)
        if handle is not None:
            handle.remove()
            self.replan = True   # its bucket would no longer fill up in the hooks

    # --- gradient hooks ----------------------------------------------------------------------
    def on_grad_ready(self, p: torch.Tensor) -> None:
        if self.passes_left[p] <= 0:
            self.close_stream()
            raise OptimizerMisuseError(_TOO_MANY_PASSES.format(name=self.names[p],
                                                               n=self.passes))
        self._fired += 1
        expected = len(self.hook_handles)   # hooks that fire in a full backward pass
        if self._stream_engine is None and self._fired < expected:
            self._open_stream()
        elif self._fired >= expected:
            self.close_stream()
        self.passes_left[p] -= 1
        self.fresh = False
        self.reduced.discard(p)
        if self.passes_left[p] > 0:
            self.handles[p] = (None, None, None)
            return
        self.finish_at_end_of_backward()
        bucket = self.bucket_of.get(p)
        if bucket is not None:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._submit_bucket(bucket)
            return
        if p not in self._cohort_of:
            self.handles[p] = self._allreduce_grad_async(p)
            return
        self.handles[p] = (None, None, None)
        members = self._cohorts.complete(p)
        if members is not None:   # the last of its cohort: submit them all now
            for member in members:
                self.handles[member] = self._allreduce_grad_async(member)

    def finish_at_end_of_backward(self) -> None:
        """Once per backward pass that completes some gradient: queue :meth:`_end_of_backward`
        as autograd's final callback (it runs after every hook of the pass).  Not again while
        one is pending: a backward nested in this one (reentrant activation checkpointing runs
        one per checkpointed segment) would otherwise finish at the end of each segment."""
        if self.finish_task is None:
            self.finish_task = torch._C._current_graph_task_id()
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
        self.finish_task = None
        if self.in_flight():
            self.reduce_gradients()

    def in_flight(self) -> bool:
        """Some reduction was started (or a bucket holds gradients waiting for the rest)."""
        return any(h[0] is not None for h in self.handles.values()) or self._buckets_busy()

    def pending(self) -> bool:
        """Some backward pass left something since the last reduction (a reduction started,
        a pass short of the count, a bucket filling up)."""
        return bool(self.handles) or self._buckets_busy()

    # --- submissions -------------------------------------------------------------------------
    def _allreduce_grad_async(self, p: torch.Tensor):
        name = self.names[p]
        if p not in self.layouts:
            pending = self.grad_layouts.vote(p, name)
            if pending is not None:
                return pending, LAYOUT_PENDING, None
        return self._reduce_grad_async(p, name)

    def _reduce_grad_async(self, p: torch.Tensor, name: str):
        if p not in self._settled:
            self.replan = True   # (first reductions, and members of a bucket that could not go)
        if p.grad is None:
            # No gradient on this rank (parameter unused in this step): still take part with
            # zeros, because other ranks may have one and would otherwise wait forever.
            p.grad = self.grad_layouts.zeros_like(p)
        if p.grad.is_sparse:   # the only sparse work on the dense path: one attribute check
            if not self._sparse_as_dense:
                return self._sparse_allreduce_grad_async(p, name)
            # Horovod's sparse_as_dense: the wire carries a dense gradient; it is made sparse
            # again once reduced (see GradLayouts.sparse_again).
            p.grad = p.grad.to_dense()
        wire, ctx = self.compression.compress(p.grad)
        if not wire.is_contiguous():
            wire = wire.contiguous()
        handle = allreduce_async_(wire, name=name, op=self.op, prescale_factor=self.prescale,
                                  postscale_factor=self.postscale,
                                  process_set=self.process_set)
        return handle, ctx, wire

    def _sparse_allreduce_grad_async(self, p: torch.Tensor, name: str):
        """Allgather-based reduction of a sparse gradient (sparse_as_dense=False).  Compression
        does not apply: it casts dense tensors, and the sparse path sends indices anyway."""
        check_sparse_op(self.op, f"sparse gradient of parameter {name!r}")
        self.layouts[p] = p.grad.sparse_dim()
        # Same factors as the dense path, so a sparse and a dense gradient are scaled alike.
        handle = sparse_allreduce_async(p.grad, name, self.op, self.process_set,
                                        prescale_factor=self.prescale,
                                        postscale_factor=self.postscale)
        return handle, _SPARSE, None

    # --- buckets -----------------------------------------------------------------------------
    def _submit_bucket(self, bucket: GradientBucket) -> None:
        bucket.handle = bucket.submit(self.op, self.prescale, self.postscale,
                                      self.process_set)

    def _flush_bucket(self, bucket: GradientBucket) -> None:
        """Reduce a bucket whose gradients did not all arrive through the hooks (unused
        parameters get zeros, as on their own).  If some member must not be reduced now
        (already reduced and unchanged since, or no longer requiring a gradient), the others go
        on their own, exactly as without buckets, and the next plan reconsiders the bucket."""
        needed = [p for p in bucket.params if p.requires_grad and p not in self.reduced]
        if len(needed) == len(bucket.params):
            self._submit_bucket(bucket)
        else:   # (their layout is known to be dense)
            for p in needed:
                self.handles[p] = self._reduce_grad_async(p, self.names[p])

    def _buckets_busy(self) -> bool:
        """Some bucket is in flight or has gradients waiting for the rest of it."""
        return any(b.busy for b in self.buckets)

    def plan_buckets(self) -> None:
        """(Re)build the buckets from what every rank agrees on (see buckets.py); called with
        nothing in flight.  Gradients are expected last layer first, so parameters are taken
        in reverse order.  Buckets whose members did not change are kept."""
        self.replan = False
        cap = bucket_cap(self.op, self.compression, self.process_set)
        settled, candidates = set(), []
        for p in reversed(list(self.names)):
            if p in self._cohort_of or goes_alone(p, cap, self.compression):
                settled.add(p)
            elif (p in self.hook_handles and p.requires_grad
                  and (self._sparse_as_dense or self.layouts.get(p) == 0)):
                candidates.append(p)
        self.buckets = plan_buckets(candidates, cap, self.compression, self.names,
                                    len(self.prefix or "allreduce."), self.buckets,
                                    self.process_set)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._settled = settled | {p for p in candidates if p not in self.bucket_of}

    def _reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.handle = None
            bucket.reshaped = None

    # --- streams -----------------------------------------------------------------------------
    def _open_stream(self) -> None:
        """Tell the engine that more gradients follow this one (see Engine.stream_open)."""
        engine = process_set_engine(self.process_set, "DistributedOptimizer")[0]
        engine.stream_open()
        self._stream_engine = engine

    def close_stream(self) -> None:
        """The backward pass is over (or abandoned): count its hooks afresh next time."""
        self._fired = 0
        engine, self._stream_engine = self._stream_engine, None
        if engine is not None:
            engine.stream_close()

    # --- waiting -----------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Reduce every gradient not yet in flight, wait for all, write them into ``.grad``."""
        self.close_stream()   # parameters without a gradient never fire their hooks
        self.finish_task = None   # (a backward that raised never ran its final callback)
        bucket_of = self.bucket_of
        handles = self.handles
        for p in self.names:
            if p in bucket_of:
                entry = handles.get(p)
                if entry is not None and entry[0] is None:   # a pass short of the count
                    del handles[p]
            elif (p.requires_grad and handles.get(p, (None,))[0] is None
                    and p not in self.reduced):
                handles[p] = self._allreduce_grad_async(p)
        for bucket in self.buckets:
            if bucket.handle is None:
                self._flush_bucket(bucket)
        first_error = None
        reduced_in_buckets = []
        sparse_again = self.grad_layouts.sparse_again if self._sparse_as_dense else None
        try:
            first_error = self.grad_layouts.resolve(handles, self._reduce_grad_async,
                                                    self.names)
            for p, (handle, ctx, wire) in handles.items():
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
                result = self.compression.decompress(wire, ctx)
                if result is not p.grad:
                    p.grad.copy_(result)
                if sparse_again is not None:
                    sparse_again(p)
            for bucket in self.buckets:
                if bucket.handle is None:
                    continue
                try:
                    bucket.handle.wait()
                except Exception as exc:  # noqa: BLE001 - raised below
                    if first_error is None:
                        first_error = in_bucket(exc, bucket)
                    continue
                bucket.unpack()
                if sparse_again is not None:
                    for p in bucket.params:
                        sparse_again(p)
                reduced_in_buckets.extend(bucket.params)
                if bucket.reshaped is not None:   # (on every rank alike: it was reduced)
                    self.replan = True   # a member changed shape: plan for the new one
            if first_error is None:
                self.reduced.update(handles)
                self.reduced.update(reduced_in_buckets)
        finally:
            handles.clear()
            self._cohorts.clear()
            self._reset_buckets()
        if first_error is not None:
            self.restart_counts()   # nothing is in flight; the next backward starts afresh
            raise first_error
        self.fresh = True
        if self.replan:
            self.plan_buckets()
        if self._forget_after_reduction:
            self.forget_first_step()

    def forget_first_step(self) -> None:
        """Called when hvd.join() has returned on every rank of this optimizer's set.  A rank
        that joined before this optimizer's first step never made the first-step agreements
        (each gradient's layout, then the bucket plan) that the other ranks made with its
        zeros, so every rank forgets them and the next step makes them again, on every rank
        together: one step per gradient, as the first, then buckets again."""
        # A backward pass that raised half-way left reductions in flight: they are finished by
        # the next synchronize(), and forgotten after it.
        self._forget_after_reduction = self.in_flight()
        if self._forget_after_reduction:
            return
        self.layouts.clear()
        self._settled = set()
        self.buckets, self.bucket_of = [], {}
        self.replan = True

    # --- accumulation ------------------------------------------------------------------------
    def restart_counts(self) -> None:
        """The next backward pass starts a new accumulation of ``passes`` passes."""
        self.reduced.clear()
        passes = self.passes
        delay = self.passes_left
        for p in delay:
            delay[p] = passes

    def restart_accumulation(self) -> None:
        """Forget the backward passes accumulated towards the next reduction (nothing may be in
        flight: see :meth:`refuse_in_flight`)."""
        self.close_stream()
        self.handles.clear()
        self._cohorts.clear()
        self._reset_buckets()
        self.restart_counts()

    def refuse_in_flight(self, what: str) -> None:
        """Raise OptimizerMisuseError if a reduction is in flight (``what`` would race with
        it)."""
        flying = [self.names[p] for p, h in self.handles.items() if h[0] is not None]
        flying += [self.names[p] for b in self.buckets if b.busy for p in b.params]
        if flying:
            shown = ", ".join(repr(n) for n in flying[:3]) + (", ..." if len(flying) > 3 else "")
            raise OptimizerMisuseError(
                f"optimizer.{what} was called while the allreduces of {len(flying)} of its "
                f"gradients ({shown}) were in flight: a backward pass started them and did not "
                f"complete (it raised), so they were not finished at its end. That would race "
                f"with them. Call optimizer.synchronize() first (on every rank) to finish them.")

    def before_zero_grad(self) -> None:
        """``zero_grad()`` is about to discard the gradients."""
        self.refuse_in_flight("zero_grad()")
        # A backward left unfinished (an error, unused parameters and no step) must not keep
        # the engine gathering.
        self.close_stream()
        self.reduced.clear()
        if self.fresh:
            # Reduced gradients discarded without a step(): a GAN's discriminator after the
            # generator's backward, or a step GradScaler skipped.  The next backward starts
            # a new accumulation.
            self.fresh = False
            self.restart_counts()
