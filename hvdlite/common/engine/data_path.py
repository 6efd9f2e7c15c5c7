"""The data-path interface: what a data path is (:class:`DataPath`, in the spirit of Horovod's
``AllreduceOp::Enabled()``/``Execute()`` and torch's c10d ``Backend``), what the engine hands it
and gets back, and choosing the path for a batch.

A data path moves one negotiated batch's bytes: MPI, the intra-node shared-memory window,
direct copies, host staging of GPU tensors, NCCL.  The engine asks the paths it was given, in
order, which one serves a batch (Horovod's ``Enabled()``), and runs it there.  This module lives
in the engine layer, as :mod:`.transport` declares the negotiation's interface, because the
engine runs batches through it; the implementations live one layer up, in
:mod:`hvdlite.common.data_paths`, built by the factory the engine is created with, so the engine
never imports them and adding a path never touches the engine.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple

from hvdlite.common.config import Config
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import Response

Batch = list[tuple[Response, Entry]]


@dataclasses.dataclass(frozen=True)
class PathContext:
    """What every data path of one process set's engine shares."""

    comm: Any                         # the set's communicator
    global_ranks: list[int]           # the set's members by global rank (messages name those)
    config: Config
    rank: int                         # this process's global rank
    max_sleep: float                  # longest back-off sleep while waiting on peers
    on_slow: Callable[[float], None]  # called about every second of a wait on peers (may raise)
    # Before a GPU batch's collective: every rank says whether it prepared its part; raises on
    # every rank if one failed, so no rank is left alone inside the collective.
    agree: Callable[[BaseException | None], None]


class DeviceWork(NamedTuple):
    """A GPU batch queued on the device: ``event`` fires when it is done, ``keep`` holds the
    memory it uses until then, on GPU ``device``."""

    event: Any
    keep: list
    device: int


def select(paths: list, batch: Batch):
    """The first of ``paths`` whose ``enabled(batch)`` is true."""
    for path in paths:
        if path.enabled(batch):
            return path
    response = batch[0][0]
    raise RuntimeError(f"internal error: no data path serves {response.kind} of "
                       f"{response.name!r} (device {response.device})")


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
