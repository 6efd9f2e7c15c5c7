"""Engine settings read from the environment.

Each knob is ``HVDLITE_<NAME>``; Horovod's ``HOROVOD_<NAME>`` is accepted as an alias so existing
launch scripts keep working (the hvdlite spelling wins when both are set).  Rank 0's values are
broadcast at ``init()``: knobs that shape the communication pattern (fusion threshold, cache
capacity) must agree on every rank or the ranks would issue different collectives.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024  # bytes, Horovod's default since v0.21
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_CACHE_CAPACITY = 1024
DEFAULT_STALL_CHECK_SECONDS = 60.0
DEFAULT_RESULT_POOL_MB = 512.0
DEFAULT_SHM_FUSION_MB = 64.0
DEFAULT_GRADIENT_BUCKET_MB = 25.0   # as torch DDP's bucket_cap_mb
# Longest sleep between two checks while waiting on peers, whatever the cycle time: each sleep's
# overshoot is paid by the wait it ends, and a long cycle is asked for to gather more per round,
# not to notice ready peers late.
MAX_WAIT_SLEEP_SECONDS = 1e-3


def _setting(name: str, environ: Mapping[str, str] | None) -> tuple[str, str] | None:
    """``(variable, value)`` of ``HVDLITE_<name>``, else ``HOROVOD_<name>``, else None: errors
    name the variable the user actually set."""
    environ = os.environ if environ is None else environ
    for prefix in ("HVDLITE_", "HOROVOD_"):
        value = environ.get(prefix + name)
        if value is not None and value.strip() != "":
            return prefix + name, value.strip()
    return None


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Value of ``HVDLITE_<name>``, else ``HOROVOD_<name>``, else None."""
    found = _setting(name, environ)
    return None if found is None else found[1]


def _number(name: str, default: float, environ: Mapping[str, str] | None, cast=float):
    found = _setting(name, environ)
    if found is None:
        return default
    variable, raw = found
    try:
        value = cast(float(raw)) if cast is int else cast(raw)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not a number.") from None
    if value < 0:
        raise ValueError(f"{variable}={raw!r} must not be negative.")
    return value


GPU_OPERATIONS = ("nccl", "mpi")


def _gpu_operations(environ: Mapping[str, str] | None) -> str:
    found = _setting("GPU_OPERATIONS", environ)
    if found is None:
        return "nccl"
    variable, raw = found
    value = raw.lower()
    if value not in GPU_OPERATIONS:
        raise ValueError(f"{variable}={raw!r} is not one of "
                         f"{', '.join(GPU_OPERATIONS)} (nccl: reduce GPU tensors with NCCL on "
                         f"the device; mpi: stage them through host memory and use MPI).")
    return value


_ON_WORDS = ("1", "true", "yes", "on")
_OFF_WORDS = ("0", "false", "no", "off")


def _switch(name: str, environ: Mapping[str, str] | None, default: bool, meaning: str) -> bool:
    """An on/off knob: 1/true/yes/on or 0/false/no/off (any case), ``default`` when unset.
    Other integers read as Horovod reads them (on if positive).  Anything else is an error
    naming the variable: a typo must not silently pick a behaviour."""
    found = _setting(name, environ)
    if found is None:
        return default
    variable, raw = found
    word = raw.lower()
    if word in _ON_WORDS:
        return True
    if word in _OFF_WORDS:
        return False
    try:
        return int(word) > 0
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not understood; use 1 or 0 "
                         f"({meaning}).") from None


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the on/off knob ``HVDLITE_<name>`` (or ``HOROVOD_<name>``) is on; unset is off,
    and a value that is neither an on/off word nor an integer raises ``ValueError``."""
    return _switch(name, environ, False, "1 turns it on, 0 or unset leaves it off")


def _cma_mode(environ: Mapping[str, str] | None) -> str:
    if (env_value("CMA", environ) or "auto").lower() == "auto":
        return "auto"
    return "on" if _switch("CMA", environ, False, "or auto, the default: direct copies between "
                           "ranks where the kernel allows them; 1: the same, warning where it "
                           "cannot; 0: never") else "off"


def _async_completion(environ: Mapping[str, str] | None) -> bool:
    return _switch("ENABLE_ASYNC_COMPLETION", environ, True,
                   "1, the default: a GPU handle completes once its work is queued, and wait() "
                   "makes the framework's stream wait for it; 0: wait() returns after the GPU "
                   "work has finished")


@dataclasses.dataclass(frozen=True)
class Config:
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    cycle_time_ms: float = DEFAULT_CYCLE_TIME_MS
    cache_capacity: int = DEFAULT_CACHE_CAPACITY
    stall_check_enabled: bool = True
    stall_check_seconds: float = DEFAULT_STALL_CHECK_SECONDS
    stall_shutdown_seconds: float = 0.0  # 0 = never turn a stall into an error
    log_level: str = "WARNING"
    dynamic_process_sets: bool = False   # allow add_process_set / remove_process_set
    gpu_operations: str = "nccl"         # how GPU tensors move: "nccl" or "mpi" (host-staged)
    # GPU handles complete once their work is queued; wait() orders the framework's stream after
    # it on the device (False: complete after the host saw the work finish).
    gpu_async_completion: bool = True
    # Idle host result memory kept for reuse (memory.BufferPool); per rank, need not agree.
    result_pool_bytes: int = int(DEFAULT_RESULT_POOL_MB * 2**20)
    # Largest fused batch reduced through intra-node shared memory (shm_fusion.SharedFusion).
    shm_fusion_bytes: int = int(DEFAULT_SHM_FUSION_MB * 2**20)
    # Single large allreduces by direct copies between ranks (direct_allreduce): "auto" (where
    # the kernel allows it), "on" (the same, but warn where it does not) or "off".
    cma: str = "auto"
    # DistributedOptimizer packs small gradients into flat buckets of up to this many bytes,
    # reduced as one tensor each (0: every gradient on its own, as Horovod does).  Must agree
    # on every rank (the buckets' names and sizes are collectives'), hence rank 0's value.
    gradient_bucket_bytes: int = int(DEFAULT_GRADIENT_BUCKET_MB * 2**20)

    @property
    def cycle_seconds(self) -> float:
        """The cycle (``HVDLITE_CYCLE_TIME``) in seconds, at least 10 us: how long a round
        gathers a gradient stream's entries, and the pause between rounds in which every rank
        waits and nothing matched."""
        return max(self.cycle_time_ms, 0.01) / 1000.0

    @property
    def wait_sleep_cap(self) -> float:
        """Longest back-off sleep while waiting on peers: the cycle, but at most 1 ms."""
        return min(self.cycle_seconds, MAX_WAIT_SLEEP_SECONDS)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Config":
        return cls(
            fusion_threshold=_number("FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD, environ, int),
            cycle_time_ms=_number("CYCLE_TIME", DEFAULT_CYCLE_TIME_MS, environ),
            cache_capacity=_number("CACHE_CAPACITY", DEFAULT_CACHE_CAPACITY, environ, int),
            stall_check_enabled=not _switch("STALL_CHECK_DISABLE", environ, False,
                                            "1 turns the stall inspector off"),
            stall_check_seconds=_number(
                "STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_CHECK_SECONDS, environ),
            stall_shutdown_seconds=_number("STALL_SHUTDOWN_TIME_SECONDS", 0.0, environ),
            log_level=(env_value("LOG_LEVEL", environ) or "WARNING").upper(),
            dynamic_process_sets=_switch(
                "DYNAMIC_PROCESS_SETS", environ, False,
                "1 allows add_process_set/remove_process_set after init()"),
            gpu_operations=_gpu_operations(environ),
            gpu_async_completion=_async_completion(environ),
            result_pool_bytes=int(_number("RESULT_POOL_MB", DEFAULT_RESULT_POOL_MB, environ)
                                  * 2**20),
            shm_fusion_bytes=int(_number("SHM_FUSION_MB", DEFAULT_SHM_FUSION_MB, environ)
                                 * 2**20),
            cma=_cma_mode(environ),
            gradient_bucket_bytes=int(_number("GRADIENT_BUCKET_MB", DEFAULT_GRADIENT_BUCKET_MB,
                                              environ) * 2**20),
        )
