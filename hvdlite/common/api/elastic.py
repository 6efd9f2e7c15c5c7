"""Elastic training with Horovod's API (``hvd.elastic``): states that commit, restore and sync,
and the ``run`` wrapper that carries training across changes of the job's membership.

Horovod keeps its workers and re-forms the collective world in place (Gloo).  MPI cannot: a
world that lost a process cannot be repaired or re-initialized, so in hvdlite a change of
membership means a new world of new processes, started by the driver (``hvdlite run
--min-np/--max-np/--host-discovery-script``, see :mod:`hvdlite.runner.elastic`).  What must
survive therefore lives outside the workers, in the driver:

* ``state.commit()`` saves the state in the process (Horovod's ``save()``, so ``restore()``
  works as in Horovod), packs a copy of it and, on rank 0, hands it to a background thread that
  ships it to the driver (the newest only); every rank keeps its own packed copy;
* a rank whose world fails (``HorovodInternalError``: a peer died, a collective failed) offers
  its latest commit to the driver, which takes it when it has nothing as new (rank 0 may have
  died before shipping it), then exits with :data:`EXIT_RESET`;
* the driver starts the next world; its rank 0 fetches the newest commit, loads it into the
  live objects (Horovod's ``restore()``), every rank runs the reset callbacks, and ``sync()``
  broadcasts rank 0's state, as Horovod's ``run`` does after a reset;
* ``HostsUpdatedInterrupt`` (hosts added or removed: the driver tells rank 0, and
  ``check_host_updates()`` turns that into an interrupt that every rank raises at the same
  commit) ends the world cleanly after rank 0 has shipped its live state, so nothing is rolled
  back, as in Horovod.

``check_host_updates()`` agrees across ranks through :mod:`.host_updates`.

Without the driver (plain ``mpiexec``, ``hvdlite run -np N``) ``run`` syncs and calls the
function; a failure is raised as usual (no new world can be made) and ``check_host_updates()``
costs nothing (nothing can notify it).
"""
from __future__ import annotations

import functools
import logging
import os
import pickle
import queue
import sys
import traceback
from typing import Any, Callable

from hvdlite.common.api import ops
from hvdlite.common.api.host_updates import HostUpdateAgreement
from hvdlite.common.errors import HorovodInternalError, HostsUpdatedInterrupt
from hvdlite.common.runtime import (elastic_channel, lifecycle, liveness, output_relay,
                                    state as _state, warm_start)
from hvdlite.common.runtime.elastic_wire import (EXIT_RESET, HostUpdateResult, dumps, pack,
                                                 unpack)

log = logging.getLogger("hvdlite")

# How long a failing or interrupted rank waits on the driver before it exits regardless.
FLUSH_SECONDS = 60.0
REPORT_SECONDS = 10.0


class State:
    """State tracked in memory across workers, kept across resets (Horovod's
    ``hvd.elastic.State``).

    Args:
        bcast_object: broadcasts a picklable object from rank 0 to the other ranks.
        get_rank: returns this worker's rank.

    Subclasses implement ``save()``, ``restore()`` and ``sync()`` (as in Horovod) and, for the
    committed state to outlive the processes (hvdlite restarts them at every reset),
    ``committed_state()`` and ``load_committed_state()``.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], None]] = []
        self._hvd_commits = 0          # commits in this world
        self._hvd_last = None          # (commit id, committed tree) of this rank's newest
        self._hvd_offer = (0, 0)       # rank 0: newest host update seen (timestamp, result)
        self._hvd_agreement = None     # the pipelined host-update broadcast (_Agreement)

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Register functions to call after a reset (workers added or removed), before the
        state is synchronized, e.g. to rescale the learning rate with the new ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (in memory, and beyond this process when run by the elastic driver),
        then check for host updates (raising ``HostsUpdatedInterrupt`` on every rank when the
        driver reported some).  Commits copy the state: commit less often than every batch for
        a large model, trading the copies against the steps a failure rolls back."""
        self.save()
        _committed(self)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if hosts were added or removed.

        A collective, like Horovod's: every rank must call it at the same point.  hvdlite
        overlaps its broadcast with the next step, so an update reaches every rank at the check
        after the one at which rank 0 first saw it."""
        last, update = self._hvd_offer
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last = timestamp
            update |= int(result)
        self._hvd_offer = (last, update)
        session = _session()
        if session is None:   # nothing can notify a job without the elastic driver
            return
        agreed = _agree(self, self._hvd_offer)
        if agreed is not None and agreed[0] > self._last_updated_timestamp:
            self._last_updated_timestamp = agreed[0]
            self._hvd_offer = (0, 0)
            raise HostsUpdatedInterrupt(HostUpdateResult(agreed[1]) == HostUpdateResult.removed)

    def save(self) -> None:
        """Save the state in this process's memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Restore the last committed state, undoing uncommitted modifications."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Synchronize the state across workers (from rank 0)."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Reset objects after a reset event, before synchronization."""

    # --- hvdlite: the committed state outside the process ------------------------------------
    def committed_state(self) -> Any:
        """What the last ``save()`` saved, for the elastic driver to keep between worlds: a
        tree that nothing changes afterwards (it is packed later, on another thread), whose
        arrays travel out of band (numpy and, with ``hvdlite.torch``, torch tensors); small
        objects that may change in place are best pickled at once (``elastic_wire.dumps``)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say what to keep between worlds: hvdlite starts new "
            f"processes at every reset, so a State subclass must implement committed_state() "
            f"(a picklable copy of what save() saved) and load_committed_state() (make it the "
            f"saved and live state); ObjectState and the framework states do.")

    def load_committed_state(self, committed: Any) -> None:
        """Make ``committed`` (from :meth:`committed_state`, in an earlier world) the saved and
        the live state on this rank."""
        raise NotImplementedError(f"{type(self).__name__} does not implement "
                                  f"load_committed_state() (see committed_state()).")


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and exposed as attributes
    (Horovod's ``hvd.elastic.ObjectState``).  As in Horovod, ``save()`` keeps references:
    assign new values rather than changing saved ones in place (the copy the elastic driver
    keeps is taken at ``commit()``)."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs) -> None:
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def committed_state(self) -> Any:
        # pickled now: the saved values are the live objects (Horovod), which may change later
        return {"objects": dumps(self._saved_state)}

    def load_committed_state(self, committed: Any) -> None:
        self._saved_state = pickle.loads(committed["objects"])
        self._set_attrs()


# --- the session: this world's part in an elastic job -----------------------------------------
class _Session:
    """This process's elastic bookkeeping for its world (exists only under the driver)."""

    def __init__(self, channel: elastic_channel.Channel) -> None:
        self.channel = channel
        self.world = channel.world
        self.rank = _state.rank()
        self.shipper = (elastic_channel.Shipper(channel, paced=_state.size() > 1)
                        if self.rank == 0 else None)
        self._keys: dict[int, int] = {}        # id(state) -> key (order of first use)
        self._states: dict[int, State] = {}    # key -> state
        self._begun: set[int] = set()

    def key(self, state: State) -> int:
        key = self._keys.get(id(state))
        if key is None:
            key = self._keys[id(state)] = len(self._keys)
            self._states[key] = state
        return key

    def begin(self, state: State) -> None:
        """At the first ``run`` of ``state`` in this world: rank 0 loads the newest commit (if
        any), and after a reset every rank runs the reset callbacks."""
        _require_committable(state)
        key = self.key(state)
        if key in self._begun:
            return
        if not self._begun:   # the driver waits for this rank's report when its world ends
            try:
                self.channel.tell(("session",))
            except Exception as problem:   # noqa: BLE001 - the fetch below reports it
                log.debug("elastic: could not tell the driver of the session: %s", problem)
        self._begun.add(key)
        if self.rank == 0:
            reply = self.channel.request(("fetch", key), timeout=FLUSH_SECONDS)
            if reply[0] == "commit":
                state.load_committed_state(unpack(reply[3]))
                log.info("elastic: world %d resumes from commit %s", self.world, reply[2])
        if self.world > 0:
            state.on_reset()
        if self.rank == 0:   # (after on_reset, which drops the messages of an earlier world)
            self.channel.add_listener(state.on_hosts_updated)

    def failed(self, exc: BaseException) -> None:
        """The world failed: make sure the driver holds this rank's newest commit, say so,
        and exit for the driver to start the next world.  Never returns."""
        try:
            if self.shipper is not None:
                self.shipper.flush(FLUSH_SECONDS)
            for key, state in self._states.items():
                if state._hvd_last is not None:
                    commit_id, committed = state._hvd_last
                    reply = self.channel.request(("have", key, commit_id), FLUSH_SECONDS)
                    if reply[0] == "send":
                        self.channel.send_commit(key, commit_id, pack(committed))
                        self.channel.wait_stored(key, commit_id, FLUSH_SECONDS)
            self.channel.request(("outcome", "reset", _describe(exc), liveness.departed_ranks()),
                                 REPORT_SECONDS)
        except Exception as problem:   # noqa: BLE001 - exit regardless: the world is over
            log.warning("elastic: could not report the failure to the driver: %s", problem)
        _exit(EXIT_RESET)

    def interrupted(self, state: State) -> None:
        """Hosts changed: rank 0 ships its live state (nothing is rolled back), every rank
        shuts down together, and the process exits for the next world.  Never returns."""
        try:
            _drain_agreement(state)
            if self.rank == 0:
                state.save()
                commit_id, committed = _new_commit(self, state)
                self.shipper.flush(FLUSH_SECONDS)
                self.channel.send_commit(self.key(state), commit_id, pack(committed))
                self.channel.wait_stored(self.key(state), commit_id, FLUSH_SECONDS)
            # No rank exits before rank 0's state is stored: the launcher kills the other
            # ranks of a host as soon as one of them exits with a non-zero status.
            ops.barrier()
            self.channel.request(("outcome", "interrupt", "hosts changed", []), REPORT_SECONDS)
            lifecycle.shutdown()
            from mpi4py import MPI
            MPI.Finalize()
        except Exception as problem:   # noqa: BLE001 - exit regardless: the world is over
            log.warning("elastic: ending the world after a host update: %s", problem)
            _exit(EXIT_RESET)
        _exit(EXIT_RESET)

    def errored(self, exc: BaseException) -> None:
        """``func`` raised something that is not a collective failure: tell the driver (this
        rank's host counts as failing), then let the exception end the process."""
        try:
            self.channel.tell(("outcome", "error", _describe(exc), []))
        except Exception:   # noqa: BLE001 - the exception itself is what matters
            pass

    def finished(self, state: State) -> None:
        _drain_agreement(state)
        try:
            self.channel.request(("outcome", "done", "", []), REPORT_SECONDS)
        except Exception as problem:   # noqa: BLE001 - the job's result does not depend on it
            log.warning("elastic: could not report the end of training to the driver: %s",
                        problem)


_current: _Session | None = None


def _session() -> _Session | None:
    """This world's session (made at first use), or None without an elastic driver."""
    global _current
    channel = elastic_channel.current()
    if channel is None:
        return None
    if _current is None or _current.channel is not channel:
        _current = _Session(channel)
    return _current


def _require_committable(state: State) -> None:
    if type(state).committed_state is State.committed_state:
        raise TypeError(f"hvd.elastic: {type(state).__name__} does not implement "
                        f"committed_state() and load_committed_state(); hvdlite starts new "
                        f"processes at every reset, so a State subclass must say what to keep "
                        f"between worlds (ObjectState and the framework states do).")


def _new_commit(session: _Session, state: State):
    state._hvd_commits += 1
    commit_id = (session.world, state._hvd_commits)
    committed = state.committed_state()
    state._hvd_last = (commit_id, committed)
    return commit_id, committed


def _committed(state: State) -> None:
    """After ``save()`` in ``commit()``: keep what was committed (packed only when it is
    sent), and hand it to rank 0's shipping thread."""
    session = _session()
    if session is None:
        return
    _require_committable(state)
    key = session.key(state)
    commit_id, committed = _new_commit(session, state)
    if session.shipper is not None:
        session.shipper.offer(key, commit_id, committed)
    warm_start.report_modules(last=True)   # (the first commit's report is the last)


def _agree(state: State, offer: tuple[int, int]) -> tuple[int, int] | None:
    """The host update rank 0 offered at the previous check (None at the first), and this
    check's offer posted for the next."""
    if state._hvd_agreement is None:
        state._hvd_agreement = HostUpdateAgreement()
    return state._hvd_agreement.exchange(offer)


def _drain_agreement(state: State) -> None:
    if state._hvd_agreement is not None:
        state._hvd_agreement.drain()


def _describe(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[-2000:]


def _after_departure(exc: BaseException) -> HorovodInternalError | None:
    """A ``HorovodInternalError`` for ``exc`` when it was raised after a peer of this world
    departed (the world is over: a DataLoader worker's, a stream's or the script's own error
    there is a consequence, not a cause), else None."""
    departed = liveness.departed_ranks()
    if not departed or not isinstance(exc, Exception):
        return None
    failure = HorovodInternalError(f"{type(exc).__name__}: {exc} (raised after rank(s) "
                                   f"{sorted(departed)} of this world had departed)")
    failure.__cause__ = exc
    return failure


def _exit(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001 - exiting regardless
            pass
    output_relay.drain()   # what the script wrote reaches the driver before the process ends
    os._exit(status)


def run_fn(func: Callable, translate: Callable[[BaseException], BaseException | None] | None
           = None) -> Callable:
    """The ``hvd.elastic.run`` decorator for a framework: ``translate(exc)`` may map a
    framework's exception to a ``HorovodInternalError`` (TensorFlow's graph errors)."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        session = _session()
        if session is None:
            state.sync()
            return func(state, *args, **kwargs)
        try:
            session.begin(state)
            state.sync()
            state.save()   # restore() before the first commit goes back to the synced state
            result = func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            session.interrupted(state)
            raise   # (not reached)
        except BaseException as exc:
            internal = exc if isinstance(exc, HorovodInternalError) else (
                translate(exc) if translate is not None else None)
            if not isinstance(internal, HorovodInternalError):
                internal = _after_departure(exc)
            if isinstance(internal, HorovodInternalError):
                session.failed(internal)
            session.errored(exc)
            raise
        session.finished(state)
        return result

    return wrapper
