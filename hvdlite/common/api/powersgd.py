"""PowerSGD's framework-neutral policy (Vogels et al., 2019): the configuration and its checks,
which gradients are compressed (the compression-rate rule), the step count that decides when
compression starts, and the seeds of the factors every rank draws alike.

The matrix arithmetic lives with each framework (hvdlite/torch/powersgd.py for torch), which
reaches this module through the door as ``core.powersgd_policy``; this module holds the decisions that must come out the same on every rank whatever the framework,
so a TensorFlow adapter can reuse them.  See docs/compression.md.
"""
from __future__ import annotations

import math
import weakref
import zlib
from dataclasses import dataclass
from typing import Sequence

from hvdlite.common.reduce_ops import ReduceOp

# Reductions PowerSGD can carry out: the factors are summed (P) and summed or averaged (Q), so
# only linear reductions of the gradients make sense.
SUPPORTED_OPS = (ReduceOp.Average, ReduceOp.Sum)


@dataclass(frozen=True)
class PowerSGDConfig:
    """What ``Compression.powersgd(...)`` was asked for (checked on creation).

    Attributes:
      rank: the rank r of the factors (P is n x r, Q is m x r); clamped to min(n, m) per matrix.
      start_iter: optimizer steps reduced with a plain allreduce before compression starts.
      min_compression_rate: a gradient is compressed only if n*m / (r*(n+m)) is at least this.
      warm_start: reuse the last step's Q as the next step's starting Q (else a fresh random Q,
        drawn alike on every rank, every step).
      error_feedback: add what the compression lost on this rank to its next gradient.
      epsilon: added to each column's norm in the orthogonalization (0: plain Gram-Schmidt, a
        zero column stays zero).
      seed: seeds the random initial Q (the same on every rank).
      wire_dtype: name of the dtype the factors and uncompressed gradients travel as
        ("float16", "bfloat16"), or None for the gradients' own dtype.
    """

    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: bool = True
    epsilon: float = 0.0
    seed: int = 0
    wire_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"powersgd: rank must be an integer >= 1, got {self.rank!r}.")
        if (not isinstance(self.start_iter, int) or isinstance(self.start_iter, bool)
                or self.start_iter < 0):
            raise ValueError(f"powersgd: start_iter must be an integer >= 0, got "
                             f"{self.start_iter!r}.")
        if not self.min_compression_rate >= 0:   # (also refuses NaN)
            raise ValueError(f"powersgd: min_compression_rate must be >= 0, got "
                             f"{self.min_compression_rate!r}.")
        if not self.epsilon >= 0:
            raise ValueError(f"powersgd: epsilon must be >= 0, got {self.epsilon!r}.")
        if self.wire_dtype not in (None, "float16", "bfloat16"):
            raise ValueError(f"powersgd: dtype must be None, float16 or bfloat16, got "
                             f"{self.wire_dtype!r}.")


def check_op(op: ReduceOp, what: str = "DistributedOptimizer(compression=powersgd)") -> None:
    """Raise ValueError unless PowerSGD can reduce with ``op`` (Average or Sum)."""
    if op not in SUPPORTED_OPS:
        name = getattr(op, "name", op)
        raise ValueError(f"{what}: PowerSGD supports op=Average and op=Sum only, not {name}. "
                         f"Adasum combines whole gradients non-linearly, which low-rank factors "
                         f"summed across ranks cannot reproduce; use Compression.none, fp16 or "
                         f"bf16 with Adasum.")


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The n x m matrix a gradient of ``shape`` is compressed as (the first dimension by the
    rest, as torch's DDP hook does), or None for a scalar or vector."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def factor_rank(n: int, m: int, rank: int) -> int:
    """The rank actually used for an n x m matrix (no more than its smaller side)."""
    return min(rank, n, m)


def compression_rate(n: int, m: int, rank: int) -> float:
    """How many times fewer numbers travel: n*m against the factors' r*(n+m)."""
    return (n * m) / (factor_rank(n, m, rank) * (n + m))


def compresses(shape: Sequence[int], config: PowerSGDConfig) -> bool:
    """Is a gradient of ``shape`` compressed (else it travels whole, in the shared bucket)?"""
    nm = matrix_shape(shape)
    if nm is None or 0 in nm:
        return False
    return compression_rate(nm[0], nm[1], config.rank) >= config.min_compression_rate


def split(shapes: Sequence[Sequence[int]], config: PowerSGDConfig) -> tuple[list, list]:
    """Indices of ``shapes`` that are compressed, and of those that travel uncompressed."""
    compressed = [i for i, s in enumerate(shapes) if compresses(s, config)]
    chosen = set(compressed)
    return compressed, [i for i in range(len(shapes)) if i not in chosen]


def groups_by_dtype(indices: Sequence[int], dtypes: Sequence) -> list[list[int]]:
    """The uncompressed gradients ``indices`` grouped by their dtype (``dtypes[i]``), in order:
    each group travels as one flat buffer, so nothing is cast in packing."""
    groups: dict = {}
    for i in indices:
        groups.setdefault(dtypes[i], []).append(i)
    return list(groups.values())


def factor_seed(config: PowerSGDConfig, name: str, step: int = 0) -> int:
    """Seed of the random initial Q of the gradient called ``name`` at ``step`` (0 with warm
    start): derived from the name, not from an order or a global generator, so every rank draws
    the same Q whatever else it drew."""
    return zlib.crc32(f"{config.seed}:{name}:{step}".encode()) & 0x7FFFFFFF


class StepCounter:
    """Optimizer steps reduced so far; compression starts after ``start_iter`` of them.  The
    count is the same on every rank: every rank reduces every step (a joined rank stands in,
    and after a join the ranks agree on the count again, see ``needs_agreement``)."""

    def __init__(self, start_iter: int) -> None:
        self.start_iter = start_iter
        self.steps = 0
        self.needs_agreement = False   # (after a join: ranks may have counted differently)

    @property
    def compressing(self) -> bool:
        return self.steps >= self.start_iter

    def advance(self) -> None:
        self.steps += 1

    def agree(self, steps: int) -> None:
        """Take the count the ranks agreed on (their largest)."""
        self.steps = steps
        self.needs_agreement = False

    def reset(self) -> None:
        """A new world (elastic reset): plain allreduces again for ``start_iter`` steps."""
        self.steps = 0
        self.needs_agreement = False


class FactorState:
    """What PowerSGD keeps across steps, whatever the framework: per gradient name its
    warm-start Q and its error feedback (the framework's arrays), the step count, and the engine
    it was built with (a new engine, after an elastic reset, starts it over on every rank)."""

    def __init__(self, config: PowerSGDConfig) -> None:
        self.config = config
        self.counter = StepCounter(config.start_iter)
        self.q: dict = {}
        self.error: dict = {}
        self._world = None   # weak reference to the engine the state was built with

    def forget_factors(self) -> None:
        """Drop Q and the error feedback (after a join, where a rank missed steps)."""
        self.q.clear()
        self.error.clear()

    def reset(self) -> None:
        """A new world: start over, with plain allreduces for ``start_iter`` steps."""
        self.forget_factors()
        self.counter.reset()

    def after_join(self) -> None:
        """hvd.join() returned on every rank of the state's set: a joined rank missed steps
        (its error feedback and Q lag, its step count too), so every rank drops Q and the error
        feedback alike, and the ranks agree on the step count at the next step."""
        self.forget_factors()
        self.counter.needs_agreement = True

    def follow(self, engine: object) -> None:
        """Called at every step with the engine that reduces it: the first one is remembered
        (weakly: an old engine's resources must not linger), and a different one resets the
        state, alike on every rank."""
        if self._world is None or self._world() is not engine:
            if self._world is not None:
                self.reset()
            self._world = weakref.ref(engine)


__all__ = ["FactorState", "PowerSGDConfig", "StepCounter", "SUPPORTED_OPS", "check_op",
           "compresses", "compression_rate", "factor_rank", "factor_seed", "groups_by_dtype",
           "matrix_shape", "split"]
