"""Exceptions raised by hvdlite.

Every failure of a collective operation derives from :class:`HvdliteError`, which is also exported
as ``HorovodInternalError`` so that ``except hvd.HorovodInternalError`` in a Horovod script keeps
catching the same failures.  The more specific classes let callers (and tests) tell cases apart.
"""
from __future__ import annotations


class HvdliteError(RuntimeError):
    """A collective operation failed (on every rank that took part)."""


# Horovod scripts catch this name; it is the same class so both spellings catch every failure.
HorovodInternalError = HvdliteError


class NotInitializedError(HvdliteError, ValueError):
    """An hvdlite function was called before ``init()``.  Horovod raises ``ValueError`` from
    ``rank()``/``size()`` and ``HorovodInternalError`` from its operations in that case: this
    class is both, so either ``except`` keeps working."""

    def __init__(self, what: str = "this function") -> None:
        super().__init__(f"hvdlite has not been initialized; call hvd.init() before {what}.")


class ShutdownError(HvdliteError):
    """hvdlite was shut down (here or on another rank) while the operation was pending, or an
    operation was submitted after ``shutdown()``."""


class RankExitedError(ShutdownError):
    """Another rank shut down or exited while this rank still waited on it."""


class RankChildProcessError(HvdliteError):
    """hvdlite was used in a process that a rank started (a forked or spawned child such as a
    DataLoader worker), which is not an MPI rank itself."""


class LaunchError(HvdliteError):
    """``hvd.init()`` could not make the processes the launcher started one world: the MPI
    world does not match what the launcher said (e.g. torchrun or srun started N processes
    but MPI formed worlds of 1), or forming it failed.  Raised on every process; the message
    names the launcher, what it set and how to launch instead."""


class TensorMismatchError(HvdliteError, ValueError):
    """Ranks submitted the same tensor name with different dtype/shape/op/root/device/scale."""


class DuplicateNameError(HvdliteError, ValueError):
    """A tensor name is already in flight on this rank."""


class UnsupportedDtypeError(HvdliteError, TypeError, ValueError):
    """The dtype (or layout, or device) cannot be used with the requested operation.  Horovod
    raises ``ValueError`` ("Tensor type ... is not supported") for these."""


class UnsupportedOperationError(HvdliteError, NotImplementedError, ValueError):
    """The operation is not supported with these arguments: ``reducescatter`` with Adasum (Horovod:
    ``HorovodInternalError``), Adasum on a number of ranks that is not a power of two (Horovod:
    ``NotImplementedError``), the gradient of a reduction other than Sum/Average.  It derives
    from both, and from ``ValueError`` (what hvdlite raised for these before)."""


class FailedOnRankError(HvdliteError):
    """Another rank raised while preparing this operation, before it could submit it (a bad
    tensor or argument there); the operation fails on every rank, and the message names the
    ranks and their error."""


class StallError(HvdliteError):
    """A tensor stayed unsubmitted on some ranks past HVDLITE_STALL_SHUTDOWN_TIME_SECONDS."""


class GpuUnavailableError(HvdliteError):
    """A GPU tensor was submitted but the GPU data path it needs (CUDA through CuPy, or NCCL)
    is missing, or the tensor cannot use it (device or dtype)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic training (``hvd.elastic.run``): hosts were added to or removed from the job, and
    every rank raises this at the same ``state.commit()`` / ``state.check_host_updates()`` so
    that the job restarts at the new size from that point, with nothing rolled back (Horovod's
    class of the same name; not a ``HorovodInternalError``).  ``skip_sync`` is True when hosts
    were only removed (Horovod then skips the state broadcast; hvdlite always starts new
    processes, which always synchronize)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(f"the job's hosts changed (skip_sync={skip_sync})")
        self.skip_sync = skip_sync
