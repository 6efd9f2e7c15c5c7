"""The data-path interface every backend implements (in the spirit of Horovod's
``AllreduceOp::Enabled()``/``Execute()`` strategies and torch's c10d ``Backend``)."""
from __future__ import annotations

import abc
from typing import Callable, ClassVar

from hvdlite.common.engine.data_paths import Batch, DeviceWork, PathContext
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import Response


class DataPath(abc.ABC):
    """One way of moving a negotiated batch's data.  The engine asks its paths in order and
    runs a batch on the first whose :meth:`enabled` says yes.  Every rank of the set sees the
    same batches in the same order, so ``enabled`` must answer alike on every rank (decide from
    the batch and what the ranks agreed on, never from local state that may differ)."""

    #: Short name (timeline, errors, tests: ``engine.path(name)``).
    name: ClassVar[str]
    #: Serves GPU batches (True) or host-memory ones.
    device: ClassVar[bool] = False
    #: Offers :meth:`start_early` and :meth:`finish_early` (see ``engine/early.py``).
    reduces_early: ClassVar[bool] = False

    def __init__(self, context: PathContext) -> None:
        self.context = context
        self.comm = context.comm
        self.size = context.comm.Get_size()
        self.rank = context.comm.Get_rank()

    @abc.abstractmethod
    def enabled(self, batch: Batch) -> bool:
        """Whether this path serves ``batch`` (one kind, dtype, device; fused if several)."""

    @abc.abstractmethod
    def execute(self, batch: Batch) -> DeviceWork | None:
        """Run ``batch``.  A host path returns None once every entry's ``output`` holds its
        result; a device path returns the queued work."""

    def close(self, collective: bool, abort: bool = False) -> None:
        """Release resources.  ``collective``: every rank of the set calls it at the same
        point; ``abort``: peers may be gone (unblock rather than wait for them)."""

    def start_early(self, response: Response, entry: Entry | None) -> Callable[[], bool]:
        """Start ``response``'s allreduce (a single host tensor this path served alone) during
        the negotiation round, with ``entry``'s data (None: this rank's share is ignored);
        return its test.  The input is not touched: the result may be dropped."""
        raise NotImplementedError

    def finish_early(self, response: Response, entry: Entry) -> None:
        """The early allreduce stood: write its result into ``entry.output``, exactly as
        :meth:`execute` would have."""
        raise NotImplementedError
