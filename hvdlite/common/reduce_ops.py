"""Reduction operators, with Horovod's names and integer values."""
from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """Reduction applied by allreduce.  Values match Horovod's so they may be passed as ints."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product


def resolve_op(op: "ReduceOp | int | None", average: "bool | None" = None) -> ReduceOp:
    """Resolve Horovod's (deprecated) ``average=`` flag and the ``op=`` argument into one op.

    Horovod's rule: passing both is an error; neither means Average.
    """
    if average is None and type(op) is ReduceOp:
        return op
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average; pass only one of them.")
    if op is None:
        return ReduceOp.Average if (average is None or average) else ReduceOp.Sum
    try:
        return ReduceOp(int(op))
    except ValueError:
        raise ValueError(
            f"Unknown reduce op {op!r}; use one of {', '.join(o.name for o in ReduceOp)}."
        ) from None
