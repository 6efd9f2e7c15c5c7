"""Every knob hvdlite reads from the environment, declared once in :data:`KNOBS`.

Each knob is ``HVDLITE_<NAME>``; Horovod's ``HOROVOD_<NAME>`` is accepted as an alias so existing
launch scripts keep working (the hvdlite spelling wins when both are set).  The table drives
:class:`Config` (each field's default, parsing and checks), ``hvdlite run``'s tuning flags
(:mod:`hvdlite.runner.launch`) and the knob reference in the docs (``scripts/mkdocs_knobs.py``
renders it into ``docs/knobs.md`` at build time).  Whose value counts is the knob's ``agree``:
rank 0's values are broadcast at ``init()``, because knobs that shape the communication pattern
(fusion threshold, cache capacity) must agree on every rank or the ranks would issue different
collectives; a few are each rank's own.

This module imports only the standard library and :mod:`hvdlite.common.knob_kinds` (the
kinds of value and the run flags): the docs build loads the two on their own.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

# The kinds of value and the run flags the table is built from (standard library only, too).
from hvdlite.common.knob_kinds import (ABSOLUTE, LOG_LEVEL_NAME, MB_TO_BYTES, AutoSwitch, Choice,
                                       Flag, Kind, LogLevel, Number, Switch, Text, on_off_flag,
                                       value_flag)

# Longest sleep between two checks while waiting on peers, whatever the cycle time: each sleep's
# overshoot is paid by the wait it ends, and a long cycle is asked for to gather more per round,
# not to notice ready peers late.
MAX_WAIT_SLEEP_SECONDS = 1e-3
MIB = 2**20

# Whose value of a knob counts (the table's "ranks must agree" column).
RANK0 = "rank 0's"          # broadcast from rank 0 at init(): the ranks must agree
OWN = "each rank's own"     # read by every rank for itself (its memory, its log)
RECORDER = "rank 0 only"    # used by rank 0 alone (it records the timeline)

# --- the table ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Knob:
    """One knob: the variable ``HVDLITE_<name>`` (alias ``HOROVOD_<name>``) that sets
    :class:`Config`'s ``field``.  ``default`` is in the variable's own terms (what a user would
    write); ``help`` is plain text (``--help``, error messages, the docs), ``details`` Markdown
    the docs add after it; ``horovod`` says whether Horovod has the variable; ``old_names``:
    earlier names of the knob, still read (after the current ones) so existing scripts keep
    working."""

    name: str
    field: str
    kind: Kind
    default: object
    agree: str
    help: str
    unit: str = ""
    flags: tuple[Flag, ...] = ()
    horovod: str = "no"
    details: str = ""
    old_names: tuple[str, ...] = ()

    @property
    def variable(self) -> str:
        return "HVDLITE_" + self.name

    @property
    def alias(self) -> str:
        return "HOROVOD_" + self.name

    @property
    def variables(self) -> tuple[str, ...]:
        """Every spelling read, in order of precedence: hvdlite's, Horovod's, then the old
        names' (each in both spellings)."""
        return (self.variable, self.alias) + tuple(
            prefix + old for old in self.old_names for prefix in ("HVDLITE_", "HOROVOD_"))

    @property
    def field_default(self):
        return self.kind.to_field(self.default)

    def lookup(self, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
        """``(variable, value)`` of the hvdlite spelling, else the Horovod one, else None (an
        empty value counts as unset): errors name the variable the user actually set."""
        environ = os.environ if environ is None else environ
        for variable in self.variables:
            value = environ.get(variable)
            if value is not None and value.strip() != "":
                return variable, value.strip()
        return None

    def read(self, environ: Mapping[str, str] | None = None):
        """The field's value from ``environ`` (default ``os.environ``); ValueError naming the
        variable when it cannot be read."""
        found = self.lookup(environ)
        return self.field_default if found is None else self.kind.parse(*found, self)


KNOBS: tuple[Knob, ...] = (
    Knob("FUSION_THRESHOLD", "fusion_threshold", Number(int), 128 * MIB, RANK0,
         "largest batch of tensors fused into one allreduce; 0 disables fusion", unit="bytes",
         flags=(value_flag("--fusion-threshold-mb", metavar="MB", conversion=MB_TO_BYTES),),
         horovod="yes"),   # Horovod's default since v0.21
    Knob("CYCLE_TIME", "cycle_time_ms", Number(float), 1.0, RANK0,
         "how long a round gathers a backward pass's tensors before negotiating them, and the "
         "pause between rounds while all ranks wait on each other", unit="ms",
         flags=(value_flag("--cycle-time-ms", metavar="MS"),), horovod="yes",
         details="Waits on peers sleep at most 1 ms (or this, if shorter)."),
    Knob("CACHE_CAPACITY", "cache_capacity", Number(int), 1024, RANK0,
         "negotiated responses remembered; 0 disables the response cache", unit="responses",
         flags=(value_flag("--cache-capacity", metavar="N", value_type=int),), horovod="yes"),
    Knob("STALL_CHECK_TIME_SECONDS", "stall_check_seconds", Number(float), 60.0, RANK0,
         "warn (on rank 0) about tensors submitted on some ranks but not others for this long",
         unit="s", flags=(value_flag("--stall-check-seconds", "--stall-check-warning-time-seconds",
                                     metavar="S"),), horovod="yes"),
    Knob("STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_seconds", Number(float), 0.0, RANK0,
         "after this long, fail a stalled operation with StallError on the ranks that submitted "
         "it; 0: never", unit="s",
         flags=(value_flag("--stall-shutdown-seconds", "--stall-check-shutdown-time-seconds",
                           metavar="S"),), horovod="yes"),
    Knob("STALL_CHECK_DISABLE", "stall_check_enabled", Switch(invert=True), False, RANK0,
         "1 turns the stall inspector off",
         flags=(on_off_flag("--no-stall-check", sets="1", help="disable the stall check"),
                on_off_flag("--stall-check", sets="0",
                            help="keep the stall check on (the default)")), horovod="yes"),
    Knob("LOG_LEVEL", "log_level", LogLevel(), "WARNING", OWN,
         "lowest level of hvdlite's log messages shown",
         flags=(value_flag("--log-level", metavar="LEVEL", value_type=str,
                           choices=("trace", "debug", "info", "warning", "error", "fatal",
                                    "critical"), conversion=LOG_LEVEL_NAME),),
         horovod="yes", details="`DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL`."),
    Knob("DYNAMIC_PROCESS_SETS", "dynamic_process_sets", Switch(), False, RANK0,
         "1 allows add_process_set/remove_process_set after init()", horovod="yes",
         details='As `hvd.init(process_sets="dynamic")` does (see '
                 '[process sets](collectives.md#process-sets)).'),
    Knob("GPU_OPERATIONS", "gpu_operations", Choice(("nccl", "mpi")), "nccl", RANK0,
         "nccl: reduce GPU tensors with NCCL on the device; mpi: stage them through pinned host "
         "memory and use MPI (lets ranks share a GPU)",
         horovod="at build time"),
    Knob("ENABLE_ASYNC_COMPLETION", "gpu_async_completion", Switch(), True, RANK0,
         "1: a GPU tensor's handle completes once its work is queued, and synchronize() makes "
         "the framework's current stream wait for it on the device; 0: the handle completes "
         "after the GPU work has finished", horovod="yes (off by default)",
         details="With `1` the host never waits for the GPU; `0` has simpler semantics (device "
                 "errors are raised by `synchronize()`) but drains the device every step "
                 "(see [GPUs](gpus.md#what-happens-to-a-cuda-tensor))."),
    Knob("SHM_WINDOW_MB", "shm_window_bytes", Number(float, MIB), 64.0, RANK0,
         "largest allreduce reduced through the intra-node shared-memory window; 0: no window",
         unit="MiB",
         details="The window takes a fused batch of 64 KiB or more, or a single tensor of 1 MiB "
                 "or more that does not go by direct copies (see [How it works]"
                 "(how-it-works.md#fusion-and-the-intra-node-shared-memory-window)); each "
                 "rank's window holds two slots of up to this size in `/dev/shm`. `0` with "
                 "`HVDLITE_DIRECT_COPIES=0` too: always MPI. Formerly `HVDLITE_SHM_FUSION_MB`, "
                 "still read as an alias.", old_names=("SHM_FUSION_MB",)),
    Knob("DIRECT_COPIES", "direct_copies", AutoSwitch(), "auto", RANK0,
         "auto: single allreduces of 2 MiB or more by direct copies between the ranks' memory "
         "where the kernel lets every rank reach every peer; 1: the same, warning where it "
         "does not; 0: never",
         details="Linux cross-memory attach (see [How it works]"
                 "(how-it-works.md#direct-copies-between-ranks)). `auto` finds out by trying, "
                 "once; under Yama's `ptrace_scope` 1 each rank first lets in the job's launcher "
                 "process and its descendants. `0`: no probe, no `prctl`. Formerly "
                 "`HVDLITE_CMA`, still read as an alias.", old_names=("CMA",)),
    Knob("HIERARCHICAL_ALLREDUCE", "hierarchical_allreduce", Switch(), True, RANK0,
         "1: allreduces of process sets spanning hosts reduce within each host first, and "
         "only one rank per host exchanges each part of the buffer across hosts; 0: one "
         "MPI allreduce over all the ranks",
         flags=(on_off_flag("--hierarchical-allreduce", sets="1",
                            help="hierarchical allreduce across hosts (the default)"),
                on_off_flag("--no-hierarchical-allreduce", sets="0",
                            help="one flat MPI allreduce across hosts")),
         horovod="yes (off by default; GPU tensors only)",
         details="Host tensors only, not Adasum; used only where a process set spans hosts "
                 "and some host holds several of its ranks. On by default: measured as fast "
                 "as a flat allreduce or faster (see [Multi-host]"
                 "(multi-host.md#hierarchical-allreduce-and-allgather))."),
    Knob("HIERARCHICAL_ALLGATHER", "hierarchical_allgather", Switch(), False, RANK0,
         "1: allgathers of process sets spanning hosts gather each host's rows in shared "
         "memory and exchange them across hosts once per host; 0: one MPI allgather over "
         "all the ranks",
         flags=(on_off_flag("--hierarchical-allgather", sets="1",
                            help="hierarchical allgather across hosts"),
                on_off_flag("--no-hierarchical-allgather", sets="0",
                            help="one flat MPI allgather across hosts")),
         horovod="yes (off by default)",
         details="Host tensors only, results of 64 KiB up to `HVDLITE_SHM_WINDOW_MB`; off by "
                 "default: measured slower than MPI's allgather on these machines (see "
                 "[Multi-host](multi-host.md#hierarchical-allreduce-and-allgather))."),
    Knob("EARLY_REDUCTIONS", "early_reductions", Switch(), True, RANK0,
         "1: named allreduces of up to 64 KiB that run alone in their rounds in a repeating "
         "order (a loss, a small model's gradient bucket, a loop over parameters or metrics) "
         "are reduced beside the negotiation round, one exchange instead of two; 0: always "
         "negotiate first",
         details="The result is the same bits either way (see [How it works]"
                 "(how-it-works.md#early-reductions)); a wrong prediction costs one small "
                 "exchange beside the round."),
    Knob("WATCHDOG", "watchdog", Switch(), True, RANK0,
         "1: every rank keeps a TCP connection to rank 0, so a rank that ends without "
         "hvd.shutdown() on any host (killed, os._exit, its host gone) makes every other rank "
         "raise RankExitedError within seconds; 0: only ranks on the same host notice",
         details="See [Multi-host](multi-host.md#when-a-rank-dies). The connections are idle "
                 "but for TCP keepalive probes; rank 0 listens on `HVDLITE_WATCHDOG_PORT`."),
    Knob("START_TIMEOUT", "start_timeout_seconds", Number(float), 60.0, OWN,
         "seconds hvd.init() waits for the other processes when it forms the world itself "
         "(under torchrun or another env:// launcher)", unit="seconds", horovod="yes",
         details="See [Launching](launching.md). Horovod's variable of the same name bounds "
                 "the start of its Spark and Ray workers."),
    Knob("WATCHDOG_PORT", "watchdog_port", Number(int), 0, RANK0,
         "TCP port rank 0 listens on for the watchdog's connections (0: any free port)",
         details="Set it where a firewall opens only chosen ports between the hosts."),
    Knob("TIMELINE", "timeline_filename", Text("path"), None, RECORDER,
         "file to record a Horovod Timeline into; rank 0 records it",
         flags=(value_flag("--timeline-filename", metavar="FILE", value_type=str,
                           conversion=ABSOLUTE),), horovod="yes",
         details="See [Timeline](timeline.md)."),
    Knob("TIMELINE_MARK_CYCLES", "timeline_mark_cycles", Switch(), False, RECORDER,
         "1 marks every negotiation round on the timeline",
         flags=(on_off_flag("--timeline-mark-cycles", sets="1",
                            help="mark negotiation rounds on the timeline"),
                on_off_flag("--no-timeline-mark-cycles", sets="0",
                            help="do not mark negotiation rounds (the default)")), horovod="yes"),
    Knob("GRADIENT_BUCKET_MB", "gradient_bucket_bytes", Number(float, MIB), 25.0, RANK0,
         "PyTorch DistributedOptimizer: small gradients travel in flat buckets of up to this "
         "size, one allreduce per bucket; 0: every gradient on its own, as in Horovod",
         unit="MiB",   # as torch DDP's bucket_cap_mb; buckets' names and sizes are collectives'
         details="See [gradient buckets](pytorch.md#gradient-buckets)."),
    Knob("RESULT_POOL_MB", "result_pool_bytes", Number(float, MIB), 512.0, OWN,
         "most idle result memory each rank keeps for reuse; 0 turns the pool off", unit="MiB",
         details="See [How it works](how-it-works.md#result-memory)."),
    Knob("AUTOTUNE", "autotune", Switch(), False, RANK0,
         "1: rank 0 tunes the fusion threshold, cycle time, response cache and (where the job "
         "spans hosts) hierarchical allreduce/allgather while the job runs, then keeps the "
         "best; needs scikit-learn",
         flags=(on_off_flag("--autotune", sets="1", help="tune the engine's settings at run "
                            "time (needs scikit-learn)"),
                on_off_flag("--no-autotune", sets="0", help="no autotuning (the default)")),
         horovod="yes", details="See [Autotune](autotune.md)."),
    Knob("AUTOTUNE_LOG", "autotune_log", Text("path"), None, RECORDER,
         "CSV file rank 0 writes every autotune sample into (Horovod's columns), then the best",
         flags=(value_flag("--autotune-log-file", metavar="FILE", value_type=str,
                           conversion=ABSOLUTE),), horovod="yes"),
    Knob("AUTOTUNE_WARMUP_SAMPLES", "autotune_warmup_samples", Number(int), 3, RANK0,
         "autotune samples discarded before the first scored one", unit="samples",
         flags=(value_flag("--autotune-warmup-samples", metavar="N", value_type=int),),
         horovod="yes"),
    Knob("AUTOTUNE_STEPS_PER_SAMPLE", "autotune_steps_per_sample", Number(int), 10, RANK0,
         "steps (a tensor's repetitions) in each of the five parts of an autotune sample",
         unit="steps",
         flags=(value_flag("--autotune-steps-per-sample", metavar="N", value_type=int),),
         horovod="yes"),
    Knob("AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "autotune_bayes_opt_max_samples", Number(int), 20,
         RANK0, "Bayesian optimization samples of fusion threshold and cycle time for each "
         "combination of the on/off settings", unit="samples",
         flags=(value_flag("--autotune-bayes-opt-max-samples", metavar="N", value_type=int),),
         horovod="yes"),
    Knob("AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "autotune_gaussian_process_noise", Number(float),
         0.8, RANK0, "noise the Gaussian process assumes in the (normalized) scores",
         flags=(value_flag("--autotune-gaussian-process-noise", metavar="NOISE"),),
         horovod="yes"),
)
KNOB_BY_NAME: dict[str, Knob] = {knob.name: knob for knob in KNOBS}

DEFAULT_RESULT_POOL_MB = KNOB_BY_NAME["RESULT_POOL_MB"].default


def _default(field: str):
    """The default of ``field``, from the knob that feeds it."""
    return next(knob.field_default for knob in KNOBS if knob.field == field)


@dataclasses.dataclass(frozen=True)
class Config:
    """The knobs' values, one field per knob of :data:`KNOBS` (see there for each one's
    meaning).  ``init()`` uses rank 0's values except where a knob is each rank's own."""

    fusion_threshold: int = _default("fusion_threshold")
    cycle_time_ms: float = _default("cycle_time_ms")
    cache_capacity: int = _default("cache_capacity")
    stall_check_enabled: bool = _default("stall_check_enabled")
    stall_check_seconds: float = _default("stall_check_seconds")
    stall_shutdown_seconds: float = _default("stall_shutdown_seconds")
    log_level: str = _default("log_level")
    start_timeout_seconds: float = _default("start_timeout_seconds")
    dynamic_process_sets: bool = _default("dynamic_process_sets")
    gpu_operations: str = _default("gpu_operations")
    gpu_async_completion: bool = _default("gpu_async_completion")
    result_pool_bytes: int = _default("result_pool_bytes")
    shm_window_bytes: int = _default("shm_window_bytes")
    direct_copies: str = _default("direct_copies")
    gradient_bucket_bytes: int = _default("gradient_bucket_bytes")
    hierarchical_allreduce: bool = _default("hierarchical_allreduce")
    hierarchical_allgather: bool = _default("hierarchical_allgather")
    early_reductions: bool = _default("early_reductions")
    watchdog: bool = _default("watchdog")
    watchdog_port: int = _default("watchdog_port")
    timeline_filename: str | None = _default("timeline_filename")
    timeline_mark_cycles: bool = _default("timeline_mark_cycles")
    autotune: bool = _default("autotune")
    autotune_log: str | None = _default("autotune_log")
    autotune_warmup_samples: int = _default("autotune_warmup_samples")
    autotune_steps_per_sample: int = _default("autotune_steps_per_sample")
    autotune_bayes_opt_max_samples: int = _default("autotune_bayes_opt_max_samples")
    autotune_gaussian_process_noise: float = _default("autotune_gaussian_process_noise")

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
        """Every knob read from ``environ`` (default ``os.environ``); ValueError naming the
        first variable that cannot be read."""
        return cls(**{knob.field: knob.read(environ) for knob in KNOBS})

    def with_rank0(self, rank0: "Config") -> "Config":
        """The settings this rank runs with: ``rank0``'s values, but this rank's own for the
        knobs that are each rank's own (its memory, its log)."""
        return dataclasses.replace(rank0, **{knob.field: getattr(self, knob.field)
                                             for knob in KNOBS if knob.agree == OWN})
