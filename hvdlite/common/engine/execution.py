"""The engine's execution stage: running a round's agreed responses on the data paths.

A round's outcome is executed in its agreed order: errors complete their entries, grouped
operations run as their members, small allreduces that can share a collective
are fused (see :mod:`.fusion`), and each batch runs on the first data path that serves it (host
batches complete here; GPU batches complete when their device work has, see
:mod:`hvdlite.common.gpu.completion`).  Early reductions (see :mod:`.early`) are started and
finished here too.  The only collective of its own, the agreement before a GPU batch, goes
through the controller's :class:`~hvdlite.common.engine.transport.Transport`.
"""
from __future__ import annotations

import functools
import logging
import math
import operator
from typing import Callable

import numpy as np

from hvdlite.common.config import Config
from hvdlite.common.engine.completion import Completion
from hvdlite.common.engine.controller import Controller, RoundOutcome
from hvdlite.common.engine.data_path import PathContext, select
from hvdlite.common.engine.early import EARLY_MAX_BYTES, EarlyPlan
from hvdlite.common.engine.fusion import plan_batches
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ERROR_FAILED_ON_RANK,
                                            ERROR_STALL, REDUCESCATTER, Response)
from hvdlite.common.errors import (FailedOnRankError, HvdliteError, StallError,
                                   TensorMismatchError)
from hvdlite.common.gpu import cuda
from hvdlite.common.gpu.completion import GpuCompletions
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime import timeline as _timeline
from hvdlite.common.runtime.waiting import wait_until

log = logging.getLogger("hvdlite")

# Tensors this large gain nothing from batching (the transfer dwarfs the call overhead), so
# they are reduced in place and skip the two copies through the fusion buffer.
FUSE_BELOW_BYTES = 1 << 20

# What allreduces must share to be fused: an itemgetter over the named fields (as fast as
# indexing, and it follows the fields if Response changes).
FUSION_FIELDS = ("dtype", "reduce_op", "device", "prescale", "postscale")
_fusion_fields = operator.itemgetter(*(Response._fields.index(f) for f in FUSION_FIELDS))

# Kinds whose small host operations fuse beside allreduce (see fusion_key).
_GATHERING = (ALLGATHER, REDUCESCATTER)

# How a negotiation's error response is raised (anything else is a mismatch).
_ERROR_CLASSES = {ERROR_STALL: StallError, ERROR_FAILED_ON_RANK: FailedOnRankError}


def fusion_key(item: tuple[Response, Entry]):
    """What a (response, entry) pair fuses by, or None if it runs alone (see plan_batches).
    Small allreduces fuse (on every path); small host allgathers and reducescatters too, each
    kind with its own (the MPI path runs such a batch as one collective)."""
    response, entry = item
    kind = response.kind
    if kind == ALLREDUCE:
        return None if entry.nbytes >= FUSE_BELOW_BYTES else _fusion_fields(response)
    if kind in _GATHERING and response.device < 0 and _nbytes(item) < FUSE_BELOW_BYTES:
        return (kind,) + _fusion_fields(response)
    return None


def _nbytes(item: tuple[Response, Entry]) -> int:
    """The bytes an item takes in a fusion buffer: its input, or an allgather's result."""
    response, entry = item
    if response.kind == ALLGATHER and entry.array is not None:
        return (sum(response.first_dims) * math.prod(response.shape[1:])
                * entry.array.itemsize)
    return entry.nbytes


class Execution:
    """Runs one engine's rounds on its data paths (``make_paths(context)``: the paths it asks,
    in order, which one serves a batch; see :mod:`.data_path`)."""

    def __init__(self, controller: Controller, config: Config, completion: Completion,
                 make_paths: Callable[[PathContext], list], comm) -> None:
        self.controller = controller
        self.config = config
        self.rank = controller.label   # global rank, for messages
        self._completion = completion
        self.paths = make_paths(PathContext(
            comm=comm, global_ranks=controller.global_ranks, config=config,
            rank=self.rank, max_sleep=controller.max_sleep, on_slow=self._data_stall,
            agree=self.agree_prepared))
        # Each batch asks only the paths of its kind of memory, in the registry's order (a lone
        # host tensor then skips the GPU paths' checks, ~1 us each on every operation).
        self._host_paths = [p for p in self.paths if not p.device]
        self._device_paths = [p for p in self.paths if p.device]
        self._gpu_completions = None   # the GPU completion thread, made on first use
        # Early reductions (see :mod:`.early`): the plan, the path that serves them, the
        # largest tensor taken (0: none; the same on every rank), and how many stood.
        # ``early_on`` may be flipped at run time (tests, benchmarks): it takes effect, on every
        # rank at once, from the round after the one in which every rank's switch agrees.
        self._early = EarlyPlan(controller.cache.held)
        self._early_path = next((p for p in self._host_paths if p.reduces_early), None)
        self._early_max_bytes = (EARLY_MAX_BYTES if config.early_reductions
                                 and self._early_path is not None else 0)
        self.early_on = self._early_max_bytes > 0
        self._early_allowed = False   # the last round's verdict: every rank's switch is on
        self.early_reductions = 0

    def use_config(self, config: Config, cache_emptied: bool) -> None:
        """Run with ``config`` from the next round on (autotune; between rounds, on every rank
        alike): fusion threshold and hierarchical switches; ``cache_emptied``: the response
        cache was emptied, so no early reduction may be predicted from its old slots."""
        self.config = config
        for path in self.paths:
            if path.name == "hierarchical":
                path.allreduce_on = config.hierarchical_allreduce
                path.allgather_on = config.hierarchical_allgather
        if cache_emptied:
            self._early = EarlyPlan(self.controller.cache.held)
            self._early_allowed = False

    def _data_stall(self, waited: float) -> None:
        """Called while a batch's data exchange waits long for peers (see Controller)."""
        self.controller.local_stall(waited, "an allreduce's data exchange")

    def early_next(self):
        """What the next round starts early (see Controller.run_round's ``early``), if any."""
        return self._early.next if self._early_allowed else None

    def run(self, outcome: RoundOutcome) -> None:
        """Execute a round's outcome: the early reduction that stood, then the agreed
        responses; and learn what the next rounds may start early."""
        self._early_allowed = outcome.early_allowed
        if outcome.early is not None:
            self._complete_early(*outcome.early)
        sole_path = self.execute(outcome.ready)
        self._early.after_round(outcome.sole_slot, outcome.progress,
                                lambda: self._early_start(outcome, sole_path))

    def execute(self, ready: list[tuple[Response, Entry | None]]):
        """Run the round's agreed responses; return the path that ran them if they were one
        runnable response (early reductions learn from it), else None."""
        complete = self._completion.complete
        tl = _timeline.ACTIVE
        if tl is not None:
            for response, entry in ready:
                kind = entry.request.kind if entry is not None else response.kind
                tl.negotiate_end(response.name, kind, response.error)
                if response.members:   # a group: its members' rows go on
                    tl.op_end([response.name])
                    for member in response.members:
                        tl.negotiate_end(member.name, kind)
        runnable = ready
        if any(response.error is not None for response, _ in ready):
            runnable = []
            for response, entry in ready:
                if response.error is not None:
                    cls = _ERROR_CLASSES.get(response.error_kind, TensorMismatchError)
                    complete(entry, error=cls(response.error))
                else:
                    runnable.append((response, entry))
        if any(response.members for response, _ in runnable):
            # groups: the paths execute their members, exactly as they execute single tensors
            runnable = [pair for response, entry in runnable
                        for pair in (zip(response.members, entry.members) if response.members
                                     else ((response, entry),))]
        sole_path = None
        for batch in plan_batches(runnable, fusion_key, _nbytes, self.config.fusion_threshold):
            path = select(self._device_paths if batch[0][0].device >= 0 else self._host_paths,
                          batch)
            if len(runnable) == 1:
                sole_path = path
            if path.device:
                self._execute_on_device(path, batch)
                continue
            if tl is not None and batch[0][0].kind != ALLREDUCE:   # the paths mark those
                tl.activity([r.name for r, _ in batch], f"MPI_{batch[0][0].kind.upper()}")
            path.execute(batch)
            self._completion.complete_batch([entry for _, entry in batch])
        return sole_path

    def _early_start(self, outcome: RoundOutcome, path):
        """How later rounds start the tensor that ran alone in this one early (on ``path``),
        or None if it cannot be (see :mod:`.early`); decided from what every rank agreed on."""
        if outcome.early is not None or len(outcome.ready) != 1:
            return None
        response, entry = outcome.ready[0]
        if (path is not self._early_path or entry is None or response.members
                or response.kind != ALLREDUCE or response.device >= 0
                or response.reduce_op == ReduceOp.Adasum
                or not 0 < entry.nbytes <= self._early_max_bytes or self.controller.size < 2):
            return None
        return functools.partial(self._early_path.start_early, response)

    def _complete_early(self, response: Response, entry: Entry) -> None:
        """An early reduction stood: its result is in the early exchange's buffer."""
        tl = _timeline.ACTIVE
        if tl is not None:
            tl.negotiate_end(response.name, ALLREDUCE, None)
            tl.activity([response.name], "MPI_ALLREDUCE")
        self._early_path.finish_early(response, entry)
        self.early_reductions += 1
        self._completion.complete_batch([entry])

    def _execute_on_device(self, path, batch: list[tuple[Response, Entry]]) -> None:
        """Queue the batch's device work; its handles complete when the work has finished (or,
        under asynchronous completion, now: their wait() orders the caller's stream after it)."""
        completion = self._completion
        if self._gpu_completions is None:
            self._gpu_completions = GpuCompletions(
                cuda.runtime(), completion.complete_batch,
                lambda e, err: completion.complete(e, error=err))
        entries = [entry for _, entry in batch]
        tl = _timeline.ACTIVE
        if tl is not None:
            tl.activity([e.name for e in entries],
                        f"{path.name.upper()}_{batch[0][0].kind.upper()}")
        try:
            work = path.execute(batch)
        except Exception as exc:   # noqa: BLE001 - a CUDA/NCCL failure fails this batch only
            error = exc if isinstance(exc, HvdliteError) else HvdliteError(
                f"GPU operation on {[e.name for e in entries]} failed on rank {self.rank}: "
                f"{type(exc).__name__}: {exc}")
            for entry in entries:
                completion.complete(entry, error=error)
            return
        if self.config.gpu_async_completion:
            # Complete now; each handle's wait() makes the framework's stream wait for the
            # event, so the host never waits for the GPU (a sync per step idles the device).
            ready = functools.partial(cuda.wait_for_device_work, work.event, work.device)
            for entry in entries:
                entry.handle._device_ready = ready
            completion.complete_batch(entries)
            self._gpu_completions.put(work.event, entries, work.keep, completed=True)
            return
        self._gpu_completions.put(work.event, entries, work.keep)

    def agree_prepared(self, error: BaseException | None) -> None:
        """Before a GPU batch's collective: did every rank prepare its part (device copies,
        buffers)?  If any failed, every rank raises (naming those ranks) and none enters the
        collective, so a local failure cannot leave the others waiting inside it."""
        controller = self.controller
        if controller.size == 1:   # nobody else to tell: no collective, no arrays
            if error is None:
                return
            failed = [self.rank]
        else:
            mine = np.array([0 if error is None else 1], dtype=np.int64)
            every = np.empty(controller.size, dtype=np.int64)
            wait_until(controller.transport.start_allgather(mine, every), controller.max_sleep)
            failed = [controller.global_ranks[i] for i in np.flatnonzero(every)]
        if not failed:
            return
        if error is not None:
            raise HvdliteError(f"GPU operation failed on rank {self.rank} before its collective: "
                               f"{type(error).__name__}: {error}. No rank ran it (failed on "
                               f"ranks {failed}).") from error
        raise HvdliteError(f"GPU operation failed on rank(s) {failed} before its collective, so "
                           f"no rank ran it; their output says why.")

    def path(self, name: str):
        """The data path called ``name`` (tests and benchmarks look inside)."""
        return next(p for p in self.paths if p.name == name)

    def close_paths(self, collective: bool, abort: bool) -> None:
        """Let queued device work finish (unless ``abort``: peers may be gone), then release
        every path's resources (``collective``: every rank of the set is here too)."""
        self.close_device_work(abort)
        for path in self.paths:
            try:
                path.close(collective=collective, abort=abort)
            except Exception:   # noqa: BLE001 - teardown must not mask the original outcome
                log.exception("hvdlite: closing the %s data path failed", path.name)

    def close_device_work(self, abort: bool) -> None:
        """Stop the GPU completion thread: after the queued device work finished, or, when
        ``abort``, after aborting the device paths (NCCL kernels may wait for gone peers)."""
        completions, self._gpu_completions = self._gpu_completions, None
        if completions is None:
            return
        if not abort:
            completions.close()
            return
        for path in self.paths:
            if path.device:
                try:
                    path.close(collective=False, abort=True)
                except Exception:   # noqa: BLE001 - teardown must not mask the original outcome
                    log.exception("hvdlite: closing the %s data path failed", path.name)
        completions.close(timeout=5.0)
