"""PowerSGD's torch arithmetic and per-gradient state (the policy is hvdlite/common/api/powersgd.py,
the orchestration of the two allreduces per step is powersgd_reducer.py).

All of it is torch operations on the gradients' own device, so it runs on GPU tensors too.
Every rank runs the same operations on the same reduced factors, so the factors, and the
gradients rebuilt from them, are bitwise identical across ranks.
"""
from __future__ import annotations

import torch

from hvdlite.common.core import powersgd_policy as policy

PowerSGDConfig = policy.PowerSGDConfig

_DTYPES = {None: None, torch.float16: "float16", torch.bfloat16: "bfloat16",
           "float16": "float16", "bfloat16": "bfloat16", "fp16": "float16", "bf16": "bfloat16"}


class PowerSGDCompressor:
    """What ``Compression.powersgd(...)`` returns: PowerSGD's settings, for
    ``DistributedOptimizer(compression=...)`` only (it needs the optimizer to run two allreduce
    phases per step, so it is no per-tensor compress/decompress pair like fp16).  It keeps no
    state itself: each optimizer keeps its own (Q and error feedback per parameter)."""

    def __init__(self, config: PowerSGDConfig) -> None:
        self.config = config

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype the factors travel as (None: the gradients' own)."""
        return getattr(torch, self.config.wire_dtype) if self.config.wire_dtype else None

    def compress(self, tensor):
        raise TypeError("Compression.powersgd(...) compresses the gradients of a "
                        "DistributedOptimizer only (it needs two allreduces per step); pass it "
                        "as DistributedOptimizer(..., compression=...), not to a collective.")

    decompress = compress

    def __repr__(self) -> str:
        return f"Compression.powersgd({self.config})"


def powersgd(rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
             warm_start: bool = True, error_feedback: bool = True, dtype=None,
             epsilon: float = 0.0, seed: int = 0) -> PowerSGDCompressor:
    """PowerSGD low-rank gradient compression for ``DistributedOptimizer`` (see
    docs/compression.md).

    Args:
      rank: rank of the factors; higher is closer to the exact gradient, and costs more.
      start_iter: optimizer steps that use a plain allreduce before compression starts.
      min_compression_rate: gradients that compression would shrink less than this many times
        (vectors, small matrices) travel uncompressed, all in one allreduce.
      warm_start: start each step's power iteration from the last step's Q.
      error_feedback: add what compression lost to the next step's gradient.
      dtype: ``torch.float16`` or ``torch.bfloat16`` to send the factors (and the uncompressed
        gradients) in that precision; the arithmetic stays in the gradients' dtype.
      epsilon: added to column norms when orthogonalizing (0: exact Gram-Schmidt).
      seed: seed of the random initial Q, the same on every rank.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"powersgd: dtype must be None, torch.float16 or torch.bfloat16, got "
                         f"{dtype!r}.")
    return PowerSGDCompressor(PowerSGDConfig(rank, start_iter, min_compression_rate,
                                             warm_start, error_feedback, epsilon, seed,
                                             _DTYPES[dtype]))


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of the 2-D ``matrix``, in place (torch DDP's
    ``_orthogonalize_gram_schmidt``).  With ``epsilon`` 0 a zero column stays zero instead of
    becoming NaN (a norm is never taken below the dtype's smallest normal number); otherwise
    each column is divided by its norm plus ``epsilon``.  Few torch calls per column: on a small
    model each call's fixed cost, not the arithmetic, is what a step pays."""
    columns = matrix.shape[1]
    for i in range(columns):
        col = matrix[:, i:i + 1]
        norm = torch.linalg.vector_norm(col)
        col /= norm.clamp_min_(torch.finfo(matrix.dtype).tiny) if epsilon == 0 else \
            norm.add_(epsilon)
        if i + 1 < columns:
            rest = matrix[:, i + 1:]
            rest.addmm_(col, col.T @ rest, alpha=-1)   # rest -= col (col^T rest)
    return matrix


def initial_q(m: int, r: int, seed: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A random m x r Q, orthogonalized, drawn from ``seed`` on the CPU (so every rank and
    every device draws the same numbers)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(m, r, generator=generator, dtype=torch.float32).to(dtype=dtype,
                                                                       device=device)
    return orthogonalize_(q)


class PowerSGDState(policy.FactorState):
    """One optimizer's PowerSGD state (see FactorState), with its arithmetic on torch tensors."""

    def start(self, name: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The matrix M to compress for ``grad`` (with the error feedback added) and this step's
        starting Q.  M is formed in the gradient's own memory where it can be (``finish``
        overwrites the gradient anyway): a new gradient-sized tensor every step costs more than
        the arithmetic (large ones are fresh pages from the kernel each time)."""
        n, m = policy.matrix_shape(grad.shape)
        error = self.error.get(name)
        if error is not None and (error.shape != (n, m) or error.dtype != grad.dtype):
            error = None   # the parameter changed shape on every rank: start afresh
        if grad.is_contiguous():
            matrix = grad.view(n, m)
            if error is not None:
                matrix.add_(error)
        else:   # (channels-last and other layouts: work on a copy)
            matrix = grad.reshape(n, m).clone()
            if error is not None:
                matrix.add_(error)
        q = self.q.get(name) if self.config.warm_start else None
        r = policy.factor_rank(n, m, self.config.rank)
        if q is None or q.shape != (m, r) or q.dtype != grad.dtype:
            step = 0 if self.config.warm_start else self.counter.steps
            q = initial_q(m, r, policy.factor_seed(self.config, name, step), grad.dtype, grad.device)
        return matrix, q

    def finish_local(self, name: str, matrix: torch.Tensor, p: torch.Tensor,
                     q_local: torch.Tensor) -> None:
        """Keep what this rank's compression lost (M - P Q_local^T), for its next step, in a
        buffer kept from step to step."""
        if not self.config.error_feedback:
            return
        error = self.error.get(name)
        if error is None or error.shape != matrix.shape or error.dtype != matrix.dtype:
            error = self.error[name] = torch.empty_like(matrix)
        torch.addmm(matrix, p, q_local.T, alpha=-1, out=error)

    def finish(self, name: str, p: torch.Tensor, q: torch.Tensor,
               grad: torch.Tensor) -> None:
        """Write the reduced approximation P Q^T into ``grad``; keep Q for a warm start."""
        if grad.is_contiguous():
            torch.mm(p, q.T, out=grad.view(p.shape[0], q.shape[0]))
        else:
            grad.copy_((p @ q.T).view_as(grad))
        if self.config.warm_start:
            self.q[name] = q


__all__ = ["PowerSGDCompressor", "PowerSGDState", "initial_q", "orthogonalize_", "powersgd"]
