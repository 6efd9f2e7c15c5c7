"""Pinning the engine thread to a core: Horovod's ``HOROVOD_THREAD_AFFINITY`` (horovodrun's
``--thread-affinity``), read as ``HVDLITE_THREAD_AFFINITY`` first.

The value is a comma-separated list of core ids, one per local rank: the process with local rank
``i`` pins its engine threads (one per process set) to core ``i`` of the list.  As in Horovod
(``parse_and_set_affinity`` in horovod/common/common.cc), a value that cannot be read, or lists
fewer cores than the host has local ranks, is logged as an error and nothing is pinned; the
training itself is unaffected.  Linux only (``os.sched_setaffinity`` on the thread's native id).

The local rank comes from the launcher's variables (:data:`LOCAL_RANK_VARIABLES`), because the
engine thread starts before ``hvd.init()`` has published the topology.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Mapping

log = logging.getLogger("hvdlite")

VARIABLES = ("HVDLITE_THREAD_AFFINITY", "HOROVOD_THREAD_AFFINITY")
# (local rank, local size) as each launcher announces them: MPICH/Intel MPI's Hydra, Open MPI,
# torchrun / env://, Slurm's srun.
LOCAL_RANK_VARIABLES = (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                        ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                        ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                        ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"))


def parse_cores(text: str) -> list[int]:
    """``"3,7"`` -> ``[3, 7]``; ValueError saying what is wrong (an empty entry, a word that is
    not a non-negative integer)."""
    cores = []
    for word in text.split(","):
        word = word.strip()
        if not word.isdigit():
            raise ValueError(f"{word!r} is not a core id (a non-negative integer); give one core "
                             f"per local rank, separated by commas, e.g. 0,1")
        cores.append(int(word))
    return cores


def local_rank_and_size(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """This process's local rank and the number of local ranks, from the first launcher whose
    variables are set; None when no launcher announced them."""
    for rank_name, size_name in LOCAL_RANK_VARIABLES:
        rank, size = environ.get(rank_name, "").strip(), environ.get(size_name, "").strip()
        if rank.isdigit() and size.isdigit():
            return int(rank), int(size)
    return None


def core_for_this_rank(environ: Mapping[str, str]) -> tuple[int | None, str | None]:
    """``(core, None)``: the core this process's engine threads go to; ``(None, None)`` when
    no affinity is asked for; ``(None, problem)`` when it cannot be followed."""
    for name in VARIABLES:
        text = environ.get(name, "").strip()
        if text:
            break
    else:
        return None, None
    try:
        cores = parse_cores(text)
    except ValueError as exc:
        return None, f"{name}={text}: {exc}"
    local = local_rank_and_size(environ)
    if local is None:
        if len(cores) == 1:   # one process here as far as anyone announced: the only entry
            return cores[0], None
        return None, (f"{name}={text}: no launcher variable gives this process's local rank "
                      f"({', '.join(rank for rank, _ in LOCAL_RANK_VARIABLES)})")
    rank, size = local
    if len(cores) < size:
        return None, (f"{name}={text}: expected {size} core ids (one per local rank), got "
                      f"{len(cores)}")
    return cores[rank], None


def pin_engine_thread(environ: Mapping[str, str] | None = None) -> int | None:
    """Called by each engine thread as it starts: pin the calling thread to this rank's core
    (see the module docstring); the core, or None when nothing was pinned."""
    core, problem = core_for_this_rank(os.environ if environ is None else environ)
    if problem is None and core is not None:
        try:
            os.sched_setaffinity(threading.get_native_id(), {core})
            log.info("engine thread %s pinned to core %d", threading.current_thread().name,
                     core)
            return core
        except (OSError, AttributeError) as exc:   # a core this process may not use; not Linux
            problem = f"cannot pin the engine thread to core {core}: {exc}"
    if problem is not None:
        log.error("thread affinity: %s; the engine thread is not pinned", problem)
    return None
