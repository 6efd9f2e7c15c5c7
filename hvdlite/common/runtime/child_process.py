"""Processes that a rank starts itself (DataLoader workers, ``multiprocessing`` children).

Only the processes the MPI launcher started are ranks.  A child that a rank starts is not one,
however it was started, and MPI fails there in ways that say nothing about the cause:

- A *forked* child (``multiprocessing``'s default ``fork`` start method on Linux, which PyTorch's
  DataLoader workers use) inherits a copy of hvdlite's initialized state but not its background
  thread, and shares the rank's MPI connection.  A collective there would wait for a thread that
  does not exist; MPI calls there corrupt the parent's connection.  hvdlite records the fork and
  refuses operations in the child at once, while queries such as ``hvd.rank()`` keep working.
- A *spawned* child (``spawn`` or ``forkserver``) starts a fresh interpreter that imports the
  script's main module to find its function: a script without an ``if __name__ == "__main__":``
  guard runs ``hvd.init()`` again there, and MPICH aborts that child with a PMI error.  hvdlite
  recognises the case from a marker that ``init()`` leaves in the rank's environment.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

from hvdlite.common.errors import RankChildProcessError

# Where MPI launchers put the rank of each process they start (Hydra/PMI, Open MPI, PMIx, and
# Hydra's manual launch that hvdlite's Ray and torchrun formations use).
LAUNCHER_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_ID")

# Set by init() in a rank's environment: "<pid>:<rank>".  Children inherit it.
RANK_PROCESS_VARIABLE = "HVDLITE_RANK_PROCESS"


def mark_rank_process(rank: int) -> None:
    """Record in this process's environment that it is rank ``rank`` of a running job."""
    os.environ[RANK_PROCESS_VARIABLE] = f"{os.getpid()}:{rank}"


def _marked_rank(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(pid, rank) from the marker, or None if absent or malformed."""
    pid, _, rank = environ.get(RANK_PROCESS_VARIABLE, "").partition(":")
    if not (pid.isdigit() and rank.isdigit()):
        return None
    return int(pid), int(rank)


def spawned_child_of_rank(environ: Mapping[str, str], pid: int,
                          multiprocessing_child: bool) -> tuple[int, int] | None:
    """(parent pid, parent rank) when a process with this environment and ``pid``, started by
    ``multiprocessing`` or not, is a child that an initialized rank started, which cannot
    initialize MPI: it inherited the launcher's per-rank environment.  None otherwise (e.g. the
    parent was a single process started without a launcher: its children may run their own
    single-process jobs).  Pure logic, unit-tested."""
    marked = _marked_rank(environ)
    if not multiprocessing_child or marked is None or marked[0] == pid:
        return None
    if not any(environ.get(name, "").strip() for name in LAUNCHER_RANK_VARIABLES):
        return None
    return marked


def refuse_spawned_child() -> None:
    """Raise :class:`RankChildProcessError` if ``hvd.init()`` runs in a ``spawn`` or
    ``forkserver`` child of a rank (see the module docstring)."""
    # A multiprocessing child has imported multiprocessing; no need to import it here.  While
    # it still imports the main module (where an unguarded hvd.init() runs) its parent is not
    # recorded yet, but its name already is.
    process = sys.modules.get("multiprocessing.process")
    is_child = process is not None and (process.parent_process() is not None
                                        or process.current_process().name != "MainProcess")
    found = spawned_child_of_rank(os.environ, os.getpid(), is_child)
    if found is None:
        return
    parent_pid, parent_rank = found
    raise RankChildProcessError(
        f"hvd.init() was called in process {os.getpid()}, a child that rank {parent_rank}'s "
        f"process (pid {parent_pid}) started with multiprocessing (e.g. a DataLoader worker "
        f"with the 'spawn' or 'forkserver' start method). Only the processes the MPI launcher "
        f"started can join the job. Such a child imports your script's main module to find "
        f"its function, so code at the script's top level runs again there: move the "
        f"training code under `if __name__ == \"__main__\":` (or into a function called from "
        f"there), and pass hvd.rank() / hvd.size() to the child as arguments if it needs them.")


def forked_child_error(what: str, parent_pid: int, parent_rank: int) -> RankChildProcessError:
    """The error for ``what`` attempted in a child forked from an initialized rank."""
    return RankChildProcessError(
        f"{what} cannot run in process {os.getpid()}: it was forked from rank {parent_rank}'s "
        f"process (pid {parent_pid}) after hvd.init(). A forked child (a DataLoader worker, a "
        f"multiprocessing.Process with the 'fork' start method) has a copy of hvdlite's state "
        f"but not its background thread, and must not use the rank's MPI connection: "
        f"collective operations, init/shutdown and process sets are unavailable there, while "
        f"queries such as hvd.rank() and hvd.size() still work. Run collective operations in "
        f"the rank's own process.")
