"""The Reducer a DistributedOptimizer uses with ``compression=Compression.powersgd(...)``: it
reduces the step's gradients in PowerSGD's two allreduce phases (see docs/compression.md).

The gradient hooks only count backward passes (``backward_passes_per_step``); once the step's
gradients are complete (end of backward, or ``synchronize()``) every gradient is reduced at
once:

1. before ``start_iter`` steps: one grouped allreduce of all gradients, as without compression;
2. then: the gradients that compress (see hvdlite/common/api/powersgd.py) become P = M Q, all P in
   one grouped allreduce (Sum); the uncompressed ones travel in one flat bucket alongside;
   each P is orthogonalized, Q = M^T P, all Q in a second grouped allreduce (the optimizer's
   op, Average or Sum, and its predivide factors); ``.grad`` becomes P Q^T.

The ordinary per-gradient buckets are not used: the flat bucket and the two grouped allreduces
replace them (each grouped allreduce is negotiated once and fused by the engine).  Nothing is
in flight between steps, so the overlap with backward that the plain path has is given up.
"""
from __future__ import annotations

import torch

from hvdlite.common.core import ReduceOp, process_set_engine
from hvdlite.common.core import powersgd_policy

from .async_ops import allreduce_async_, grouped_allreduce_async_
from .powersgd import PowerSGDState, orthogonalize_
from .reducer import OptimizerMisuseError, Reducer


class Reduced:
    """The handle of a reduction that was complete when it started (a set of one rank)."""

    def wait(self) -> None:
        return None


class PowerSGDReducer(Reducer):
    """A :class:`~.reducer.Reducer` whose reductions are PowerSGD's (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = PowerSGDState(self.compression.config)
        self._ready: set = set()   # parameters whose gradient is complete for this step
        self._alone = False        # this step's process set has one rank (set by _reduce)

    # --- hooks: count passes, reduce at the end of backward ------------------------------------
    def on_grad_ready(self, p: torch.Tensor) -> None:
        if self.passes_left[p] <= 0:
            raise OptimizerMisuseError(
                f"Gradients of {self.names[p]!r} were computed more than "
                f"backward_passes_per_step={self.passes} times before step()/synchronize(). "
                f"Call optimizer.step() after each backward pass, or raise "
                f"backward_passes_per_step to accumulate gradients locally.")
        self.passes_left[p] -= 1
        self.fresh = False
        self.reduced.discard(p)
        self.handles[p] = (None, None, None)   # (pending(): a pass was accumulated)
        if self.passes_left[p] == 0:
            self._ready.add(p)
            self.finish_at_end_of_backward()

    def in_flight(self) -> bool:
        return bool(self._ready)

    def restart_counts(self) -> None:
        super().restart_counts()
        self._ready.clear()

    def plan_buckets(self) -> None:
        self.replan = False   # the PowerSGD plan replaces the per-gradient buckets

    def forget_first_step(self) -> None:
        """After hvd.join(): a joined rank missed steps, so every rank drops Q and the error
        feedback (restarting them alike) and agrees on the step count at the next step."""
        self.state.after_join()

    # --- the reduction -------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Reduce every gradient not yet reduced, PowerSGD's way, into ``.grad``."""
        self.close_stream()
        self.finish_task = None
        params = [p for p in self.names if p.requires_grad and p not in self.reduced]
        try:
            if params:
                self._reduce(params)
        except BaseException:
            self.restart_counts()   # nothing is in flight; the next backward starts afresh
            raise
        finally:
            self.handles.clear()
            self._ready.clear()
        self.reduced.update(params)
        self.fresh = True

    def _ps_kwargs(self) -> dict:
        return {} if self.process_set is None else {"process_set": self.process_set}

    def _name(self, what: str) -> str:
        return f"DistributedOptimizer.{self.index}.powersgd.{what}"

    def _reduce(self, params: list) -> None:
        state = self.state
        engine = process_set_engine(self.process_set, "DistributedOptimizer")[0]
        state.follow(engine)
        self._alone = engine.size == 1
        if state.counter.needs_agreement:
            self._agree_on_count()
        grads = []
        for p in params:
            if p.grad is None:   # unused here: take part with zeros, as without compression
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        if state.counter.compressing:
            self._reduce_compressed(params, grads)
        else:
            self._reduce_plain(grads)
        state.counter.advance()

    def _agree_on_count(self) -> None:
        if self._alone:
            self.state.counter.agree(self.state.counter.steps)
            return
        count = torch.tensor([self.state.counter.steps], dtype=torch.int64)
        allreduce_async_(count, name=self._name("steps"), op=ReduceOp.Max,
                         **self._ps_kwargs()).wait()
        self.state.counter.agree(int(count.item()))

    def _to_wire(self, tensors: list) -> list:
        dtype = self.compression.wire_dtype
        if dtype is None:
            return [t.contiguous() for t in tensors]
        # (the cast keeps a non-contiguous layout unless told otherwise; in place needs contiguous)
        return [t.to(dtype, memory_format=torch.contiguous_format) if t.is_floating_point()
                else t.contiguous() for t in tensors]

    def _identity(self, scaled: bool) -> bool:
        """Whether this step's reduction leaves every tensor as it is: alone in the set, with
        no scaling and no cast to a wire dtype."""
        return self._alone and self.compression.wire_dtype is None and (
            not scaled or self.prescale == self.postscale == 1.0)

    def _allreduce_group(self, tensors: list, what: str, op, scaled: bool):
        """Start one grouped in-place allreduce of ``tensors`` (cast to the wire dtype); returns
        (handle, wire tensors).  Alone in its process set the reduction is the identity, so
        only the scaling is applied, here: no engine round trip for nothing (two or three a
        step, most of PowerSGD's cost on a small model at one rank)."""
        wire = self._to_wire(tensors)
        pre, post = (self.prescale, self.postscale) if scaled else (1.0, 1.0)
        if self._alone:
            for t in wire:
                for factor in (pre, post):
                    if factor != 1.0:
                        t.mul_(factor)
            return Reduced(), wire
        handle = grouped_allreduce_async_(wire, name=self._name(what), op=op,
                                          prescale_factor=pre, postscale_factor=post,
                                          **self._ps_kwargs())
        return handle, wire

    def _reduce_plain(self, grads: list) -> None:
        """Before ``start_iter``: every gradient allreduced as it is (one grouped call)."""
        handle, wire = self._allreduce_group(grads, "plain", self.op, True)
        handle.wait()
        for grad, reduced in zip(grads, wire):
            if reduced is not grad:
                grad.copy_(reduced)

    def _reduce_compressed(self, params: list, grads: list) -> None:
        state = self.state
        names = [self.names[p] for p in params]
        compressed, whole = powersgd_policy.split([g.shape for g in grads], state.config)
        groups = powersgd_policy.groups_by_dtype(whole, [g.dtype for g in grads])
        bucket = None
        if groups and not self._identity(True):
            # vectors and small matrices: one flat bucket, in flight meanwhile
            flats = [torch.cat([grads[i].reshape(-1) for i in group]) for group in groups]
            bucket = self._allreduce_group(flats, "uncompressed", self.op, True)
        try:
            self._power_step([names[i] for i in compressed], [grads[i] for i in compressed])
        finally:
            if bucket is not None:
                handle, wire = bucket
                handle.wait()
                for group, flat in zip(groups, wire):
                    offset = 0
                    for i in group:
                        n = grads[i].numel()
                        grads[i].copy_(flat[offset:offset + n].view_as(grads[i]))
                        offset += n

    def _power_step(self, names: list, grads: list) -> None:
        """P = M Q, allreduce P, orthogonalize, Q = M^T P, allreduce Q, grad = P Q^T."""
        if not grads:
            return
        state = self.state
        started = [state.start(name, g) for name, g in zip(names, grads)]
        ps = [torch.mm(matrix, q) for matrix, q in started]
        handle, wire = self._allreduce_group(ps, "P", ReduceOp.Sum, False)
        handle.wait()
        qs = []
        for (matrix, _), p_wire, name in zip(started, wire, names):
            p = orthogonalize_(p_wire.to(matrix.dtype), state.config.epsilon)
            # (P^T M)^T: the same numbers as M^T P, and several times faster for r > 1 (the
            # transposed product of a large M is slow on the CPU)
            q_local = torch.mm(p.T, matrix).T.contiguous()
            state.finish_local(name, matrix, p, q_local)
            qs.append((p, q_local))
        handle, wire = self._allreduce_group([q for _, q in qs], "Q", self.op, True)
        handle.wait()
        for (p, _), q_wire, name, grad in zip(qs, wire, names, grads):
            state.finish(name, p, q_wire.to(grad.dtype), grad)
