"""Cohorts: the parameters that ``DistributedOptimizer(groups=...)`` (Horovod's argument) puts
together.  Each gradient of a cohort is still its own allreduce; the cohort only times their
submissions: none is submitted until every member's gradient is complete, then all are, so the
engine negotiates them in one round and fuses them into one collective.  (This is not the
engine's grouped collective, ``hvd.grouped_allreduce``, which is one request for the engine.)
"""
from __future__ import annotations


class Cohorts:
    """Which cohort each parameter is in, and which members' gradients are complete."""

    __slots__ = ("of", "members", "_ready")

    def __init__(self, of: dict, members: list[list]) -> None:
        self.of = of              # param -> index of its cohort in ``members``
        self.members = members    # each cohort's parameters
        self._ready: dict = {}    # cohort index -> its members whose gradient is complete

    @classmethod
    def from_groups(cls, names: dict, groups) -> "Cohorts":
        """The cohorts of ``groups``, checked: a number of cohorts (the parameters of ``names``
        dealt out in turn), a list of parameter lists, or None (no cohorts)."""
        params = list(names)
        if groups is None:
            return cls({}, [])
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
        of: dict = {}
        for index, chunk in enumerate(chunks):
            for p in chunk:
                if p in of:
                    raise ValueError(f"parameter {names[p]!r} appears in two groups.")
                of[p] = index
        return cls(of, chunks)

    def complete(self, p) -> list | None:
        """``p``'s gradient is complete: its cohort's members if they all are now (submit them),
        else None."""
        index = self.of[p]
        ready = self._ready.setdefault(index, set())
        ready.add(p)
        if len(ready) < len(self.members[index]):
            return None
        del self._ready[index]
        return self.members[index]

    def clear(self) -> None:
        """Forget the completed members (their reductions were started, or dropped)."""
        self._ready.clear()
