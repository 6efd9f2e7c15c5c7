"""Horovod-compatible synchronous batch normalisation: ``hvd.SyncBatchNorm``.

Batch statistics are computed over the batch of *every* rank (of the process set) together, as if
one ``nn.BatchNorm*d`` saw the concatenation of all ranks' inputs.  The statistics travel in one
small differentiable allreduce, so autograd derives the backward pass (itself one allreduce).
"""
from __future__ import annotations

import itertools

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hvdlite.common.core import ReduceOp, global_moments, global_process_set, moment_sums

from .mpi_ops import allreduce

# Per process set: how many SyncBatchNorm instances have run a synchronised forward pass so far.
_first_use_counters: dict[int, itertools.count] = {}


def _set_id(process_set) -> int:
    return 0 if process_set is None else int(getattr(process_set, "process_set_id", 0))


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose training-mode statistics span all ranks (``horovod.torch``'s
    ``SyncBatchNorm``).

    Accepts any input of shape ``(N, C, ...)``: it replaces ``nn.BatchNorm1d``, ``2d`` and ``3d``
    alike, is an instance of ``torch.nn.modules.batchnorm._BatchNorm`` and has the same
    parameters, buffers and ``state_dict`` keys.  Semantics:

    * In training mode, or whenever running statistics are not tracked, every channel is
      normalised with the mean and biased variance of the union of all ranks' batches.  Ranks
      may hold different batch sizes, including empty ones (an empty input gives an empty
      output).  ``running_mean`` and ``running_var`` are updated with the global mean and the
      global unbiased variance (denominator: total count over all ranks minus one), using
      ``momentum`` like ``nn.BatchNorm`` (``momentum=None``: cumulative average).  Gradients are
      those of one ``nn.BatchNorm`` over the concatenated batch with loss = sum of the ranks'
      losses; the weight and bias gradients are each rank's share, which an allreduce (as
      ``DistributedOptimizer`` does) combines.
    * In eval mode with running statistics it is plain ``F.batch_norm``, without communication;
      with a single rank in the process set it is exactly ``nn.BatchNorm``.
    * A synchronised forward pass is a collective: every rank must run it the same number of
      times and in the same order relative to other collectives, and the backward pass through
      it (also a collective) must likewise run on every rank or on none.  A rank with no data
      must still call forward, with an empty ``(0, C, ...)`` batch.
    * ``process_set`` restricts the synchronisation to that set's ranks (``None``: all ranks).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_set=None,
                 *, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set
        self._allreduce_name: str | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (N, C, ...), got "
                             f"{input.dim()}D input")
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels (dimension 1), got input "
                             f"of shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        use_batch_stats = self.training or (self.running_mean is None
                                            and self.running_var is None)
        if not use_batch_stats or (self.process_set or global_process_set).size() == 1:
            return super().forward(input)   # nn.BatchNorm's own path; no communication
        self._check_input_dim(input)
        factor = 0.0
        update = self.training and self.track_running_stats and self.running_mean is not None
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        elif self.momentum is not None:
            factor = self.momentum

        mean, var, count = self._global_stats(input)
        if count == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got 1 in "
                             f"total over all ranks (input size {tuple(input.shape)} here)")
        if update and count > 0:
            with torch.no_grad():
                self.running_mean.mul_(1.0 - factor).add_(mean.to(self.running_mean.dtype),
                                                          alpha=factor)
                unbiased = var * (count / (count - 1))
                self.running_var.mul_(1.0 - factor).add_(unbiased.to(self.running_var.dtype),
                                                         alpha=factor)

        compute = input.dtype if input.dtype in (torch.float32, torch.float64) else torch.float32
        shape = (1, -1) + (1,) * (input.dim() - 2)
        scale = torch.rsqrt(var + self.eps).to(compute)
        if self.weight is not None:
            scale = scale * self.weight.to(compute)
        out = (input.to(compute) - mean.to(compute).view(shape)) * scale.view(shape)
        if self.bias is not None:
            out = out + self.bias.to(compute).view(shape)
        return out.to(input.dtype)

    def _global_stats(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Global per-channel mean and biased variance (float64) and the global count.

        Numerics: each rank reduces its own batch with torch's accurate ``var_mean`` (in float32
        or float64), converts to float64 sums ``n*mean`` and ``n*(var + mean**2)`` and sends them
        with its count in ONE allreduce of ``2C+1`` float64 values; the global variance is then
        ``sumsq/N - mean**2``.  The cancellation in that difference costs about
        ``1e-16 * (mean/std)**2`` relative error: below float32's resolution unless
        ``|mean| > 2e4 * std`` (float64 inputs lose that many digits when ``|mean| >> std``).
        A two-pass scheme (global mean first, then centred squares) would avoid it but doubles
        the collectives on the forward and on the backward path, a latency paid per layer and
        step, so one pass is the better trade for a float32/float16 training op.
        """
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        local = input.numel() // channels if channels else 0
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        if local > 0:
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            sums, sumsq = moment_sums(local, mean.double(), var.double())
        else:   # empty batch: zero contributions, still attached to the graph
            sums = sumsq = x.sum(dim=dims).double()
        count = torch.full((1,), float(local), dtype=torch.float64)
        stats = torch.cat([count, sums, sumsq])
        total = allreduce(stats, op=ReduceOp.Sum, name=self._name(),
                          process_set=self.process_set)
        n = int(total[0].item())
        mean, var = global_moments(max(n, 1), total[1:channels + 1], total[channels + 1:])
        return mean, var.clamp(min=0.0), n

    def _name(self) -> str:
        """This instance's allreduce name, fixed at its first synchronised forward pass.

        Numbering instances in order of first use (per process set) gives every rank the same
        name for the same layer, because that order is part of the collective call order that
        must already agree; a fixed name per layer lets the engine's response cache serve it.
        """
        if self._allreduce_name is None:
            set_id = _set_id(self.process_set)
            number = next(_first_use_counters.setdefault(set_id, itertools.count()))
            self._allreduce_name = f"sync_batch_norm.{set_id}.{number}"
        return self._allreduce_name
